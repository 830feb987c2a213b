"""The fault matrix: what a client sees when a worker freezes, Redis stalls, the network
between a worker and Redis black-holes, a worker is cut off from Redis, a client vanishes,
or a worker is killed in the middle of a hand-off or a rollback.

Every test streams through the fault with the real client and ends with the same check:
every answered step is answered once, in order, bit-equal to an uninterrupted offline run,
and every answered step is in Redis. Time bounds are bounds on a guarantee (lease TTL +
keepalive + a stated allowance), never guesses about scheduling. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from ssmserve.client.aio import AsyncClient, step_input
from ssmserve.client.errors import SessionMoved, SsmserveClientError, step_redirect
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings, free_port
from ssmserve.server.state.lease import lease_clock
from ssmserve.server.state.store_errors import StoreUnavailableError
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.cluster_helpers import (
    check_exact,
    moving_on,
    start_workers,
    stream_in_background,
    wait_for,
)
from tests.conftest import random_inputs
from tests.redis_topologies import sync_client
from tests.tcp_proxy import TcpProxy
from tests.test_service import assert_bit_equal, reference, stream, stub

TTL_S = 1.0
KEEPALIVE_S = 0.5  # time and timeout, server and client
REDIS_TIMEOUT_S = 0.5

# In-process workers with short fault timers.
FAST = {
    "ownership": OwnershipSettings(lease_ttl_s=TTL_S, worker_ttl_s=TTL_S),
    "redis_timeout_s": REDIS_TIMEOUT_S,
    "keepalive_time_s": KEEPALIVE_S,
    "keepalive_timeout_s": KEEPALIVE_S,
}
# The same for worker processes.
FAST_ARGS = (
    "--redis-timeout", str(REDIS_TIMEOUT_S),
    "--keepalive", str(KEEPALIVE_S),
    "--keepalive-timeout", str(KEEPALIVE_S),
)  # fmt: skip
# Clients notice a frozen worker by keepalive; the stall timer is kept out of the way.
POLICY = {
    "keepalive_time_s": KEEPALIVE_S,
    "keepalive_timeout_s": KEEPALIVE_S,
    "stall_timeout_s": 30.0,
    "call_timeout_s": 5.0,
}


def session_dump(url: str, sid: str) -> dict[bytes, object]:
    """Every key of a session with its DUMP (the lease's TTL is not in a DUMP); the meta
    hash as its fields, but its ``beat``, which the owner's lease renewals move."""
    with sync_client(url) as r:
        dump: dict[bytes, object] = {}
        for k in r.scan_iter(match=f"ssm:{{{sid}}}:*"):
            if k.endswith(b":meta"):
                dump[k] = {f: v for f, v in r.hgetall(k).items() if f != b"beat"}
            else:
                dump[k] = r.dump(k)
        return dump


# ---------------------------------------------------------------------------- Redis stalls


def stream_through(
    worker, model, faults, seed: int, snapshot_every: int, durability: int = pb.DURABILITY_LOG
) -> None:
    """Two sessions stream on ``worker`` while each of ``faults`` happens in turn (each must
    end with the fault repaired); then every answer is checked against the offline run."""
    sids = [
        worker.client.create_session(
            "demo", snapshot_every=snapshot_every, durability=durability
        ).session_id
        for _ in range(2)
    ]
    xs = [random_inputs(model, 100_000, seed=seed + i) for i in range(2)]
    stop = threading.Event()
    thread, outs, errors = stream_in_background([worker.address], sids, xs, stop, **POLICY)
    try:
        wait_for(lambda: min(len(o) for o in outs) >= 30, errors)
        for fault in faults:
            fault()
            moving_on(outs, errors, what="the streams after the fault was repaired")
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    check_exact(model, sids, xs, outs, worker.client)


@pytest.mark.slow
def test_a_stalled_redis_loses_no_acknowledged_step(start_worker, served_models, tmp_path):
    """SIGSTOP Redis for three times the command timeout, three times, mid-stream: writes
    whose answers never came are unknown outcomes; the sessions reload from Redis and
    the streams go on. Nothing answered is lost, nothing differs, nothing is wedged."""
    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path / "redis")) as store:
        w = start_worker(url=store.url, **FAST)
        assert store.pid is not None

        def stall() -> None:
            os.kill(store.pid, signal.SIGSTOP)
            time.sleep(3 * REDIS_TIMEOUT_S)
            os.kill(store.pid, signal.SIGCONT)

        stream_through(w, served_models["demo"], [stall] * 3, seed=600, snapshot_every=16)


