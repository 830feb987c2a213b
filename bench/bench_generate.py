"""Generate's tokens per second through the service, with what it replaces beside it.

Usage: ``.venv/bin/python bench/bench_generate.py [--tokens N] [--rounds R] [--json OUT]``

Processes: one private redis-server (AOF on, appendfsync everysec) and one
``ssmserve-server`` worker on loopback; this process is the client
(``ssmserve.client.aio.AsyncClient``). Model: the tests' token fixture (``token_config``:
vocab 37, hidden 24, 2 layers), so what is timed is the service's per-token path (intake,
stepper, log write, the draw, the answer), not the engine.

Measured in the same rounds, taking turns (medians over the rounds), every generation
``--tokens`` tokens at temperature 0.9, top-k 20, top-p 0.95, seed fixed, log durability:
- Generate at batch 1: one session;
- Generate x 8: eight sessions at once (their steps share the stepper's batches);
- the client's own loop at batch 1: a Stream whose next input is drawn by the client from
  the answer it just got (``sampling.draw``, same parameters): what Generate replaces.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_migration import Workers, server_cmd
from common import table

from ssmserve.client.aio import AsyncClient
from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.sessions.sampling import SamplingParams, draw
from tests.conftest import token_config, write_model

PARAMS = {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 7}
PROMPT = [3, 1, 4, 1, 5]


async def generate_once(client: AsyncClient, sessions: int, tokens: int) -> float:
    """Seconds for ``sessions`` generations of ``tokens`` tokens at once."""
    sids = [(await client.create_session("lm")).session_id for _ in range(sessions)]
    for sid in sids:  # the prompt fed before the clock starts
        async for _ in client.stream_steps(sid, PROMPT, steps_per_message=len(PROMPT)):
            pass

    async def one(sid: str) -> int:
        return len([t async for t in client.generate(sid, tokens, at_step=len(PROMPT), **PARAMS)])

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(sid) for sid in sids))
    elapsed = time.perf_counter() - started
    assert counts == [tokens] * sessions, counts
    for sid in sids:
        await client.close_session(sid)
    return elapsed


async def client_loop_once(client: AsyncClient, tokens: int) -> float:
    """Seconds for one generation of ``tokens`` tokens drawn by the client over Stream."""
    sid = (await client.create_session("lm")).session_id
    p = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    fed: asyncio.Queue[int | None] = asyncio.Queue()

    async def inputs():  # type: ignore[no-untyped-def]
        while (token := await fed.get()) is not None:
            yield token

    for token in PROMPT[:-1]:
        fed.put_nowait(token)
    started = time.perf_counter()
    fed.put_nowait(PROMPT[-1])
    drawn = 0
    async for out in client.stream_steps(sid, inputs(), first_step=1):
        if out.step < len(PROMPT):
            continue
        if drawn == tokens:
            fed.put_nowait(None)
            continue
        fed.put_nowait(draw(p, (p.seed, out.step), out.output).token)
        drawn += 1
    elapsed = time.perf_counter() - started
    await client.close_session(sid)
    return elapsed


async def measure(address: str, tokens: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"generate_b1": [], "generate_x8": [], "client_loop_b1": []}
    async with AsyncClient(address) as client:
        await generate_once(client, 1, 50)  # warm up
        for _ in range(rounds):
            times["generate_b1"].append(await generate_once(client, 1, tokens))
            times["generate_x8"].append(await generate_once(client, 8, tokens))
            times["client_loop_b1"].append(await client_loop_once(client, tokens))
    return {
        "generate_b1_tokens_per_s": tokens / statistics.median(times["generate_b1"]),
        "generate_x8_tokens_per_s": 8 * tokens / statistics.median(times["generate_x8"]),
        "generate_x8_per_session_tokens_per_s": tokens / statistics.median(times["generate_x8"]),
        "client_loop_b1_tokens_per_s": tokens / statistics.median(times["client_loop_b1"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_model(root / "lm", token_config(), seed=3)
        redis = EmbeddedRedis(EmbeddedRedisSettings(data_dir=root / "redis"))
        workers = Workers(root)
        with redis:
            try:
                _proc, address = workers.start(
                    server_cmd([("lm", root / "lm")], redis.url, root / "w0"), "w0"
                )
                result = asyncio.run(measure(address, args.tokens, args.rounds))
            finally:
                workers.close()
    print(table(["measure", "tokens/s"], [[k, f"{v:.0f}"] for k, v in result.items()]))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
