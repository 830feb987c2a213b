"""Snapshot commits that come due together are written together (``snapshot_commits``),
against a real redis-server: one batch per event-loop turn, cut by count and bytes, each
waiter with its own outcome, nothing written after ``close``."""

from __future__ import annotations

import asyncio

import pytest

from ssmserve.server.embedded_redis import EmbeddedRedis
from ssmserve.server.sessions.snapshot_commits import SnapshotCommits
from ssmserve.server.state.lease import SessionLease, new_incarnation
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import StaleEpochError
from ssmserve.server.state.store_records import SnapshotCommit, SnapshotRecord
from tests.test_store import meta, record


async def _sessions(store: Store, ids: list[str]) -> list[SessionLease]:
    leases = []
    for sid in ids:
        lease = SessionLease(sid, f"{new_incarnation()}.1", "w1")
        await store.create_session(
            meta(sid, lease.token), 60_000, record(0, 4, sid="base"), b"base", 16
        )
        leases.append(lease)
    return leases


def _commit(lease: SessionLease, step: int = 0, size: int = 4) -> SnapshotCommit:
    rec = SnapshotRecord(f"{step:012d}-{lease.session_id}", step, "", "periodic", 1.0, size, 1)
    return SnapshotCommit(lease, rec, b"s" * size, 4)


def _run(redis_server: EmbeddedRedis, body) -> None:
    async def main() -> None:
        store = Store(StoreSettings(url=redis_server.url, key_prefix=f"t{new_incarnation()}"))
        try:
            await body(store)
        finally:
            await store.aclose()

    asyncio.run(main())


def test_commits_due_in_one_turn_go_in_one_batch(redis_server: EmbeddedRedis) -> None:
    async def body(store: Store) -> None:
        leases = await _sessions(store, [f"s{i}" for i in range(10)])
        commits = SnapshotCommits(store)
        # Like the writers one stepper batch wakes: tasks that queue in the same turn.
        await asyncio.gather(*(commits.commit(_commit(lease)) for lease in leases))
        assert commits.batches == 1
        for lease in leases:
            ids = [r.snapshot_id for r in await store.list_snapshots(lease.session_id)]
            assert f"000000000000-{lease.session_id}" in ids

    _run(redis_server, body)


def test_batches_are_cut_by_count_and_bytes(redis_server: EmbeddedRedis) -> None:
    async def body(store: Store) -> None:
        leases = await _sessions(store, [f"s{i}" for i in range(5)])
        by_count = SnapshotCommits(store, max_batch=2)
        await asyncio.gather(*(by_count.commit(_commit(lease)) for lease in leases))
        assert by_count.batches == 3  # 2 + 2 + 1
        by_bytes = SnapshotCommits(store, max_bytes=250)
        await asyncio.gather(*(by_bytes.commit(_commit(lease, 0, 100)) for lease in leases))
        assert by_bytes.batches == 3  # 200 + 200 + 100 bytes
        for lease in leases:
            # the base and the one committed (the second round sent the same ids again)
            assert len(await store.list_snapshots(lease.session_id)) == 2

    _run(redis_server, body)


def test_each_waiter_gets_its_own_outcome(redis_server: EmbeddedRedis) -> None:
    async def body(store: Store) -> None:
        ours, moved = await _sessions(store, ["ours", "moved"])
        await store.redis.delete(store.keys("moved").lease)
        beat = (await store.redis.hget(store.keys("moved").meta, "beat") or b"0").decode()
        await store.acquire("moved", "w2", "addr:2", 60_000, proof=beat)  # a takeover
        commits = SnapshotCommits(store)
        results = await asyncio.gather(
            commits.commit(_commit(ours)), commits.commit(_commit(moved)), return_exceptions=True
        )
        assert results[0] is None
        assert isinstance(results[1], StaleEpochError)
        assert commits.batches == 1
        ids = [r.snapshot_id for r in await store.list_snapshots("moved")]
        assert ids == ["000000000000-base"]  # the refused commit changed nothing
        ids = [r.snapshot_id for r in await store.list_snapshots("ours")]
        assert ids == ["000000000000-base", "000000000000-ours"]

    _run(redis_server, body)


def test_an_error_of_the_whole_batch_reaches_its_waiters_and_the_writer_goes_on(
    redis_server: EmbeddedRedis,
) -> None:
    async def body(store: Store) -> None:
        (lease,) = await _sessions(store, ["a"])
        commits = SnapshotCommits(store)
        wrong = SnapshotCommit(lease, SnapshotRecord("x", 0, "", "r", 1.0, 4, 2), b"ssss", 4)
        with pytest.raises(ValueError, match="2 pieces"):
            await commits.commit(wrong)
        await commits.commit(_commit(lease))  # the next batch is written
        assert commits.batches == 2
        assert len(await store.list_snapshots("a")) == 2

    _run(redis_server, body)


def test_nothing_queued_is_written_after_close(redis_server: EmbeddedRedis) -> None:
    async def body(store: Store) -> None:
        (lease,) = await _sessions(store, ["a"])
        commits = SnapshotCommits(store)
        waiter = asyncio.ensure_future(commits.commit(_commit(lease, 0)))
        await asyncio.sleep(0)  # queued; the writer has not run yet
        commits.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.05)
        assert commits.batches == 0
        assert [r.snapshot_id for r in await store.list_snapshots("a")] == ["000000000000-base"]

    _run(redis_server, body)
