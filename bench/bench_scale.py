"""Scale-out: the store on Redis Cluster and Sentinel, and 1-3 workers, side by side.

Usage: ``.venv/bin/python bench/bench_scale.py [--quick] [--json FILE]``

Three tables, each comparing its rows in one run (this machine is shared; the ratios are
what to read):

1. **Group commit of log appends** (``Store``, no gRPC): every tick appends one step
   (16 float32) to each of N sessions. One Redis: one pipeline (what the store does) vs
   one call per session, all at once. Redis Cluster (3 masters): one pipeline per node
   on that node's connection, nodes at once (what the store does) vs one call per
   session through the cluster client, all at once (redis-py refuses EVALSHA in its
   cluster pipelines; the issue asked which of the two is faster).
2. **--redis-wait-replicas** (Sentinel set: a master, one replica): the same ticks
   through ``Store.append_logs`` with ``wait_replicas`` 0 and 1 (WAIT after each
   pipeline).
3. **Workers**: 1, 2 and 3 ``ssmserve-server`` processes (demo model) on one Redis and on
   the cluster; 24 sessions created round-robin on the workers, all streamed at once by
   this process (``AsyncClient``, 4 steps per message, log durability) for a fixed time.
   Aggregate answered steps/s, and per step relative to one worker on one Redis.

Every Redis here is a real ``redis-server`` on loopback (AOF on, fsync every second),
started and stopped by this script (``tests/redis_topologies.py``'s harnesses).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import private_redis, standard_parser, table, write_result

from ssmserve.client.aio import AsyncClient
from ssmserve.server.main import ensure_demo_model
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import SessionLease, new_incarnation
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_records import SessionMeta, SnapshotRecord
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.redis_topologies import RedisClusterHarness, SentinelHarness
from tests.worker_process import WorkerProcess

STEP = np.arange(16, dtype=np.float32).tobytes()  # one step's input (64 B)


# ---------------------------------------------------------------------------- the store


async def new_sessions(store: Store, count: int) -> list[SessionLease]:
    """``count`` sessions at step 0 (a 4-byte base snapshot each), held by one worker."""
    leases = []
    for i in range(count):
        sid = f"bench-{i:04d}"
        lease = SessionLease(sid, f"{new_incarnation()}.1", "w1")
        meta = SessionMeta(
            sid, "demo", "f" * 64, 0, 1, b"cfg", 1.0, 1.0, False, 1, "w1", "addr:1",
            lease.token, "n" * 16,
        )  # fmt: skip
        record = SnapshotRecord(f"{0:012d}-base", 0, "", "bench", 2.0, 4, 1)
        await store.create_session(meta, 600_000, record, b"base", 16)
        leases.append(lease)
    return leases


async def ticks_per_second(tick: Callable[[], Awaitable[Any]], seconds: float) -> float:
    """Ticks done per second over ``seconds`` (after 20 warm-up ticks)."""
    for _ in range(20):
        await tick()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        await tick()
        done += 1
    return done / (time.perf_counter() - started)


def calls_for(store: Store, leases: list[SessionLease], step: int) -> list[tuple[list, list]]:
    calls = []
    for lease in leases:
        k = store.keys(lease.session_id)
        calls.append(([k.meta, k.log], [lease.token, step, 5.0, STEP]))
    return calls


async def group_commit_rows(
    url: str, topology: str, sizes: list[int], seconds: float
) -> list[dict]:
    rows = []
    for n in sizes:
        store = Store(StoreSettings(url=url))
        await store.redis.flushall()
        ways = GroupCommitWays(store, await new_sessions(store, n), topology)
        # alternate the two on the same sessions, twice each, so drift hits both alike
        rates: dict[str, list[float]] = {"grouped": [], "concurrent": []}
        for _ in range(2):
            for name in rates:
                rates[name].append(await ways.rate(name, seconds))
        meta = await store.get_meta(ways.leases[0].session_id)
        assert meta is not None and meta.step == ways.step, (meta, ways.step)  # all ran
        await store.aclose()
        grouped, concurrent = (
            statistics.mean(rates["grouped"]),
            statistics.mean(rates["concurrent"]),
        )
        rows.append(
            {
                "topology": topology,
                "sessions": n,
                "grouped_appends_per_s": grouped * n,
                "concurrent_appends_per_s": concurrent * n,
                "grouped_over_concurrent": grouped / concurrent,
            }
        )
    return rows


class GroupCommitWays:
    """The two ways to append one step to each session: grouped (the store's) or one
    concurrent call per session. Steps continue across runs (``step``: the last one)."""

    def __init__(self, store: Store, leases: list[SessionLease], topology: str) -> None:
        self.store, self.leases, self.step = store, leases, 0
        self.script = store._log_append
        self.batched = store.batches.per_node if topology == "cluster" else store.batches.pipelined

    async def rate(self, way: str, seconds: float) -> float:
        fn = self.grouped if way == "grouped" else self.concurrent

        async def tick() -> None:
            self.step += 1
            await fn(self.step)

        return await ticks_per_second(tick, seconds)

    async def grouped(self, step: int) -> None:
        replies = await self.batched(self.script, calls_for(self.store, self.leases, step))
        assert all(self.store._outcome(r) is None for r in replies), replies[:3]

    async def concurrent(self, step: int) -> None:
        calls = calls_for(self.store, self.leases, step)
        replies = await asyncio.gather(*(self.script(keys=k, args=a) for k, a in calls))
        assert all(self.store._outcome(r) is None for r in replies), replies[:3]


async def wait_replicas_rows(url: str, sizes: list[int], seconds: float) -> list[dict]:
    rows = []
    for n in sizes:
        first = Store(StoreSettings(url=url))
        await first.redis.flushall()
        appender = Appender(await new_sessions(first, n))
        await first.aclose()
        rates: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(2):
            for replicas in rates:
                rates[replicas].append(await appender.rate(url, replicas, seconds))
        off, on = statistics.mean(rates[0]), statistics.mean(rates[1])
        rows.append(
            {
                "sessions": n,
                "tick_ms_wait0": 1000 / off,
                "tick_ms_wait1": 1000 / on,
                "cost_ratio": off / on,
            }
        )
    return rows


class Appender:
    """Ticks of ``Store.append_logs`` (one step to each session), the log continuing."""

    def __init__(self, leases: list[SessionLease]) -> None:
        self.leases, self.step = leases, 0

    async def rate(self, url: str, replicas: int, seconds: float) -> float:
        store = Store(StoreSettings(url=url, wait_replicas=replicas, wait_timeout_ms=1000))

        async def tick() -> None:
            self.step += 1
            appends = [(lease, InputBlock.of(self.step, [STEP])) for lease in self.leases]
            assert await store.append_logs(appends, 5.0) == [None] * len(self.leases)

        try:
            return await ticks_per_second(tick, seconds)
        finally:
            await store.aclose()


# ---------------------------------------------------------------------------- workers


async def stream_for(addresses: list[str], sids: list[str], seconds: float) -> int:
    """Stream every session at once for ``seconds`` (after 1 s of warm-up); answered steps."""
    counted = {"on": False, "steps": 0}
    stop = time.monotonic() + 1.0 + seconds

    async def one(client: AsyncClient, sid: str) -> None:
        async def inputs():
            while time.monotonic() < stop:
                yield np.zeros(4, np.float32)

        async for _ in client.stream_steps(sid, inputs(), steps_per_message=4):
            if counted["on"]:
                counted["steps"] += 1

    async with AsyncClient(addresses) as client:
        tasks = [asyncio.create_task(one(client, sid)) for sid in sids]
        await asyncio.sleep(1.0)
        counted["on"] = True
        await asyncio.sleep(seconds)
        counted["on"] = False
        await asyncio.gather(*tasks)
    return counted["steps"]


async def create_spread(addresses: list[str], count: int) -> list[str]:
    sids = []
    for i in range(count):
        async with AsyncClient(addresses[i % len(addresses)], discover=False) as client:
            info = await client.create_session("demo", durability=pb.DURABILITY_LOG)
            sids.append(info.session_id)
    return sids


def workers_rows(
    urls: dict[str, str], model: Path, tmp: Path, counts: list[int], sessions: int, seconds: float
) -> list[dict]:
    rows = []
    for topology, url in urls.items():
        for k in counts:
            workers = [
                WorkerProcess({"demo": model}, url, tmp / f"{topology}-{k}-{i}", lease_ttl_s=5.0)
                for i in range(k)
            ]
            try:
                for w in workers:
                    w.start(timeout_s=120)
                addresses = [w.address for w in workers]
                sids = asyncio.run(create_spread(addresses, sessions))
                steps = asyncio.run(stream_for(addresses, sids, seconds))
            finally:
                for w in workers:
                    w.kill()
            rows.append({"topology": topology, "workers": k, "steps_per_s": steps / seconds})
    base = rows[0]["steps_per_s"]
    for row in rows:
        row["relative"] = row["steps_per_s"] / base
    return rows


# ---------------------------------------------------------------------------- main


def main() -> int:
    parser = standard_parser(__doc__, quick="short runs (a smoke test)")
    args = parser.parse_args()
    seconds = 0.5 if args.quick else 3.0
    sizes = [1, 16] if args.quick else [1, 16, 64]
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as name:
        tmp = Path(name)
        model = ensure_demo_model(tmp / "demo")
        with (
            private_redis(tmp / "single") as single,
            RedisClusterHarness(tmp / "cluster") as cluster,
        ):
            out["group_commit"] = asyncio.run(_both(single.url, cluster.url, sizes, seconds))
            out["workers"] = workers_rows(
                {"single": single.url, "cluster": cluster.url},
                model, tmp, [1, 2] if args.quick else [1, 2, 3], 24, 2.0 if args.quick else 8.0,
            )  # fmt: skip
        with SentinelHarness(tmp / "sentinel") as sentinel:
            out["wait_replicas"] = asyncio.run(wait_replicas_rows(sentinel.url, sizes, seconds))

    print("\n# 1. group commit of log appends, one step to each of N sessions per tick")
    print(table(
        ["Redis", "sessions", "grouped appends/s", "concurrent calls appends/s",
         "grouped / concurrent"],
        [[r["topology"], r["sessions"], r["grouped_appends_per_s"], r["concurrent_appends_per_s"],
          f"{r['grouped_over_concurrent']:.2f}x"] for r in out["group_commit"]],
    ))  # fmt: skip
    print("grouped: one pipeline (one Redis) or one pipeline per node, nodes at once (cluster)")
    print("\n# 2. --redis-wait-replicas (Sentinel: master + 1 replica), Store.append_logs ticks")
    print(table(
        ["sessions", "tick ms, wait 0", "tick ms, wait 1", "wait 1 costs"],
        [[r["sessions"], r["tick_ms_wait0"], r["tick_ms_wait1"], f"{r['cost_ratio']:.2f}x"]
         for r in out["wait_replicas"]],
    ))  # fmt: skip
    print("\n# 3. workers: 24 sessions streamed at once, 4 steps per message, log durability")
    print(table(
        ["Redis", "workers", "steps/s", "vs 1 worker on one Redis"],
        [[r["topology"], r["workers"], r["steps_per_s"], f"{r['relative']:.2f}x"]
         for r in out["workers"]],
    ))  # fmt: skip
    if args.json:
        write_result(args.json, out, line=False)
    return 0


async def _both(single: str, cluster: str, sizes: list[int], seconds: float) -> list[dict]:
    return [
        *await group_commit_rows(single, "single", sizes, seconds),
        *await group_commit_rows(cluster, "cluster", sizes, seconds),
    ]


if __name__ == "__main__":
    sys.exit(main())
