"""Migration downtime and crash recovery, as a streaming client sees them, in one run.

Usage: ``.venv/bin/python bench/bench_migration.py [--quick] [--json OUT]``

Processes: one private redis-server (AOF on, appendfsync everysec) and ssmserve workers,
each its own process on loopback, all sharing that Redis; this process is the client
(``ssmserve.client.aio.AsyncClient``). Every stream is ping-pong: one step per message, the next
step sent when the previous one is answered (``RetryPolicy(window=1)``), and every answer
is timestamped on arrival together with the worker that answered it.

Measured:
- migration downtime: two ``ssmserve-server`` processes; one session streams while a
  second client migrates it back and forth (``Migrate``), with >= 50 ms and >= 3 answered
  steps between migrations. Downtime = arrival of the first answer from the target minus
  arrival of the last answer from the source (it contains one step's round trip, so the
  normal gap between two answers of the same worker is shown beside it, and the excess
  over that). Two warm-up migrations (first connection to each worker) are left out.
  Models: the demo model (``DemoSpec()``: 20 KB state) and a signal model with
  mamba-130m's layer dims (hidden 768, 24 layers, state 16, expand 2; 2.81 MiB state, the
  same bytes as ``bench_checkpoint.mamba130m_checkpoint``; no embedding or LM head).
- recovery after ``kill -9``: workers A and B with lease TTL 0.5 / 1 / 2 s; a session
  created on A streams through a client that knows both addresses; after a random
  0.3..0.3 + TTL s (a random phase against the lease renewals, every TTL / 3) A gets
  SIGKILL. Recovery = arrival of the first answer from B minus the kill. A is restarted
  (new port) for each repetition. Workers are ``ssmserve-server --lease-ttl S`` (the
  migration ones keep the default 5 s).
Every step is checked to be answered exactly once and in order across moves and crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import mamba130m_checkpoint
from harness import (
    Workers,
    private_redis,
    standard_parser,
    table,
    worker_args,
    write_preset_model,
    write_result,
)

from ssmserve.client.aio import AsyncClient
from ssmserve.client.retry import RetryPolicy
from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.main import ensure_demo_model

BIG = DemoSpec(hidden=768, layers=24, state=16, expand=2, conv_kernel=4)
PING_PONG = RetryPolicy(window=1)
FOLLOW_TIMEOUT_S = 15.0  # no answer from the new owner for this long: report and stop


# ---------------------------------------------------------------------------- processes


def big_model(directory: Path) -> Path:
    config = demo_config(BIG)
    write_preset_model(directory, config, BIG.seed)
    state = int(config.num_hidden_layers * config.intermediate_size)
    state *= (config.conv_kernel + config.state_size) * 4
    assert state == mamba130m_checkpoint().state.nbytes, state
    return directory


# ---------------------------------------------------------------------------- streaming


def signal_inputs(dim: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((64, dim)).astype(np.float32)
    i = 0
    while True:
        yield values[i % 64]
        i += 1


class Stream:
    """One session streaming ping-pong in the background; answers as (arrival, step, by)."""

    def __init__(self, client: AsyncClient, session_id: str, first_step: int) -> None:
        self.client = client
        self.session_id = session_id
        self.answers: list[tuple[float, int, str]] = []
        self._new = asyncio.Event()
        self._stop = False
        self._task = asyncio.ensure_future(self._run(first_step))

    async def _run(self, first_step: int) -> None:
        outputs = self.client.stream_steps(self.session_id, signal_inputs(4), first_step=first_step)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                # the client records who answered just before yielding the answer
                by = self.client.owner_of(out.session_id)
                self.answers.append((time.perf_counter(), out.step, by))
                self._new.set()
                if self._stop:
                    break

    async def wait_for(self, by: str, count: int, since: int, what: str) -> None:
        """Until ``count`` answers from ``by`` arrived after answer number ``since``."""

        async def until() -> None:
            while sum(1 for a in self.answers[since:] if a[2] == by) < count:
                if self._task.done():
                    self._task.result()  # raises what ended the stream
                    raise RuntimeError("the stream ended")
                self._new.clear()
                await self._new.wait()

        try:
            await asyncio.wait_for(until(), FOLLOW_TIMEOUT_S)
        except TimeoutError:
            last = self.answers[-1] if self.answers else None
            raise RuntimeError(
                f"{what}: no answer from {by} within {FOLLOW_TIMEOUT_S:.0f} s (last answer: {last})"
            ) from None

    async def stop(self) -> None:
        self._stop = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 5.0)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def check_order(self, first_step: int) -> None:
        steps = [s for _, s, _ in self.answers]
        want = list(range(first_step, first_step + len(steps)))
        if steps != want:
            bad = next(i for i, (a, b) in enumerate(zip(steps, want, strict=True)) if a != b)
            near = steps[max(0, bad - 2) : bad + 3]
            raise RuntimeError(f"steps not answered once each, in order: {near}")


# ---------------------------------------------------------------------------- migration


@dataclasses.dataclass
class MigrationRun:
    model: str
    downtime_ms: list[float]
    normal_ms: list[float]
    server_ms: list[float]
    rpc_ms: list[float]
    idle_server_ms: list[float]
    steps: int


async def migration_run(
    addresses: list[str], model: str, migrations: int, between_s: float, warmup: int = 2
) -> MigrationRun:
    control = AsyncClient(addresses, discover=False)
    streamer = AsyncClient(addresses, discover=False, retry=PING_PONG)
    try:
        info = await control.create_session(model)
        sid, owner = info.session_id, info.owner
        assert owner == addresses[0], (owner, addresses)
        stream = Stream(streamer, sid, info.step + 1)
        server_ms: list[float] = []
        rpc_ms: list[float] = []
        try:
            for i in range(warmup + migrations):
                mark = len(stream.answers)
                t0 = time.perf_counter()
                await stream.wait_for(owner, 3, mark, f"migration {i}")
                await asyncio.sleep(max(0.0, between_s - (time.perf_counter() - t0)))
                target = addresses[1] if owner == addresses[0] else addresses[0]
                t0 = time.perf_counter()
                reply = await control.migrate(sid, target)
                elapsed = time.perf_counter() - t0
                assert (reply.source, reply.target) == (owner, target), reply
                if i >= warmup:
                    server_ms.append(reply.elapsed_ms)
                    rpc_ms.append(elapsed * 1e3)
                owner = target
            await stream.wait_for(owner, 3, len(stream.answers), "after the last migration")
        finally:
            await stream.stop()
        stream.check_order(info.step + 1)
        idle_ms = []  # the same hand-off with no stream: no step in flight to wait for
        for _ in range(max(5, migrations // 2)):
            target = addresses[1] if owner == addresses[0] else addresses[0]
            idle_ms.append((await control.migrate(sid, target)).elapsed_ms)
            owner = target
    finally:
        await control.close()
        await streamer.close()

    answers = stream.answers
    downtime, normal = [], []
    changes = 0
    for (t0, _, by0), (t1, _, by1) in itertools.pairwise(answers):
        if by0 != by1:
            changes += 1
            if changes > warmup:
                downtime.append((t1 - t0) * 1e3)
        else:
            normal.append((t1 - t0) * 1e3)
    if changes != warmup + migrations:
        raise RuntimeError(f"{changes} changes of the answering worker, expected "
                           f"{warmup + migrations}")  # fmt: skip
    return MigrationRun(model, downtime, normal, server_ms, rpc_ms, idle_ms, len(answers))


# ---------------------------------------------------------------------------- recovery


async def recovery_once(
    workers: Workers, cmd: list[str], name: str, survivor: str, ttl: float
) -> float:
    """Kill -9 the owner of a streaming session; seconds until the survivor answers."""
    victim, address = workers.start(cmd, name)  # a new port each time
    client = AsyncClient([address, survivor], discover=False, retry=PING_PONG)
    try:
        info = await client.create_session("demo")
        assert info.owner == address, (info.owner, address)
        stream = Stream(client, info.session_id, info.step + 1)
        try:
            await stream.wait_for(address, 3, 0, "before the kill")
            await asyncio.sleep(random.uniform(0.3, 0.3 + ttl))
            mark = len(stream.answers)
            killed = time.perf_counter()
            os.kill(victim.pid, signal.SIGKILL)
            await stream.wait_for(survivor, 1, mark, f"recovery (TTL {ttl} s)")
        finally:
            await stream.stop()
        stream.check_order(info.step + 1)
    finally:
        await client.close()
        workers.stop(victim)
    first = next(t for t, _, by in stream.answers if by == survivor)
    return first - killed


# ---------------------------------------------------------------------------- main


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples), q))


async def bench(tmp: Path, redis_url: str, workers: Workers, quick: bool) -> dict[str, object]:
    demo_dir = ensure_demo_model(tmp / "models" / "demo")
    t0 = time.perf_counter()
    big_dir = big_model(tmp / "models" / "m130")
    print(f"(wrote the mamba-130m-shaped signal model in {time.perf_counter() - t0:.1f} s)\n")
    models = [("demo", demo_dir), ("m130", big_dir)]
    _, a = workers.start(worker_args(models, redis_url, tmp / "a"), "migrate-a")
    _, b = workers.start(worker_args(models, redis_url, tmp / "b"), "migrate-b")
    runs = [
        await migration_run([a, b], "demo", 10 if quick else 40, 0.05),
        await migration_run([a, b], "m130", 6 if quick else 20, 0.05),
    ]
    labels = {"demo": "demo (20 KB state)", "m130": "130m-shaped (2.81 MiB state)"}
    print("# migration downtime as the streaming client sees it (ms)\n")
    rows = [
        [
            labels[r.model],
            len(r.downtime_ms),
            pct(r.downtime_ms, 50),
            pct(r.downtime_ms, 99),
            pct(r.normal_ms, 50),
            pct(r.downtime_ms, 50) - pct(r.normal_ms, 50),
            pct(r.server_ms, 50),
            pct(r.rpc_ms, 50),
            pct(r.idle_server_ms, 50),
        ]
        for r in runs
    ]
    headers = ["model", "migrations", "downtime p50", "downtime p99", "normal gap p50",
               "excess p50", "server elapsed_ms p50", "Migrate RPC p50",
               "idle session: elapsed_ms p50"]  # fmt: skip
    print(table(headers, rows))
    print(
        "\ndowntime: last answer from the source -> first answer from the target; normal gap: "
        "between two answers of one worker; excess = downtime p50 - normal gap p50; "
        "elapsed_ms: MigrateResponse (source side, hand-off start to target loaded); idle "
        "session: the same session migrated with no stream open"
    )

    ttls = [0.5, 1.0] if quick else [0.5, 1.0, 2.0]
    reps = 2 if quick else 3
    demo = [("demo", demo_dir)]
    rows = []
    for ttl in ttls:
        survivor_proc, survivor = workers.start(
            worker_args(demo, redis_url, tmp / "s", ttl), f"b-{ttl}"
        )
        try:
            samples = [
                await recovery_once(
                    workers,
                    worker_args(demo, redis_url, tmp / f"k{i}", ttl),
                    f"a-{ttl}-{i}",
                    survivor,
                    ttl,
                )
                for i in range(reps)
            ]
        finally:
            workers.stop(survivor_proc)
        med, worst = float(np.median(samples)), max(samples)
        rows.append([ttl, reps, med * 1e3, worst * 1e3, (med - ttl) * 1e3, (worst - ttl) * 1e3])
    print("\n# recovery after kill -9 of the owner (client knows both workers)\n")
    headers = ["lease TTL s", "runs", "recovery median ms", "recovery max ms",
               "median - TTL ms", "max - TTL ms"]  # fmt: skip
    print(table(headers, rows))
    print("\nrecovery: SIGKILL of the owner -> first answer from the survivor")
    return {
        "downtime_p50_ms": {r.model: pct(r.downtime_ms, 50) for r in runs},
        "downtime_p99_ms": {r.model: pct(r.downtime_ms, 99) for r in runs},
        "idle_handoff_p50_ms": {r.model: pct(r.idle_server_ms, 50) for r in runs},
        "recovery": [dict(zip(("ttl_s", "runs", "median_ms", "max_ms"), row[:4], strict=True))
                     for row in rows],
    }  # fmt: skip


def main() -> int:
    parser = standard_parser(__doc__, quick="fewer samples (smoke run)")
    args = parser.parse_args()
    random.seed(0)
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as tmp,
        private_redis(Path(tmp) / "redis") as redis_server,
    ):
        (Path(tmp) / "logs").mkdir()
        workers = Workers(Path(tmp) / "logs")
        try:
            figures = asyncio.run(bench(Path(tmp), redis_server.url, workers, args.quick))
        except BaseException:
            for log in sorted((Path(tmp) / "logs").iterdir()):
                text = log.read_text().strip()
                if text:
                    print(f"--- {log.name}\n{text[-3000:]}", file=sys.stderr)
            raise
        finally:
            workers.close()
    print(f"\n(whole benchmark: {time.perf_counter() - started:.0f} s)")
    if args.json:
        write_result(args.json, figures, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
