"""Generate's sampler per token at a released Mamba vocabulary (50,280 ids): the sampler
beside its reference (the full-argsort definition kept in tests/test_sampling_exact.py),
interleaved draw by draw, every draw checked to be the reference's (token and logprob bits).

Usage: ``.venv/bin/python bench/bench_sampling.py [--rounds 7] [--draws 40] [--json OUT]``

Why interleaved: on this shared host a figure drifts by tens of percent between runs
minutes apart; each round draws every step with one, then with the other (who goes first
alternates), per setting, so both see the same drift, and the ratio is taken per round.
The figures per token are the median over rounds of a round's median draw, and the
fastest draw (the one least disturbed by the other processes on the host). The logits
are ``N(0, sigma)`` float32 with a fresh head of 20 ids raised by 4 each step: sigma 2.5
puts ~5,000 ids in top-p 0.9's head, sigma 1 (flat) ~30,000 (near the worst case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_sampling_exact import reference_draw

from ssmserve.server.sessions.sampling import Draw, SamplingParams, draw

VOCAB = 50_280
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "T=1, top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "T=1, top_k 40": SamplingParams(temperature=1.0, top_k=40),
    "T=1, min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "T=1 (no filter)": SamplingParams(temperature=1.0),
}
Sampler = Callable[[SamplingParams, tuple[int, int], np.ndarray], Draw]


def logits_steps(sigma: float, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(VOCAB) * sigma).astype(np.float32)
    steps = []
    for _ in range(n):
        x = base.copy()
        x[rng.integers(0, VOCAB, 20)] += 4.0
        steps.append(x)
    return steps


def timed(sampler: Sampler, params: SamplingParams, steps: list[np.ndarray]) -> list[Draw]:
    return [sampler(params, (params.seed, s), x) for s, x in enumerate(steps)]


def one_draw_seconds(sampler: Sampler, params: SamplingParams, step: int, x: np.ndarray) -> float:
    t0 = time.perf_counter()
    sampler(params, (params.seed, step), x)
    return time.perf_counter() - t0


def bench(sigma: float, rounds: int, draws: int) -> list[dict[str, object]]:
    steps = logits_steps(sigma, draws, seed=1)
    results = []
    for name, params in SETTINGS.items():
        want = timed(reference_draw, params, steps)
        got = timed(draw, params, steps)
        assert [(d.token, d.logprob.hex()) for d in got] == [
            (d.token, d.logprob.hex()) for d in want
        ], f"{name}: the sampler drew otherwise than its reference"
        before: list[list[float]] = []
        after: list[list[float]] = []
        for r in range(rounds):
            pair: tuple[list[float], list[float]] = ([], [])
            for s, x in enumerate(steps):  # each step by one, then the other; who goes
                for k in (0, 1) if (r + s) % 2 else (1, 0):  # first alternates
                    pair[k].append(one_draw_seconds((reference_draw, draw)[k], params, s, x))
            before.append(pair[0])
            after.append(pair[1])
        results.append(
            {
                "sigma": sigma,
                "setting": name,
                "reference_ms": statistics.median(map(statistics.median, before)) * 1e3,
                "sampler_ms": statistics.median(map(statistics.median, after)) * 1e3,
                "reference_best_ms": min(map(min, before)) * 1e3,
                "sampler_best_ms": min(map(min, after)) * 1e3,
                "speedup": statistics.median(
                    statistics.median(b) / statistics.median(a)
                    for b, a in zip(before, after, strict=True)
                ),
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--draws", type=int, default=40, help="steps per round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = bench(2.5, args.rounds, args.draws) + bench(1.0, args.rounds, args.draws)
    rows = [
        [r[k] for k in ("sigma", "setting", "reference_ms", "sampler_ms")]
        + [r[k] for k in ("reference_best_ms", "sampler_best_ms", "speedup")]
        for r in results
    ]
    headers = ["sigma", "setting", "reference ms/token", "sampler ms/token"]
    headers += ["reference best", "sampler best", "speedup (x)"]
    print(f"vocabulary {VOCAB:,}, {args.rounds} interleaved rounds of {args.draws} draws")
    print(table(headers, rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
