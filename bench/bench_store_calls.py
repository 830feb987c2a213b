"""What a worker's batched Redis writes cost its own CPU, the old way and the new, in one run.

Usage: ``.venv/bin/python bench/bench_store_calls.py [--leases 3000] [--rounds 15]``

One private redis-server (embedded, loopback); this process is the worker's store. Client
CPU (``time.process_time``: this process only, not Redis) and wall time per call, median of
``--rounds``, each pair run alternately:

- **renewals** of ``--leases`` leases of one worker: one RENEW per lease in one pipeline
  (what ``Store.renew_leases`` sent before RENEW_MANY, and still sends on Redis Cluster),
  against ``Store.renew_leases`` (RENEW_MANY, one script call per 256 leases);
- **one session's log append** (a lone session's step): one EVALSHA in a pipeline (before)
  against ``Store.append_logs`` as it is (a plain EVALSHA for a batch of one call).

Both sides send the same scripts to the same keys; only how redis-py carries them differs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from common import table

from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.state.lease import SessionLease, new_incarnation
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_records import SessionMeta, SnapshotRecord

BASE = b"base"
APPENDS = 200  # one session's appends per timed round, one call each


async def create(store: Store, sid: str) -> SessionLease:
    lease = SessionLease(sid, f"{new_incarnation()}.1", "w1")
    meta = SessionMeta(
        sid, "demo", "f" * 64, 0, 1, b"cfg", 1.0, 1.0, False, 1, "w1", "addr:1", lease.token,
        "n" * 16,
    )  # fmt: skip
    record = SnapshotRecord("000000000000-base", 0, "", "create", 1.0, len(BASE), 1)
    await store.create_session(meta, 60_000, record, BASE, 16)
    return lease


async def timed(call: Callable[[], Awaitable[object]], rounds: int) -> tuple[float, float]:
    """Median (client CPU s, wall s) of ``call()``."""
    await call()
    cpu, wall = [], []
    for _ in range(rounds):
        c, t = time.process_time(), time.perf_counter()
        await call()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(cpu), statistics.median(wall)


async def bench(url: str, leases_n: int, rounds: int) -> None:
    store = Store(StoreSettings(url=url))
    leases = [await create(store, f"s{i}") for i in range(leases_n)]

    async def renew_per_lease() -> None:
        calls = []
        for lease in leases:
            k = store.keys(lease.session_id)
            calls.append(([k.meta, k.lease], [lease.holder, lease.token, 60_000]))
        replies = await store._scripts("renew_leases", store._renew, calls)
        assert all(store._outcome(r) is None for r in replies)

    async def renew_many() -> None:
        assert all(r is None for r in await store.renew_leases(leases, 60_000))

    lone = leases[0]
    step = 0
    await store.redis.script_load(store._log_append_many.script)  # the raw pipeline sends

    def append_call() -> tuple[list[str], list[object]]:
        nonlocal step
        step += 1
        k = store.keys(lone.session_id)
        return [k.meta, k.log], [1.0, lone.token, step, 1, b"x" * 16]

    async def append_pipelined() -> None:
        for _ in range(APPENDS):
            keys, args = append_call()
            async with store.redis.pipeline(transaction=False) as pipe:
                pipe.evalsha(store._log_append_many.sha, len(keys), *keys, *args)
                (reply,) = await pipe.execute(raise_on_error=False)
            assert store._outcome(reply[0]) is None

    async def append_direct() -> None:
        for _ in range(APPENDS):
            (reply,) = await store.batches.run(store._log_append_many, [append_call()])
            assert store._outcome(reply[0]) is None

    rows = []
    for name, before, after, sessions, calls in (
        (f"renew {leases_n:,} leases", renew_per_lease, renew_many, leases_n, 1),
        ("one session's log append", append_pipelined, append_direct, 1, APPENDS),
    ):
        runs: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        for _ in range(2):  # alternately
            runs["before"].append(await timed(before, rounds))
            runs["after"].append(await timed(after, rounds))
        b_cpu, a_cpu = (min(c for c, _ in runs[k]) / (sessions * calls) * 1e6 for k in runs)
        b_wall, a_wall = (min(w for _, w in runs[k]) / calls * 1e3 for k in runs)
        rows.append([name, b_cpu, a_cpu, a_cpu / b_cpu, b_wall, a_wall])
    headers = ["write", "before: client us per session", "now", "now / before",
               "before: wall ms per call", "now"]  # fmt: skip
    print(table(headers, rows))
    print(
        "before = one EVALSHA per session in a redis-py pipeline; now = what the store sends"
        " today (RENEW_MANY; a plain EVALSHA for a batch of one call)"
    )
    await store.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(EmbeddedRedisSettings(data_dir=Path(tmp))) as redis_server,
    ):
        asyncio.run(bench(redis_server.url, args.leases, args.rounds))


if __name__ == "__main__":
    main()