@pytest.mark.slow
@pytest.mark.parametrize("durability", [pb.DURABILITY_SNAPSHOT, pb.DURABILITY_NONE])
def test_a_redis_stall_shorter_than_the_lease_loses_no_step_held_only_in_memory(
    start_worker, served_models, tmp_path, durability
):
    """Sessions that do not log every step (``snapshot``, ``none``) hold the steps since
    their last flush in memory only. Redis stops for 3 s, well within the 5 s lease, twice:
    the snapshot writes and flushes under way time out (unknown outcomes). Memory is kept,
    unanswered, until Redis answers and says which outcome each was; then the streams go
    on. No answered step is lost, none differs, and no step is refused as a gap."""
    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path / "redis")) as store:
        lease = OwnershipSettings(lease_ttl_s=5.0, worker_ttl_s=5.0)
        w = start_worker(url=store.url, **(FAST | {"ownership": lease}))
        assert store.pid is not None

        def stall() -> None:
            os.kill(store.pid, signal.SIGSTOP)
            time.sleep(3.0)
            os.kill(store.pid, signal.SIGCONT)

        stream_through(
            w, served_models["demo"], [stall] * 2, seed=640, snapshot_every=16,
            durability=durability,
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("deliver", [True, False], ids=["delivered-late", "dropped"])
def test_a_black_holed_redis_connection_heals(start_worker, served_models, redis_url, deliver):
    """Traffic between the worker and Redis vanishes mid-pipeline (nothing is closed), then
    heals: either the held commands reach Redis late (after the worker gave up on them)
    or the connections die with them. Either way the streams go on exactly."""
    with TcpProxy.to_url(redis_url) as proxy:
        w = start_worker(url=proxy.url, **FAST)

        def hole(seconds: float) -> Callable[[], None]:
            def fault() -> None:
                proxy.black_hole()
                time.sleep(seconds)
                proxy.heal(deliver=deliver)

            return fault

        # shorter and longer than the lease
        faults = [hole(0.3), hole(1.5), hole(2.5)]
        stream_through(w, served_models["demo"], faults, seed=610, snapshot_every=8)


# ---------------------------------------------------------------------------- partition


@pytest.mark.slow
def test_a_worker_cut_off_from_redis_stops_answering_and_another_serves(
    start_worker, served_models, redis_url
):
    """Worker A loses Redis but not its clients. It answers nothing for its sessions once
    its leases may have run out (its own clock), and B serves them exactly."""
    model = served_models["demo"]
    with TcpProxy.to_url(redis_url) as proxy:
        a = start_worker(url=proxy.url, **FAST)
        b = start_worker(**FAST)
        logged = a.client.create_session("demo", snapshot_every=16).session_id
        # No Redis write per step: only A's clock can stop it from answering.
        memory = a.client.create_session(
            "demo", snapshot_every=1 << 20, durability=pb.DURABILITY_SNAPSHOT
        ).session_id
        xs = [random_inputs(model, 100_000, seed=620 + i) for i in range(2)]
        stop = threading.Event()
        thread, outs, errors = stream_in_background(
            [a.address, b.address], [logged], xs[:1], stop, **POLICY
        )
        only_a, memory_outs, _ = stream_in_background(
            [a.address], [memory], xs[1:], stop, discover=False,
            raise_on_error=False, give_up_after_s=3600, **POLICY,
        )  # fmt: skip
        decided = _answer_decisions(a, memory)
        try:
            wait_for(lambda: len(outs[0]) >= 30 and len(memory_outs[0]) >= 30, errors)
            stale = a.manager.resident(logged).lease.token  # A's, from before the cut
            proxy.black_hole()
            # The link is surely dead once black_hole() returns (the proxy's thread applies
            # it): the guarantee is bounded from there, not from when it was asked for.
            cut = lease_clock()
            wait_for(
                lambda: logged in b.manager.resident_ids() and len(outs[0]) > 0,
                errors,
                timeout_s=TTL_S + 10,
                what="B taking the session over",
            )
            moving_on(outs, errors, what="the stream on B")
            # A answered the in-memory session only under a lease whose last renewal was
            # sent before the cut: each answer's lease ran to at most the cut + TTL - 10%
            # (by A's own clock, the one it fences itself by). The bound is on the lease
            # each decision trusted, not on when the decision ran: a process descheduled
            # beside the soak's CPU hogs once made one 0.12 s after its lease check.
            assert decided and all(checked < until for checked, until in decided), decided
            assert max(until for _, until in decided) <= cut + TTL_S * 0.9
            time.sleep(TTL_S)
            quiet = len([o for o in memory_outs[0] if o.error is None])
            time.sleep(TTL_S)
            assert len([o for o in memory_outs[0] if o.error is None]) == quiet
            # Asked directly, A does not answer from memory either.
            with (
                Client(a.address, retry=RetryPolicy(give_up_after_s=0.5)) as direct,
                pytest.raises(SsmserveClientError) as refused,
            ):
                direct.forecast(memory, 1)
            assert refused.value.code.name == "UNAVAILABLE"
        finally:
            proxy.heal(deliver=False)
            stop.set()
            thread.join(30)
            only_a.join(30)
        assert not errors, errors
        check_exact(model, [logged], xs[:1], outs, b.client)
        # Healed, A finds its copy someone else's and lets go of it. (A may hold the
        # session again, legitimately: the client may have come back to A and A acquired
        # it anew, with a new token, as when B lost its own lease under load.)
        wait_for(lambda: _token_held(a, logged) != stale, [], 10, "A dropping its stale copy")


def _answer_decisions(worker, session_id: str) -> list[tuple[float, float]]:
    """Each time ``worker``'s stepper decided to answer steps of ``session_id`` (its lease
    check, ``Stepper._check_leases``, where a worker that may have lost the lease fences
    itself): when the check began and the lease bound (``valid_until``) it trusted, both
    on ``lease_clock``. A correct check decides after it began and before that bound."""
    stepper = worker.stepper("demo")
    check = stepper._check_leases
    decided: list[tuple[float, float]] = []

    async def recorded(work) -> None:
        began = lease_clock()
        await check(work)
        for w in work:
            if w.session.id == session_id and w.took and w.fenced is None:
                decided.append((began, w.session.lease.valid_until))

    stepper._check_leases = recorded
    return decided


def _token_held(worker, session_id: str) -> str | None:
    """The token of ``worker``'s resident copy of a session (None: not resident)."""
    s = worker.manager.resident(session_id)
    return None if s is None else s.lease.token


# ---------------------------------------------------------------------------- clients


def test_a_vanished_client_is_reaped(start_worker, served_models):
    """A client whose network dies mid-stream (half-open: nothing is closed) is noticed by
    the server's keepalive; its stream ends and the session stays consistent."""
    model = served_models["demo"]
    w = start_worker(keepalive_time_s=KEEPALIVE_S, keepalive_timeout_s=KEEPALIVE_S)
    sid = w.client.create_session("demo").session_id
    x = random_inputs(model, 40, seed=630)
    host, port = w.address.rsplit(":", 1)
    answered: list = []
    release = asyncio.Event()
    loop = asyncio.new_event_loop()

    async def client(address: str) -> None:
        # A client that does not notice the outage itself (no keepalive of its own).
        policy = RetryPolicy(keepalive_time_s=3600, keepalive_timeout_s=3600)
        async with AsyncClient(address, retry=policy, discover=False) as c:

            async def source():
                for row in x[:20]:
                    yield row
                await release.wait()  # keep the stream open

            async for out in c.stream_steps(sid, source(), first_step=1):
                answered.append(out)

    with TcpProxy(host, int(port)).start() as proxy:
        runner = threading.Thread(
            target=lambda: loop.run_until_complete(client(proxy.address)), daemon=True
        )
        runner.start()
        wait_for(lambda: len(answered) == 20, [], 10, "the first answers")
        assert w.worker.service.open_streams == 1
        started = time.monotonic()
        proxy.black_hole()
        wait_for(lambda: w.worker.service.open_streams == 0, [], 10, "the server reaping it")
        # keepalive time + timeout, plus one ping interval of slack for timer granularity
        assert time.monotonic() - started <= 3 * KEEPALIVE_S + 1.0
        proxy.heal(deliver=False)
        loop.call_soon_threadsafe(release.set)
        runner.join(10)
    loop.close()
    info = w.client.get_session(sid)
    assert info.step == 20
    rest = [o.output for o in w.client.stream_steps(sid, list(x[20:]), first_step=21)]
    assert_bit_equal(np.stack(rest), reference(model, x)[20:])


# ---------------------------------------------------------------------------- frozen owner


@pytest.mark.slow
def test_a_frozen_owner_is_replaced_and_fenced_even_when_the_id_is_reused(
    model_dirs, served_models, redis_url, tmp_path
):
    """SIGSTOP the owner mid-stream: the stream resumes on the other worker within
    keepalive time + timeout (the client notices the freeze), + a TTL (B watches the lease
    stand that long on its own clock before it takes over), + 1 s (the client's retry
    backoff, at most 0.2 s, and the restore), bit-exact. Meanwhile the session is closed and created
    again under the same id. After SIGCONT the old owner writes nothing: its token belongs
    to an incarnation that is gone, so nothing it still holds in memory lands anywhere."""
    model = served_models["demo"]
    a, b = start_workers(2, model_dirs, redis_url, tmp_path, TTL_S, FAST_ARGS)
    try:
        sid = Client(a.address).create_session("demo").session_id
        x = random_inputs(model, 100_000, seed=640)
        stop = threading.Event()
        stamps: list[list[float]] = [[]]
        thread, outs, errors = stream_in_background(
            [a.address, b.address], [sid], [x], stop, stamps=stamps, **POLICY
        )
        wait_for(lambda: len(outs[0]) >= 50, errors)
        a.pause()
        frozen_at, before = time.monotonic(), len(outs[0])
        wait_for(lambda: len(outs[0]) > before, errors, 30, "the stream moving to B")
        took = stamps[0][before] - frozen_at
        assert took <= 2 * KEEPALIVE_S + TTL_S + 1.0, f"{took:.2f} s to resume on B"
        moving_on(outs, errors, 50)
        stop.set()
        thread.join(30)
        assert not errors, errors
        with Client(b.address) as via_b:
            check_exact(model, [sid], [x], outs, via_b)
            old_steps = len(outs[0])
            # The id is used again: closed, created anew, streamed.
            via_b.close_session(sid)
            again = via_b.create_session("demo", session_id=sid).session_id
            y = random_inputs(model, 100, seed=641)
            got = [o.output for o in via_b.stream_steps(again, list(y), first_step=1)]
            assert_bit_equal(np.stack(got), reference(model, y))
        snapshot = session_dump(redis_url, sid)
        a.resume()
        wait_for(lambda: "dropped from memory" in a.log_text(), [], 10, "A dropping X")
        time.sleep(3 * TTL_S)  # A's renewals and whatever it had queued ran meanwhile
        assert session_dump(redis_url, sid) == snapshot, "the resumed owner wrote to the new X"
        # Steps sent straight to A, numbered for the old X and for the new one: redirected.
        with Client(a.address) as raw:
            for step in (old_steps + 1, 101):

                async def one(w, step=step):
                    request = pb.StreamRequest(steps=[step_input(sid, step, y[0])])
                    return [r async for r in w.sessions.Stream(iter([request]))]

                (response,) = raw._run(one(raw._aio.router.worker(a.address)))
                moved = step_redirect(response.results[0].error)
                assert isinstance(moved, SessionMoved) and moved.owner == b.address
        assert session_dump(redis_url, sid) == snapshot
        with Client([a.address, b.address]) as client:
            got = [o.output for o in client.stream_steps(sid, list(y[:10]), first_step=101)]
        z = np.concatenate([y, y[:10]])
        assert_bit_equal(np.stack(got), reference(model, z)[100:])
    finally:
        a.kill()
        b.kill()


# ---------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill_9_during_migration_hand_offs(model_dirs, served_models, redis_url, tmp_path):
    """Migrations between three workers, each with the source or the target killed at a
    random moment of the hand-off (and restarted): the stream never loses or doubles a
    step, and the session ends up with exactly one owner."""
    model = served_models["demo"]
    workers = start_workers(3, model_dirs, redis_url, tmp_path, TTL_S, FAST_ARGS)
    addresses = [w.address for w in workers]
    by_address = {w.address: w for w in workers}
    rng = random.Random(13)
    try:
        sid = Client(addresses[0]).create_session("demo", snapshot_every=16).session_id
        x = random_inputs(model, 100_000, seed=650)
        stop = threading.Event()
        thread, outs, errors = stream_in_background(addresses, [sid], [x], stop, **POLICY)
        wait_for(lambda: len(outs[0]) >= 30, errors)
        kills = 0
        for _round in range(12):
            with Client(addresses) as control:
                owner = control.get_session(sid).owner
                if owner not in by_address:
                    time.sleep(TTL_S)
                    continue
                target = rng.choice([a for a in addresses if a != owner])
                migrate = threading.Thread(
                    target=lambda c=control, t=target: _ignore(lambda: c.migrate(sid, t))
                )
                migrate.start()
                time.sleep(rng.uniform(0.0, 0.03))
                victim = by_address[rng.choice([owner, target])]
                victim.kill()
                kills += 1
                migrate.join(30)
            victim.start()
            moving_on(outs, errors, 10, timeout_s=30)
        stop.set()
        thread.join(30)
        assert not errors, errors
        assert kills >= 10
        with Client(addresses) as client:
            check_exact(model, [sid], [x], outs, client)
            owner = client.get_session(sid).owner
            assert sum(w.load for w in client.list_workers() if w.address != owner) == 0
    finally:
        for w in workers:
            w.kill()


@pytest.mark.slow
def test_kill_9_during_rollbacks(model_dirs, served_models, redis_url, tmp_path):
    """A rollback whose worker is killed at a random moment either happened or did not;
    either way the session continues exactly from the step it reports."""
    model = served_models["demo"]
    workers = start_workers(2, model_dirs, redis_url, tmp_path, TTL_S, FAST_ARGS)
    addresses = [w.address for w in workers]
    by_address = {w.address: w for w in workers}
    rng = random.Random(14)
    try:
        sid = Client(addresses[0]).create_session("demo", snapshot_every=8).session_id
        history = random_inputs(model, 40, seed=660)
        with Client(addresses, retry=RetryPolicy(**POLICY)) as client:
            list(client.stream_steps(sid, list(history), first_step=1))
            outcomes = set()
            for r in range(10):
                owner = client.get_session(sid).owner
                target = rng.randint(max(1, len(history) - 30), len(history) - 1)
                rollback = threading.Thread(
                    target=lambda t=target: _ignore(lambda: client.rollback(sid, to_step=t))
                )
                rollback.start()
                time.sleep(rng.uniform(0.0, 0.02))
                by_address[owner].kill()
                rollback.join(30)
                by_address[owner].start()
                step = client.get_session(sid).step
                assert step in (target, len(history)), (step, target, len(history))
                outcomes.add(step == target)
                more = random_inputs(model, 30, seed=670 + r)
                got = [o.output for o in client.stream_steps(sid, list(more), first_step=step + 1)]
                history = np.concatenate([history[:step], more])
                assert_bit_equal(np.stack(got), reference(model, history)[step:])
        assert True in outcomes  # some rollbacks did happen before their worker died
    finally:
        for w in workers:
            w.kill()


def _ignore(call) -> None:
    # The worker doing it was killed: the outcome is read back from the cluster.
    with contextlib.suppress(SsmserveClientError):
        call()


def test_a_session_dropped_as_it_loads_answers_its_step_with_an_error(
    worker, served_models, monkeypatch
):
    """A session can leave memory (an unknown write outcome) between its load finishing
    and the request that waited for the load going on. That request must not queue its
    step on the session that left (nobody would ever answer it): it gets the error that
    dropped the session (UNAVAILABLE, retry), and the retry loads the session again."""
    from ssmserve.server.sessions.errors import ReloadingError
    from ssmserve.server.sessions.residency import ResidentSessions

    model = served_models["demo"]
    x = random_inputs(model, 6, seed=640)
    sid = worker.client.create_session("demo").session_id
    stream = list(worker.client.stream_steps(sid, list(x[:5])))
    assert len(stream) == 5
    worker.call(worker.loader.unload(worker.manager.resident(sid), "test"))
    add = ResidentSessions.add
    dropped = []

    def loaded_then_dropped(residents, s, *args, **kwargs) -> None:
        add(residents, s, *args, **kwargs)  # the load's last act: the session is resident
        if not dropped:  # as a failed write of another request would, once
            dropped.append(s)
            residents.drop(s, ReloadingError(f"session {s.id!r} test drop"))

    monkeypatch.setattr(ResidentSessions, "add", loaded_then_dropped)
    with pytest.raises(ReloadingError):
        worker.call(worker.intake.submit(sid, 6, x[5]), timeout=10)
    outcome = worker.call(_answer(worker.intake, sid, 6, x[5]), timeout=10)  # the retry
    assert dropped and outcome.error is None
    assert_bit_equal(outcome.output, reference(model, x)[5])


async def _answer(intake, sid, step, value):
    return await asyncio.wait_for(await intake.submit(sid, step, value), 10)


@pytest.mark.parametrize("lands", [True, False], ids=["cut-lands", "cut-fails"])
def test_a_rollback_given_up_mid_write_leaves_memory_as_redis_has_it(worker, served_models, lands):
    """The client gives up on a rollback while its history cut is under way. The worker
    lets the cut finish and follows how it ended: landed (its reply late), the session is
    reloaded from Redis at the rolled-back step; failed, the session is as it was."""
    model = served_models["demo"]
    x = random_inputs(model, 30, seed=21)
    sid = worker.client.create_session("demo", snapshot_every=5).session_id
    stream(worker, sid, x[:12])
    resident = worker.manager.resident(sid)
    store = worker.store
    cut = store.cut_history

    async def slow_cut(*args: object, **kwargs: object) -> None:
        if lands:
            await cut(*args, **kwargs)
        await asyncio.sleep(3)  # the reply comes after the client's deadline
        if not lands:
            raise StoreUnavailableError("Redis refused the cut")

    store.cut_history = slow_cut
    try:
        with pytest.raises(grpc.RpcError) as raised:
            stub(worker).Rollback(pb.RollbackRequest(session_id=sid, step=7), timeout=1.0)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        want = 7 if lands else 12
        # the worker learns the outcome when the cut ends, ~2 s after the deadline
        wait_for(lambda: not resident.busy and worker.client.get_session(sid).step == want,
                 [], 30, "the cut's outcome")  # fmt: skip
    finally:
        store.cut_history = cut
    assert (sid not in worker.manager.resident_ids()) == lands  # reloaded only if it landed
    got, outs = stream(worker, sid, x[want : want + 10], first_step=want + 1)
    assert [o.step for o in outs] == list(range(want + 1, want + 11))
    assert_bit_equal(got, reference(model, x)[want : want + 10])


def test_a_snapshot_given_up_mid_flush_keeps_memory_as_redis_has_it(worker, served_models):
    """Snapshot durability keeps inputs in memory until a snapshot flushes them. A client
    gives up on a Snapshot while the flush is under way: the worker lets the append finish
    and marks the inputs flushed, so the next snapshot neither sends them again (Redis
    would refuse the repeat as a gap, and the session reload) nor loses them."""
    model = served_models["demo"]
    x = random_inputs(model, 20, seed=22)
    sid = worker.client.create_session("demo", durability=pb.DURABILITY_SNAPSHOT).session_id
    stream(worker, sid, x[:6])
    resident = worker.manager.resident(sid)
    store = worker.store
    append = store.append_logs

    async def append_then_reply_late(*args: object, **kwargs: object) -> object:
        result = await append(*args, **kwargs)  # lands in Redis...
        await asyncio.sleep(3)  # ...and its reply comes after the client's deadline
        return result

    store.append_logs = append_then_reply_late
    try:
        with pytest.raises(grpc.RpcError) as raised:
            stub(worker).Snapshot(pb.SnapshotRequest(session_id=sid), timeout=1.0)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: not resident.busy, [], 30, "the flush's outcome")
    finally:
        store.append_logs = append
    assert worker.client.snapshot(sid).step == 6
    assert worker.manager.resident(sid) is resident  # never reloaded
    got, outs = stream(worker, sid, x[6:16], first_step=7)
    assert [o.step for o in outs] == list(range(7, 17))
    assert_bit_equal(got, reference(model, x)[6:16])


