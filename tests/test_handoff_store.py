"""The store's two scripts of a hand-off, on a real redis-server: the owner's reservation
(``Store.handoff``) names the snapshot the target loads from, and the target's acquire
(``Store.acquire_to_load``) reads the session's record and that snapshot's id in the
same round trip as it takes the lease (``sessions/handoff.py`` drives them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from ssmserve.server.errors import SessionMovedError
from ssmserve.server.state.lease import SessionLease, new_incarnation
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import StaleEpochError, StoreDataError, StoreError
from ssmserve.server.state.store_leases import INLINE_CHECKPOINT_BYTES
from ssmserve.server.state.store_records import SessionMeta, SnapshotRecord, WorkerRecord

LEASE_MS = 60_000
STEP = 7  # the test session's step, where its one snapshot stands
CONFIG = b"\x00\xffcfg\x80"  # a config that is not text: the record read back keeps its bytes
TARGET = WorkerRecord("w2", "addr:2", ("demo",), 0, 1.0, 1.0, False)


def run(redis_url: str, body: Callable[[Store], Awaitable[None]]) -> None:
    async def main() -> None:
        s = Store(StoreSettings(url=redis_url, piece_bytes=1 << 20))
        try:
            await body(s)
        finally:
            await s.aclose()

    asyncio.run(main())


async def new(s: Store, sid: str, blob: bytes = b"base") -> tuple[SessionLease, str]:
    """A session of worker w1 at ``STEP``, its first snapshot there (``blob``, in pieces of
    1 MiB): its lease and that snapshot's id."""
    lease = SessionLease(sid, f"{new_incarnation()}.1", "w1")
    meta = SessionMeta(
        sid, "demo", "f" * 64, STEP, STEP + 1, CONFIG, 1.0, 1.0, False, 1, "w1", "addr:1",
        lease.token, "n" * 16,
    )  # fmt: skip
    pieces = max(1, -(-len(blob) // (1 << 20)))
    snapshot = SnapshotRecord(f"{STEP:012d}-base", STEP, "", "test", 2.0, len(blob), pieces)
    await s.create_session(meta, LEASE_MS, snapshot, blob, 16)
    return lease, snapshot.snapshot_id


def test_the_reservation_names_the_newest_snapshot_at_or_before_the_step(redis_url: str) -> None:
    async def body(s: Store) -> None:
        lease, snapshot_id = await new(s, "a")
        assert await s.handoff(lease, TARGET, LEASE_MS, STEP) == snapshot_id
        assert await s.handoff(lease, TARGET, LEASE_MS) == snapshot_id  # the newest of all
        assert await s.handoff(lease, TARGET, LEASE_MS, STEP - 1) == ""  # none that early
        assert (await s.lease_holder("a")).holder == "handoff:w2"

    run(redis_url, body)


def test_the_targets_acquire_reads_the_record_and_snapshot_it_loads_from(redis_url: str) -> None:
    async def body(s: Store) -> None:
        lease, snapshot_id = await new(s, "a")
        await s.handoff(lease, TARGET, LEASE_MS, STEP)
        # Only the target may take it.
        with pytest.raises(SessionMovedError):
            await s.acquire_to_load("a", "w3", "addr:3", LEASE_MS)
        taken = await s.acquire_to_load("a", "w2", "addr:2", LEASE_MS)
        meta, newest, token = taken.meta, taken.snapshot_id, taken.lease.token
        # The record as the lease was taken: the new token and owner, the step, the bytes.
        assert token != lease.token and meta.token == token and taken.lease.holder == "w2"
        assert taken.snapshot is None  # no snapshot expected: the load reads it itself
        assert (meta.owner, meta.owner_addr) == ("w2", "addr:2")
        assert (meta.step, meta.config, meta.model) == (STEP, CONFIG, "demo")
        assert meta == await s.get_meta("a")
        assert newest == snapshot_id
        # The source's late take-back finds itself fenced: the target holds it.
        with pytest.raises(StaleEpochError):
            await s.cancel_handoff(lease, "addr:1", "w2", LEASE_MS)

    run(redis_url, body)


def test_a_load_reads_the_snapshot_record_and_its_bytes_together(redis_url: str) -> None:
    """``Store.snapshot_and_blob``: the record and its first piece in one pipeline, the
    other pieces of a checkpoint over ``piece_bytes`` after; a lost piece is an error, a
    snapshot that is not there is None."""

    async def body(s: Store) -> None:
        lease, snapshot_id = await new(s, "a")
        assert await s.snapshot_and_blob("a", snapshot_id) == (
            await s.snapshot_by_id("a", snapshot_id),
            b"base",
        )
        big = bytes(range(256)) * ((2 << 20) // 256 + 3)  # three pieces of 1 MiB
        record = SnapshotRecord(f"{STEP:012d}-big", STEP, "", "test", 3.0, len(big), 3)
        await s.commit_snapshot(lease, record, big, 16)
        read = await s.snapshot_and_blob("a", record.snapshot_id)
        assert read is not None and read[0].pieces == 3 and read[1] == big
        assert await s.snapshot_and_blob("a", "no-such-snapshot") is None
        await s.redis.delete(s.keys("a").blob(record.snapshot_id, 2))
        with pytest.raises(StoreError, match="lost pieces"):
            await s.snapshot_and_blob("a", record.snapshot_id)

    run(redis_url, body)


def test_an_acquire_whose_record_does_not_parse_lets_the_lease_go(redis_url: str) -> None:
    """The lease the script took is released before the record's error is raised: a
    corrupt record must not leave the session held for a lease's TTL."""

    async def body(s: Store) -> None:
        lease, _ = await new(s, "a")
        await s.release(lease)
        await s.redis.hset(s.keys("a").meta, "created_at", "not a number")
        with pytest.raises(StoreDataError, match="created_at"):
            await s.acquire_to_load("a", "w2", "addr:2", LEASE_MS)
        assert await s.lease_holder("a") is None

    run(redis_url, body)


@pytest.mark.parametrize(
    "blob",
    [b"base", b"b" * INLINE_CHECKPOINT_BYTES, b"c" * (INLINE_CHECKPOINT_BYTES + 1),
     bytes(range(256)) * 4097],
    ids=["small", "inline-bound", "past-the-bound", "2-pieces"],
)  # fmt: skip
def test_a_load_reads_the_snapshot_it_expected_with_the_lease(redis_url: str, blob: bytes) -> None:
    """The load's first read names the newest snapshot; its acquire reads that snapshot's
    record and bytes with the lease: a small checkpoint in the same round trip, one over
    INLINE_CHECKPOINT_BYTES (here 1 MiB and more, two pieces) in a second. A snapshot
    committed between the two is the newest at the acquire: then nothing is read with it."""

    async def main() -> None:
        s = Store(StoreSettings(url=redis_url, piece_bytes=1 << 20))
        try:
            lease, snapshot_id = await new(s, "a", blob)
            meta, newest = await s.meta_to_load("a")
            assert meta == await s.get_meta("a") and newest == snapshot_id
            assert await s.meta_to_load("nobody") == (None, "")
            await s.handoff(lease, TARGET, LEASE_MS, STEP)
            reads = []
            mget = s.redis.mget
            s.redis.mget = lambda *a, **kw: reads.append(a) or mget(*a, **kw)
            taken = await s.acquire_to_load("a", "w2", "addr:2", LEASE_MS, expected_snapshot=newest)
            assert taken.snapshot is not None
            assert len(reads) == (len(blob) > INLINE_CHECKPOINT_BYTES)  # a second round trip
            record = taken.snapshot[0]
            assert (record.snapshot_id, record.step) == (snapshot_id, STEP)
            assert record.pieces == 1 + (len(blob) > 1 << 20)
            assert taken.snapshot[1] == blob
            # Expecting another snapshot than the newest: none is read.
            await s.release(taken.lease)
            other = await s.acquire_to_load("a", "w2", "addr:2", LEASE_MS, expected_snapshot="x")
            assert other.snapshot is None and other.snapshot_id == snapshot_id
        finally:
            await s.aclose()

    asyncio.run(main())


def test_a_snapshot_record_missing_a_field_is_a_data_error_and_the_lease_goes(
    redis_url: str,
) -> None:
    async def body(s: Store) -> None:
        lease, snapshot_id = await new(s, "a")
        await s.release(lease)
        await s.redis.hdel(s.keys("a").snap(snapshot_id), "label")
        with pytest.raises(StoreDataError, match="label"):
            await s.acquire_to_load("a", "w2", "addr:2", LEASE_MS, expected_snapshot=snapshot_id)
        assert await s.lease_holder("a") is None
        with pytest.raises(StoreDataError, match="label"):
            await s.snapshot_and_blob("a", snapshot_id)

    run(redis_url, body)
