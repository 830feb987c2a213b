"""Constrained output per token at a released Mamba vocabulary's size (50,280 ids): a
seeded draw alone beside the same draw guided by llguidance (the mask computed, applied,
and the drawn token consumed), interleaved round by round.

Usage: ``.venv/bin/python bench/bench_constraints.py [--rounds 5] [--tokens 200] [--json OUT]``

The tokenizer is a byte-level BPE of 50,280 ids (GPT-NeoX's size, the released Mamba
checkpoints') trained here on seeded random words (a minute; no download). The logits are
``N(0, 2.5)`` float32 per step, drawn at temperature 1, top-p 0.9. A guided generation
that completes starts again from a fresh matcher. Each round times every setting's
tokens one after the other (who goes first alternates), so both see the same drift on this
shared host; the figures are the median over rounds of a round's mean per token, and the
ratio guided / plain per round, its median.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
from common import table
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ssmserve.server.engine.tokenizer import ModelTokenizer
from ssmserve.server.sessions.constraints import (
    Constraint,
    GrammarTokenizers,
    compile_constraint,
    masked,
)
from ssmserve.server.sessions.sampling import SamplingParams, draw

VOCAB = 50_280
PARAMS = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "JSON schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "regex [a-z ]+": Constraint("regex", "[a-z ]+"),
}


def tokenizer() -> Tokenizer:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))

    corpus = [" ".join(word() for _ in range(50)) + ' {"k": "v", "n": 12}' for _ in range(40_000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, show_progress=False, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return tok


def plain(steps: list[np.ndarray]) -> float:
    started = time.perf_counter()
    for s, x in enumerate(steps):
        draw(PARAMS, (PARAMS.seed, s), x)
    return (time.perf_counter() - started) / len(steps)


def guided(compiled: object, steps: list[np.ndarray]) -> float:
    matcher = compiled.matcher()  # type: ignore[attr-defined]
    end = frozenset({0})
    started = time.perf_counter()
    for s, x in enumerate(steps):
        d = draw(PARAMS, (PARAMS.seed, s), masked(x, matcher.allowed(end)))
        if d.token in end or not matcher.consume(d.token) or matcher.complete:
            matcher = compiled.matcher()  # type: ignore[attr-defined]
    return (time.perf_counter() - started) / len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trained = tokenizer()
    started = time.perf_counter()
    built = GrammarTokenizers().get(ModelTokenizer(trained, "bench"), VOCAB)
    setup = {"grammar tokenizer build ms": round((time.perf_counter() - started) * 1e3, 1)}
    compiled = {}
    for name, c in CONSTRAINTS.items():
        t0 = time.perf_counter()
        compiled[name] = compile_constraint(c, built)
        setup[f"{name}: compile ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    rng = np.random.default_rng(1)
    steps = [(rng.standard_normal(VOCAB) * 2.5).astype(np.float32) for _ in range(args.tokens)]
    per: dict[str, list[float]] = {"plain": [], **{n: [] for n in compiled}}
    for r in range(args.rounds):
        order = ["plain", *compiled] if r % 2 == 0 else [*compiled, "plain"]
        for name in order:
            per[name].append(plain(steps) if name == "plain" else guided(compiled[name], steps))
    rows, result = [], {"setup": setup, "per_token_us": {}, "ratio_to_plain": {}}
    for name, times in per.items():
        us = statistics.median(times) * 1e6
        ratio = statistics.median(t / p for t, p in zip(times, per["plain"], strict=True))
        result["per_token_us"][name] = round(us, 1)
        result["ratio_to_plain"][name] = round(ratio, 2)
        rows.append([name, f"{us:.0f}", f"{ratio:.2f}x"])
    print(table(["setting", "us / token", "vs plain draw"], rows))
    print(json.dumps(setup))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