@pytest.mark.slow
@pytest.mark.parametrize("rewind_window", [1024, 0], ids=["resumed", "raised"])
def test_a_session_that_comes_back_behind_its_answers_is_streamed_again_from_there(
    model_dirs, served_models, redis_url, tmp_path, rewind_window
):
    """A ``snapshot``-durability session holds the steps since its last snapshot in memory
    only: kill -9 of its worker loses them (documented). The other worker takes the
    session over at its last snapshot and answers the next step SESSION_REWOUND with the
    step it is at. The client sends its inputs again from there (it keeps the last
    ``rewind_window`` answered), yields none of those steps twice, and goes on exactly;
    one that kept none raises SessionRewound saying where the session is. Never an
    endless STEP_GAP."""
    from ssmserve.client.errors import SessionRewound

    model = served_models["demo"]
    workers = start_workers(2, model_dirs, redis_url, tmp_path, TTL_S, FAST_ARGS)
    try:
        sid = (
            Client(workers[0].address)
            .create_session("demo", snapshot_every=16, durability=pb.DURABILITY_SNAPSHOT)
            .session_id
        )
        xs = [random_inputs(model, 100_000, seed=680)]
        stop = threading.Event()
        thread, outs, errors = stream_in_background(
            [w.address for w in workers], [sid], xs, stop, rewind_window=rewind_window,
            **POLICY,
        )  # fmt: skip
        wait_for(lambda: len(outs[0]) >= 40, errors)
        answered = len(outs[0])
        workers[0].kill()
        if rewind_window:
            moving_on(outs, errors, 30, timeout_s=30, what="the stream after the takeover")
            stop.set()
            thread.join(30)
            assert not errors, errors
            restored = workers[1].log_text()
            assert "restored at step" in restored
            step = int(restored.split("restored at step ")[1].split(",")[0])
            assert step < answered  # it did come back behind what was answered
            with Client(workers[1].address) as client:
                check_exact(model, [sid], xs, outs, client)
        else:
            thread.join(30)
            assert len(errors) == 1 and isinstance(errors[0], SessionRewound), errors
            rewound = errors[0]
            assert rewound.session_step < rewound.answered == len(outs[0])
            assert rewound.session_step % 16 == 0  # its last snapshot
            assert f"from step {rewound.session_step + 1}" in str(rewound)
    finally:
        for w in workers:
            w.kill()


