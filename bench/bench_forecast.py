"""Forecast and fork latency through the service, with what they replace beside them.

Usage: ``.venv/bin/python bench/bench_forecast.py [--quick] [--skip-130m] [--json OUT]``

Processes: one private redis-server (AOF on, appendfsync everysec) and two
``ssmserve-server`` workers on loopback sharing it; this process is the client
(``ssmserve.client.aio.AsyncClient``). Models: the demo model (4 -> 4 signal) and a token model
with mamba-130m's shape (``harness.mamba_130m_model()``: vocab 50,280, so every
forecast step returns 201 KB of logits), saved to a temp dir for the workers.

Measured, each side by side in the same run:
- forecast of H = 1, 16, 128 steps from a session's current step (p50 of repeats),
  against (a) the engine alone doing the same H steps in this process (``MambaModel.step``
  at batch 1, no service: the floor), and (b) what a client does without Forecast:
  fork a copy and stream it its own outputs, one ping-pong step at a time.
- batching: N sessions forecasting H = 16 at once, against the same N forecasts one
  after the other (the forecaster steps concurrent forecasts in one engine call).
- fork latency (p50): at the current step (live state), at a step 8 past a snapshot
  (8 inputs replayed), and placed on the other worker (``target``), against
  CreateSession and a manual Snapshot of the same model (a fork writes one checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    Workers,
    mamba_130m_config,
    private_redis,
    standard_parser,
    table,
    worker_args,
    write_preset_model,
    write_result,
)

from ssmserve.client.aio import AsyncClient
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import BatchState
from ssmserve.server.main import ensure_demo_model
from ssmserve.v1 import ssmserve_pb2 as pb


def save_130m(directory: Path) -> Path:
    """The weights ``harness.mamba_130m_model()`` uses, on disk for the workers."""
    return write_preset_model(directory, mamba_130m_config())


def engine_floor(model: MambaModel, warm: np.ndarray, horizon: int, repeats: int) -> float:
    """Seconds for ``horizon`` batch-1 steps fed their own outputs, engine only."""
    outs, state = model.run(warm)
    samples = []
    for _ in range(repeats):
        batch, out = BatchState.stack([state]), outs[-1]
        t0 = time.perf_counter()
        for _ in range(horizon):
            fed = np.array([np.argmax(out)]) if model.config.is_token_model else out[None]
            batch, o = model.step(batch, fed)
            out = o[0]
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def warm_inputs(model: MambaModel, steps: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = model.config
    if c.is_token_model:
        return rng.integers(0, c.vocab_size, steps)
    return rng.standard_normal((steps, c.input_dim)).astype(np.float32)


def as_values(model: MambaModel, x: np.ndarray) -> list[object]:
    return [int(t) for t in x] if model.config.is_token_model else list(x)


async def timed(coro_fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await coro_fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def by_hand(
    client: AsyncClient, sid: str, first_output: np.ndarray, horizon: int, token: bool
) -> None:
    out = first_output
    for _ in range(horizon):
        fed = int(np.argmax(out)) if token else out
        async for answer in client.stream_steps(sid, [fed]):
            out = answer.output


async def bench_model(
    name: str, model: MambaModel, a: AsyncClient, b_address: str, quick: bool
) -> dict[str, object]:
    big = model.config.output_dim > 1000
    warm = warm_inputs(model, 40)
    # 64 kept: the labelled snapshots of the fork rounds must not trim the one at 16
    sid = (await a.create_session(name, snapshot_every=16, max_snapshots=64)).session_id
    answers = [o async for o in a.stream_steps(sid, as_values(model, warm), steps_per_message=8)]
    last = answers[-1].output
    token = model.config.is_token_model
    result: dict[str, object] = {"forecast": {}, "fork": {}}

    for horizon in (1, 16, 128):
        repeats = (1 if horizon == 128 else 3) if big else (5 if horizon == 128 else 20)
        if quick:
            repeats = 1
        served = await timed(lambda h=horizon: a.forecast(sid, h), repeats)
        floor = engine_floor(model, warm, horizon, repeats)
        copy = (await a.fork(sid)).session.session_id
        hand = await timed(lambda c=copy, h=horizon: by_hand(a, c, last, h, token), 1)
        await a.close_session(copy)
        result["forecast"][str(horizon)] = {
            "served_ms": served * 1e3, "engine_ms": floor * 1e3, "by_hand_ms": hand * 1e3,
        }  # fmt: skip

    n = 8 if big else 16
    sids = []
    for i in range(n):
        s = (await a.create_session(name)).session_id
        x = as_values(model, warm_inputs(model, 4, seed=i))
        async for _ in a.stream_steps(s, x, steps_per_message=4):
            pass
        sids.append(s)
    t0 = time.perf_counter()
    await asyncio.gather(*(a.forecast(s, 16) for s in sids))
    together = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in sids:
        await a.forecast(s, 16)
    apart = time.perf_counter() - t0
    result["batching"] = {"sessions": n, "together_ms": together * 1e3, "apart_ms": apart * 1e3}
    for s in sids:
        await a.close_session(s)

    # Interleaved, and every new session closed again at once: the Redis dataset stays
    # the same size throughout (an AOF rewrite triggered by growth would land on
    # whichever call runs then).
    repeats = 3 if quick else (10 if big else 30)
    calls = {
        "live_ms": lambda: a.fork(sid),
        "replay8_ms": lambda: a.fork(sid, at_step=24),
        "other_worker_ms": lambda: a.fork(sid, target=b_address),
        "create_ms": lambda: a.create_session(name),
    }
    samples: dict[str, list[float]] = {key: [] for key in [*calls, "snapshot_ms"]}
    for i in range(repeats + 1):  # the first round warms up
        for key, call in calls.items():
            t0 = time.perf_counter()
            reply = await call()
            elapsed = time.perf_counter() - t0
            made = reply.session if isinstance(reply, pb.ForkResponse) else reply
            await a.close_session(made.session_id)
            if i:
                samples[key].append(elapsed)
        t0 = time.perf_counter()
        await a.snapshot(sid, label=f"l{i}")
        if i:
            samples["snapshot_ms"].append(time.perf_counter() - t0)
    result["fork"] = {key: statistics.median(v) * 1e3 for key, v in samples.items()}
    await a.close_session(sid)
    return result


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    models = {"demo": ensure_demo_model(tmp / "demo")}
    if not args.skip_130m:
        models["m130"] = save_130m(tmp / "m130")
    offline = {n: load_model(d, name=n) for n, d in models.items()}
    with private_redis(tmp / "redis") as redis:
        workers = Workers(tmp)
        try:
            spec = list(models.items())
            _, addr_a = workers.start(worker_args(spec, redis.url, tmp / "a"), "a")
            _, addr_b = workers.start(worker_args(spec, redis.url, tmp / "b"), "b")
            async with AsyncClient(addr_a) as client:
                out = {}
                for name, model in offline.items():
                    out[name] = await bench_model(name, model, client, addr_b, args.quick)
                return out
        finally:
            workers.close()


def report(results: dict[str, object]) -> None:
    rows = []
    for name, r in results.items():
        for h, f in r["forecast"].items():
            rows.append([f"{name} forecast H={h}", f["served_ms"], f["engine_ms"],
                         f["served_ms"] / f["engine_ms"], f["by_hand_ms"],
                         f["by_hand_ms"] / f["served_ms"]])  # fmt: skip
    print("\n# forecast p50, ms: served, engine alone, by hand (fork + ping-pong its outputs)\n")
    print(table(["what", "served ms", "engine ms", "served/engine", "by hand ms",
                 "by hand/served"], rows))  # fmt: skip
    rows = []
    for name, r in results.items():
        b = r["batching"]
        rows.append([f"{name}: {b['sessions']} x H=16", b["together_ms"], b["apart_ms"],
                     b["apart_ms"] / b["together_ms"]])  # fmt: skip
    print("\n# concurrent forecasts: all at once vs one after the other\n")
    print(table(["what", "together ms", "one by one ms", "speed-up"], rows))
    rows = []
    for name, r in results.items():
        f = r["fork"]
        for key, what in (("live_ms", "fork, live state"), ("replay8_ms", "fork, 8 replayed"),
                          ("other_worker_ms", "fork onto other worker")):  # fmt: skip
            rows.append([f"{name} {what}", f[key], f["create_ms"], f[key] / f["create_ms"],
                         f["snapshot_ms"], f[key] / f["snapshot_ms"]])  # fmt: skip
    print("\n# fork p50, ms, against CreateSession and Snapshot of the same model\n")
    print(table(["what", "fork ms", "create ms", "fork/create", "snapshot ms",
                 "fork/snapshot"], rows))  # fmt: skip


def main() -> int:
    parser = standard_parser(__doc__, quick="one repeat each (smoke run)")
    parser.add_argument("--skip-130m", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-forecast-") as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    report(results)
    if args.json:
        write_result(args.json, results, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
