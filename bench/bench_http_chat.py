"""Time to first token of a 10-turn chat over the OpenAI-compatible HTTP API, with the
Mamba-state prefix cache beside without it.

Usage: ``.venv/bin/python bench/bench_http_chat.py [--turns N] [--rounds R] [--json OUT]``

Processes: one private redis-server and two ``ssmserve-server --http`` workers on
loopback, the same model and settings but ``--http-prefix-cache 8`` (the default) on one
and ``0`` on the other; this process is the client (the ``openai`` package, streaming).
Model: mamba-130m's dims (hidden 768, 24 layers; random weights) with the tests' chat
tokenizer and template (``tests/http_models.py``: a byte-level BPE of 320 ids, so the
vocabulary's head is small and the time is the layers').

Each round holds one conversation of ``--turns`` user turns (about 40 tokens each) and
32-token replies (temperature 0.8, a seed per turn, EOS ignored), sent to both workers
turn by turn, taking turns (the same request to each): with the cache, a turn's prompt
(the previous prompt, the reply, the new turn) continues the session of the turn before
and prefills only the new tokens; without it, the whole conversation is prefilled again.
Time to first token: from sending the request to the first server-sent event (the door
sends it once the first token is drawn). The replies must be the same on both workers
(the cache is exact); the script fails otherwise.
"""

from __future__ import annotations

import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai
from harness import Workers, standard_parser, table, worker_args, write_result

from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.engine.presets import preset_config
from tests.http_models import write_chat_model

SYSTEM = "You are a helpful assistant. Answer briefly, in plain words, about state spaces."
TURNS = [
    "hello there, how are you today? tell me about state space models please",
    "what does the quick brown fox have to do with the lazy dog in that sentence?",
    "a Mamba state is a prefix cache: can the next turn continue from it at once?",
    "how large is the fixed-size state that is carried from token to token, roughly?",
    "café crème and 日本語 in one line: does the tokenizer keep every byte of them?",
    "say hello world again, and then tell me how the state space grows with time",
    "the quick brown fox jumps over the lazy dog: count its words for me, please",
    "how are you carrying this whole conversation without reading it again each turn?",
    "is the state after the reply exactly what a fresh prefill of it would give?",
    "thank you, that is all for today; one last line about state space models",
]
REPLY_TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_turn(
    client: openai.OpenAI, messages: list[dict[str, str]], seed: int
) -> tuple[float, str]:
    """(seconds to the first event, the reply) of one streamed turn."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="chat", messages=messages, max_tokens=REPLY_TOKENS, temperature=0.8,
        seed=seed, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = None
    parts = []
    for chunk in stream:
        if first is None:
            first = time.perf_counter() - started
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
    assert first is not None
    return first, "".join(parts)


def run(turns: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_chat_model(root / "chat", config=preset_config("mamba-130m"))
        redis = EmbeddedRedis(EmbeddedRedisSettings(data_dir=root / "redis")).start()
        workers = Workers(root)
        try:
            clients = {}
            for name, cache in (("cached", 8), ("uncached", 0)):
                port = free_port()
                cmd = worker_args([("chat", root / "chat")], redis.url, root / name)
                cmd += ["--http", f"127.0.0.1:{port}", "--http-prefix-cache", str(cache)]
                workers.start(cmd, name)
                clients[name] = openai.OpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                    timeout=600,
                )  # fmt: skip
            for client in clients.values():  # warm: the first request's own costs
                chat_turn(client, [{"role": "user", "content": "hi"}], 0)
            ttft: dict[str, list[list[float]]] = {name: [] for name in clients}
            prompt_tokens: list[int] = []
            for r in range(rounds):
                history = {name: [{"role": "system", "content": SYSTEM}] for name in clients}
                for name in clients:
                    ttft[name].append([])
                for t in range(turns):
                    replies = {}
                    for name, client in clients.items():
                        history[name].append({"role": "user", "content": TURNS[t % len(TURNS)]})
                        seconds, reply = chat_turn(client, history[name], seed=1000 * r + t)
                        ttft[name][-1].append(seconds)
                        history[name].append({"role": "assistant", "content": reply})
                        replies[name] = reply
                    if replies["cached"] != replies["uncached"]:
                        raise SystemExit(f"turn {t + 1}: the replies differ: {replies}")
                    if r == 0:
                        prompt_tokens.append(
                            _prompt_tokens(clients["uncached"], history["uncached"][:-1])
                        )
        finally:
            workers.close()
            redis.stop()
    per_turn = {
        name: [statistics.median(rnd[t] for rnd in rows) * 1000 for t in range(turns)]
        for name, rows in ttft.items()
    }
    return {"turns": turns, "rounds": rounds, "reply_tokens": REPLY_TOKENS,
            "prompt_tokens": prompt_tokens, "ttft_ms": per_turn}  # fmt: skip


def _prompt_tokens(client: openai.OpenAI, messages: list[dict[str, str]]) -> int:
    reply = client.chat.completions.create(
        model="chat", messages=messages, max_tokens=1, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def main() -> int:
    parser = standard_parser(__doc__, rounds=3)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    result = run(args.turns, args.rounds)
    cached, uncached = result["ttft_ms"]["cached"], result["ttft_ms"]["uncached"]
    rows = [
        [t + 1, result["prompt_tokens"][t], cached[t], uncached[t], cached[t] / uncached[t]]
        for t in range(args.turns)
    ]
    print(table(["turn", "prompt tokens", "cached ms", "uncached ms", "ratio"], rows))
    if args.json:
        write_result(args.json, result, line=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