@pytest.mark.slow
def test_a_renewal_refused_for_a_while_keeps_steps_held_only_in_memory(
    start_worker, served_models, tmp_path, caplog
):
    """Redis turns into a replica for two seconds (as a master behind a DNS name does in a
    managed failover) and back: every lease renewal meanwhile is refused (READONLY), an
    unknown outcome. A renewal changes no session data, so the ``snapshot``-durability
    sessions stay in memory (their steps since the last snapshot are held there only) and
    go on once Redis takes writes again: no answered step lost, none applied twice."""
    import logging

    import redis as redis_py

    with EmbeddedRedis(EmbeddedRedisSettings(data_dir=tmp_path / "redis")) as store:
        lease = OwnershipSettings(lease_ttl_s=3.0, worker_ttl_s=3.0)
        w = start_worker(url=store.url, **(FAST | {"ownership": lease}))
        caplog.set_level(logging.INFO, logger="ssmserve.server.sessions.residency")

        def demoted_for_a_while() -> None:
            with redis_py.Redis.from_url(store.url) as r:
                r.replicaof("127.0.0.1", free_port())  # a master nobody runs
                time.sleep(2.0)  # a renewal round or two (every TTL / 3) is refused
                r.replicaof("NO", "ONE")

        stream_through(
            w, served_models["demo"], [demoted_for_a_while], seed=650, snapshot_every=1 << 20,
            durability=pb.DURABILITY_SNAPSHOT,
        )  # fmt: skip
        dropped = [
            r.getMessage() for r in caplog.records if "dropped from memory" in r.getMessage()
        ]
        assert not dropped, dropped
