"""Ownership across workers (in-process workers, one real Redis, real gRPC on loopback):
redirects, fencing of a stale owner, migration (also under load), drain."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ssmserve.client.aio import step_input
from ssmserve.client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    SessionMoved,
    Unavailable,
    from_rpc_error,
    step_redirect,
)
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.cluster.peers import PeerSettings
from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.sessions.migration import MigrationSettings
from ssmserve.server.sessions.rebalance import RebalanceSettings
from ssmserve.server.worker import LIVENESS_SERVICE
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.cluster_helpers import wait_for
from tests.conftest import random_inputs, write_model
from tests.harness import WorkerHarness
from tests.redis_topologies import sync_client
from tests.test_faults import session_dump
from tests.test_service import assert_bit_equal, reference, stream

#: Ownership, migration and drains on one Redis, a Redis Cluster and Sentinel (the last
#: two slow-marked, see conftest).
ALL_TOPOLOGIES = True


def raw_error(client: Client, address: str, invoke) -> grpc.RpcError:
    """Make one raw call (no redirect following) on the client's loop; return its error.

    (Raw calls go through the client's own grpc.aio channel: this process already runs
    grpc.aio, and the synchronous stack must not be started next to it.)
    """

    async def call():
        try:
            await invoke(client._aio.router.worker(address))
        except grpc.RpcError as exc:
            return exc
        raise AssertionError("the call did not fail")

    return client._run(call())


def test_workers_register_and_list_each_other(start_worker):
    a, b = start_worker(), start_worker()
    workers = a.client.list_workers()
    assert sorted(w.address for w in workers) == sorted([a.address, b.address])
    served = {"demo", "odd", "lm", "m2", "lm2"}
    assert all(set(w.models) == served and not w.draining for w in workers)
    a.client.create_session("demo")
    # A client given one worker learns the others from ListWorkers.
    with Client(a.address) as learner:
        learner.discover()
        assert sorted(learner.addresses) == sorted([a.address, b.address])
    a.call(a.worker.ownership.heartbeat())
    load = {w.address: w.load for w in b.client.list_workers()}
    assert load == {a.address: 1, b.address: 0}
    b.stop()  # a clean stop leaves the registry at once
    assert [w.address for w in a.client.list_workers()] == [a.address]


def test_any_worker_redirects_to_the_owner(start_worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=1)
    a, b = start_worker(), start_worker()
    sid = a.client.create_session("demo").session_id
    info = b.client.get_session(sid)
    assert info.owner == a.address and info.resident
    # The client pointed at B just follows: every call and the stream reach A.
    with Client(b.address) as via_b:
        # A raw call to the non-owner: UNAVAILABLE with the owner in the trailing metadata.
        raw = raw_error(
            via_b, b.address, lambda w: w.sessions.Snapshot(pb.SnapshotRequest(session_id=sid))
        )
        assert raw.code() == grpc.StatusCode.UNAVAILABLE
        assert ("ssmserve-owner", a.address) in tuple(raw.trailing_metadata())
        moved = from_rpc_error(raw)
        assert isinstance(moved, SessionMoved) and moved.owner == a.address
        got = np.stack([o.output for o in via_b.stream_steps(sid, list(x), first_step=1)])
        assert via_b.owner_of(sid) == a.address
        assert via_b.snapshot(sid, label="here").step == 10
        assert via_b.rollback(sid, to_step=4).step == 4
    assert_bit_equal(got, reference(model, x))
    assert b.manager.resident_count == 0 and a.manager.resident_count == 1


@pytest.mark.parametrize("count", [1, 4])
def test_a_stale_owner_is_fenced_and_drops_the_session(
    start_worker, served_models, redis_url, count
):
    """A loses its lease (as if paused past it); B takes the session over. A's next write
    carries the old fencing token: Redis refuses it, nothing changes, A drops the session
    and answers the step with a redirect to B (inside the stream, which goes on).
    ``count`` 4: the steps come as one run (one message), all refused alike."""
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=2)
    a = start_worker(ownership=OwnershipSettings(renew_every_s=3600))  # A never renews
    b = start_worker()
    sid = a.client.create_session("demo", snapshot_every=100).session_id
    stream(a, sid, x[:5])
    with sync_client(redis_url) as r:
        r.delete(f"ssm:{{{sid}}}:lease")  # A's lease ran out
        b.saw_lease_unrenewed(sid, r.hget(f"ssm:{{{sid}}}:meta", "beat").decode())
        with Client(b.address) as via_b:
            got = [o.output for o in via_b.stream_steps(sid, list(x[5:8]), first_step=6)]
        assert_bit_equal(np.stack(got), reference(model, x)[5:8])
        assert int(r.hget(f"ssm:{{{sid}}}:meta", "epoch")) == 2
        before = r.hgetall(f"ssm:{{{sid}}}:log"), r.hgetall(f"ssm:{{{sid}}}:meta")

        # A still holds it in memory with its old token, at step 5; step 6 again (not 9)
        # so it applies
        async def stale_steps(w):
            steps = [step_input(sid, 6 + k, x[7 + k], packed=True) for k in range(count)]
            call = w.sessions.Stream(iter([pb.StreamRequest(steps=steps)]))
            return [r async for r in call]

        with Client(a.address) as raw_client:
            (response,) = raw_client._run(stale_steps(raw_client._aio.router.worker(a.address)))
        assert len(response.results) == count
        for result in response.results:  # the redirect is each step's answer; no abort
            moved = step_redirect(result.error)
            assert isinstance(moved, SessionMoved) and moved.reason == "STALE_EPOCH"
            assert moved.owner == b.address
        assert (r.hgetall(f"ssm:{{{sid}}}:log"), r.hgetall(f"ssm:{{{sid}}}:meta")) == before
        assert a.manager.resident_count == 0  # dropped at once
    # B's history is intact and goes on exactly.
    with Client(a.address) as via_a:  # pointed at the old owner: redirected to B
        rest = [o.output for o in via_a.stream_steps(sid, list(x[8:]), first_step=9)]
    assert_bit_equal(np.stack(rest), reference(model, x)[8:])


def test_migrate_moves_a_session_and_streams_follow(start_worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 30, seed=3)
    a, b = start_worker(), start_worker()
    sid = a.client.create_session("demo", snapshot_every=7).session_id
    stream(a, sid, x[:10])
    # any worker may be asked; the owner does it
    with Client(b.address) as via_b:
        moved = via_b.migrate(sid, b.address)
    assert (moved.source, moved.target, moved.step) == (a.address, b.address, 10)
    assert moved.snapshot_id and moved.elapsed_ms > 0
    assert a.manager.resident_count == 0 and b.manager.resident_count == 1
    assert b.client.get_session(sid).owner == b.address
    # a client that only knows A still streams, and resends are answered, not re-applied
    got, outs = stream(a, sid, x[8:], first_step=9)
    assert [o.replayed for o in outs[:2]] == [True, True]
    assert_bit_equal(got, reference(model, x)[8:])
    # migrating to where it is changes nothing
    assert a.client.migrate(sid, b.address).source == b.address


def test_migrate_refuses_bad_targets(start_worker, model_dirs, redis_url):
    from tests.harness import WorkerHarness

    a = start_worker()
    lm_only = WorkerHarness({"lm": model_dirs["lm"]}, redis_url)
    try:
        sid = a.client.create_session("demo").session_id
        with pytest.raises(NotFound, match="no live worker"):
            a.client.migrate(sid, "127.0.0.1:1")
        with pytest.raises(FailedPrecondition, match="does not serve model 'demo'"):
            a.client.migrate(sid, lm_only.address)
        with pytest.raises(NotFound):
            a.client.migrate("nope", a.address)
        assert a.manager.resident_count == 1  # untouched, still served here
        assert a.client.get_session(sid).owner == a.address
    finally:
        lm_only.stop()


def test_migration_under_load_is_exact(start_worker, served_models):
    """Streams keep going while their sessions hop between workers; nothing is lost or
    applied twice, and every output equals the uninterrupted reference."""
    model = served_models["demo"]
    a, b = start_worker(), start_worker()
    n, steps = 3, 300
    xs = [random_inputs(model, steps, seed=10 + i) for i in range(n)]
    sids = [a.client.create_session("demo", snapshot_every=16).session_id for _ in range(n)]
    outs: list[list] = [[] for _ in range(n)]
    clients = [Client([a.address]) for _ in range(n)]

    enough_moves = threading.Event()

    async def paced(x):
        for t, row in enumerate(x):
            await asyncio.sleep(0.004)
            if t == len(x) - 1:  # on a loaded machine hops are slower: wait for them
                for _ in range(1000):
                    if enough_moves.is_set():
                        break
                    await asyncio.sleep(0.01)
            yield row

    def run(i):
        outs[i].extend(clients[i].stream_steps(sids[i], paced(xs[i]), first_step=1))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    moves = 0
    try:
        while any(t.is_alive() for t in threads) and moves < 24:
            i = moves % n
            owner = a.client.get_session(sids[i]).owner
            target = b.address if owner == a.address else a.address
            a.client.migrate(sids[i], target)
            moves += 1
            if moves >= 12:
                enough_moves.set()
            time.sleep(0.01)
    finally:
        for t in threads:
            t.join(60)
        for c in clients:
            c.close()
    assert moves >= 12
    for i in range(n):
        assert [o.step for o in outs[i]] == list(range(1, steps + 1))
        assert_bit_equal(np.stack([o.output for o in outs[i]]), reference(model, xs[i]))


def test_drain_moves_every_session_to_the_others(start_worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=4)
    a, b, c = start_worker(), start_worker(), start_worker()
    sids = [a.client.create_session("demo").session_id for _ in range(4)]
    for sid in sids:
        stream(a, sid, x[:6])
    progress = list(b.client.drain(a.address))  # asked of another worker: relayed
    assert [p.done for p in progress] == [1, 2, 3, 4] and {p.total for p in progress} == {4}
    assert {p.session_id for p in progress} == set(sids)
    assert {p.target for p in progress} == {b.address, c.address}  # balanced by load
    assert not any(p.error for p in progress)
    assert a.manager.resident_count == 0
    draining = {w.address: w.draining for w in c.client.list_workers()}
    assert draining == {a.address: True, b.address: False, c.address: False}
    # readiness ("") says not to send it new work; liveness says it must not be killed
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(a.address))
    status = {
        name: health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
        for name in ("", LIVENESS_SERVICE)
    }
    assert status == {
        "": health_pb2.HealthCheckResponse.NOT_SERVING,
        LIVENESS_SERVICE: health_pb2.HealthCheckResponse.SERVING,
    }
    # a draining worker creates nothing itself: the client is sent to another worker
    created = a.client.create_session("demo")
    assert created.owner in (b.address, c.address)
    for sid in sids:
        got, _ = stream(a, sid, x[6:], first_step=7)
        assert_bit_equal(got, reference(model, x)[6:])
    assert a.manager.resident_count == 0


def test_drain_with_nowhere_to_go_parks_sessions_for_later(start_worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=5)
    a = start_worker()
    sid = a.client.create_session("demo", snapshot_every=100).session_id
    stream(a, sid, x[:7])
    (progress,) = list(a.client.drain())
    assert progress.session_id == sid and progress.target == "" and not progress.error
    info = a.client.get_session(sid)
    assert not info.resident and info.step == 7 and info.owner == ""
    a.stop()
    b = start_worker()
    got, _ = stream(b, sid, x[7:], first_step=8)
    assert_bit_equal(got, reference(model, x)[7:])
    assert b.client.get_session(sid).owner == b.address


@contextlib.contextmanager
def slow_moves(worker: WorkerHarness, seconds: float) -> Iterator[None]:
    """Each session's move in a drain of ``worker`` (a hand-off to another worker, or
    parking it when there is none) starts ``seconds`` late, as a large session's may
    take; moves are quick again on exit."""
    migrator, loader = worker.worker.migrator, worker.loader
    hand_off, park = migrator.hand_off, loader.park

    async def slow_hand_off(session_id: str, target: Any, started: float | None = None) -> Any:
        await asyncio.sleep(seconds)
        return await hand_off(session_id, target, started)

    async def slow_park(session_id: str, reason: str) -> None:
        await asyncio.sleep(seconds)
        await park(session_id, reason)

    migrator.hand_off, loader.park = slow_hand_off, slow_park
    try:
        yield
    finally:
        migrator.hand_off, loader.park = hand_off, park


def test_a_slow_drain_sends_heartbeats(start_worker):
    a = start_worker(migration=MigrationSettings(drain_heartbeat_s=0.05))
    sid = a.client.create_session("demo").session_id
    started = time.monotonic()
    with slow_moves(a, 1.0), grpc.insecure_channel(a.address) as channel:
        stub = pb_grpc.ClusterServiceStub(channel)
        messages = list(stub.Drain(pb.DrainRequest(), timeout=30))
    elapsed = time.monotonic() - started
    *beats, last = messages
    # one every 0.05 s at most, over the 1 s move and the drain's own Redis calls; the loop
    # may run late under load, so fewer
    assert 3 <= len(beats) <= elapsed / 0.05 + 1
    assert all(m.heartbeat and not m.session_id and (m.done, m.total) == (0, 0) for m in beats)
    assert not last.heartbeat and last.session_id == sid and (last.done, last.total) == (1, 1)
    assert last.target == "" and not last.error  # nowhere to go: parked


def test_the_client_bounds_each_wait_of_a_drain_by_its_stall_timeout(start_worker):
    patient = RetryPolicy(stall_timeout_s=0.5)
    a = start_worker(migration=MigrationSettings(drain_heartbeat_s=0.05))
    sid = a.client.create_session("demo").session_id
    with slow_moves(a, 1.5), Client(a.address, retry=patient) as client:
        (progress,) = list(client.drain())  # heartbeats kept it going, and are not yielded
    assert progress.session_id == sid and not progress.heartbeat
    # A worker that sends nothing for longer than the bound (here: no heartbeats) is
    # given up on, well before its move would have finished.
    b = start_worker(migration=MigrationSettings(drain_heartbeat_s=60))
    b.client.create_session("demo")
    started = time.monotonic()
    with slow_moves(b, 3), Client(b.address, retry=patient) as client:
        with pytest.raises(DeadlineExceeded, match=r"no reply for 0\.5 s"):
            list(client.drain())
        assert time.monotonic() - started < 2.5
    # Giving up ended the drain: the move under way finished (parked: nowhere to go).
    wait_for(lambda: b.manager.resident_count == 0, [], 30, "the move under way")


STALLED_RELAY = r"DEADLINE_EXCEEDED: no reply for 0\.5 s \(PeerSettings\.drain_stall_s\)"


def test_a_relayed_drain_gives_up_on_a_worker_that_sends_nothing(start_worker):
    a = start_worker(peers=PeerSettings(drain_stall_s=0.5))
    b = start_worker(migration=MigrationSettings(drain_heartbeat_s=60))  # sends no heartbeat
    b.client.create_session("demo")
    started = time.monotonic()
    with slow_moves(b, 3), pytest.raises(Unavailable, match=STALLED_RELAY):
        list(a.client.drain(b.address))
    assert time.monotonic() - started < 2.5  # the relay's bound, not the move's 3 s
    wait_for(lambda: b.manager.resident_count == 0, [], 30, "the move under way")


def test_a_migration_given_up_after_the_target_took_the_session_leaves_it_there(
    start_worker, served_models
):
    """The client's deadline on a Migrate passes after the target took the session but
    before the source heard back. The source cannot tell, so it keeps nothing in memory:
    with snapshot durability no Redis write per step would stop a stale copy answering,
    and A's lease renewal (off here: its lease is good for 27 s by its clock) would find
    out only later."""
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=9)
    unrenewed = OwnershipSettings(lease_ttl_s=30, worker_ttl_s=30, renew_every_s=3600)
    a = start_worker(ownership=unrenewed)
    b = start_worker()
    sid = a.client.create_session("demo", durability=pb.DURABILITY_SNAPSHOT).session_id
    stream(a, sid, x[:5])
    migrator = b.worker.migrator
    adopt = migrator.adopt

    async def adopt_then_hang(session_id: str) -> tuple[int, int]:
        taken = await adopt(session_id)  # B holds the session now...
        await asyncio.sleep(60)  # ...and its answer does not reach A in time
        return taken

    migrator.adopt = adopt_then_hang
    try:
        request = pb.MigrateRequest(session_id=sid, target=b.address)
        with grpc.insecure_channel(a.address) as channel, pytest.raises(grpc.RpcError) as raised:
            pb_grpc.ClusterServiceStub(channel).Migrate(request, timeout=3.0)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: sid not in a.manager.resident_ids(), [], 10, "A letting go")
    finally:
        migrator.adopt = adopt
    wait_for(lambda: sid in b.manager.resident_ids(), [], 10, "B holding it")
    rest, outs = stream(a, sid, x[5:], first_step=6)  # sent on to B
    assert [o.step for o in outs] == list(range(6, 13))
    assert_bit_equal(rest, reference(model, x)[5:])


def test_client_gives_up_on_a_cluster_it_cannot_reach():
    with Client("127.0.0.1:1", retry=RetryPolicy(give_up_after_s=0.2), discover=False) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            c.get_session("x")
        assert time.monotonic() - t0 < 5


@pytest.mark.slow
def test_lease_renewals_keep_their_schedule_during_a_long_replay(model_dirs, redis_url, tmp_path):
    """A rollback that replays thousands of steps runs on the engine thread: the event loop
    keeps renewing leases meanwhile (no round waits for the replay)."""
    directory = tmp_path / "wide"
    spec = DemoSpec(input_dim=8, output_dim=8, hidden=256, layers=8, state=16)
    model = write_model(directory, demo_config(spec))
    # A replay of about 2.5 s on this machine as it is now (a CPU hog may run beside us): a
    # first guess from an offline probe (a replay is a prefill), then longer until a
    # replay spans four periods.
    probe = random_inputs(model, 400, seed=4)
    started = time.monotonic()
    model.prefill(probe, outputs="last")
    steps = min(20_000, max(400, int(2.5 / ((time.monotonic() - started) / len(probe)))))
    settings = OwnershipSettings(lease_ttl_s=1.5, worker_ttl_s=1.5)
    w = WorkerHarness({"wide": directory}, redis_url, ownership=settings)
    patient = RetryPolicy(call_timeout_s=600, stall_timeout_s=600)
    ownership = w.worker.ownership
    try:
        with Client(w.address, retry=patient) as client:
            sid = client.create_session("wide", snapshot_every=1 << 20).session_id
            total = 0
            while steps > 0:
                x = random_inputs(model, steps, seed=5 + total)
                list(client.stream_steps(sid, list(x), first_step=total + 1, steps_per_message=16))
                total += steps
                before, started = ownership.renewals, time.monotonic()
                result = client.rollback(sid, to_step=total - 1)  # replays from step 0
                took = time.monotonic() - started
                total -= 1
                assert result.replayed_steps == total
                if took > 4 * settings.period_s:
                    break
                steps = min(3 * steps, 60_000 - total)
        assert took > 4 * settings.period_s, f"the replay took only {took:.2f} s"
        # A replay on the event loop would hold the round due during it for the rest of the
        # replay: at least three quarters of it, since the replay spans four periods. A
        # shorter late start is the machine's scheduling: the soak runs this beside CPU
        # hogs, and rounds 0.65 and 0.78 s late were seen at loads of ~8 on 2 cores (the
        # second in a replay of 1.2 s, when two periods were enough here: too close to
        # tell a blocked loop from a busy machine, hence four, and a bound of 0.6 x).
        late = ownership.worst_late_s
        assert late < 0.6 * took, (
            f"a renewal round started {late:.2f} s late in a {took:.2f} s replay"
        )
        missed = int(late / settings.period_s)  # rounds skipped by that stall
        assert ownership.renewals - before >= int(took / settings.period_s) - 1 - missed
    finally:
        w.stop()


def test_a_lease_that_ran_out_is_acquired_again_before_the_next_answer(
    start_worker, served_models, redis_url
):
    """A stops renewing (as if its loop stalled) past its TTL; nobody takes the session.
    Its next answer waits for a renewal, which finds the lease gone and acquires the
    session again with a new token (memory is still exact: nobody else wrote)."""
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=7)
    ttl = OwnershipSettings(lease_ttl_s=0.5, worker_ttl_s=5.0, renew_every_s=3600)
    a = start_worker(ownership=ttl)
    sid = a.client.create_session("demo", durability=pb.DURABILITY_SNAPSHOT).session_id
    got, _ = stream(a, sid, x[:5])
    time.sleep(0.8)  # the lease ran out, in Redis and by A's clock
    with sync_client(redis_url) as r:
        assert r.get(f"ssm:{{{sid}}}:lease") is None
        rest, _ = stream(a, sid, x[5:], first_step=6)
        assert int(r.hget(f"ssm:{{{sid}}}:meta", "epoch")) == 2  # a new token
        assert r.get(f"ssm:{{{sid}}}:lease") is not None
    assert_bit_equal(np.concatenate([got, rest]), reference(model, x))


def test_an_owner_whose_lease_may_have_run_out_answers_nothing_from_memory(
    start_worker, served_models, redis_url
):
    """With no Redis write per step (snapshot durability) only A's own clock can stop it:
    once its lease ran out and B took the session over, A's next step, forecast, export
    and GetSession are not answered from A's memory."""
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=8)
    ttl = OwnershipSettings(lease_ttl_s=0.5, worker_ttl_s=5.0, renew_every_s=3600)
    a = start_worker(ownership=ttl)
    b = start_worker()
    sid = a.client.create_session("demo", durability=pb.DURABILITY_SNAPSHOT).session_id
    stream(a, sid, x[:5])  # in A's memory only
    time.sleep(0.8)
    with sync_client(redis_url) as r:  # B watched A's lease stand, as if A had frozen
        b.saw_lease_unrenewed(sid, r.hget(f"ssm:{{{sid}}}:meta", "beat").decode())
    with Client(b.address, discover=False) as via_b:  # B takes over at the base snapshot
        assert via_b.get_session(sid).step == 0
        got = [o.output for o in via_b.stream_steps(sid, list(x[:3]), first_step=1)]
    assert_bit_equal(np.stack(got), reference(model, x[:3]))
    before = session_dump(redis_url, sid)

    async def stale_step(w):
        call = w.sessions.Stream(iter([pb.StreamRequest(steps=[step_input(sid, 6, x[5])])]))
        return [r async for r in call]

    with Client(a.address, discover=False) as raw:
        (response,) = raw._run(stale_step(raw._aio.router.worker(a.address)))
        moved = step_redirect(response.results[0].error)
        assert isinstance(moved, SessionMoved) and moved.owner == b.address
        info = raw.get_session(sid)  # A redirects to the owner: B's step, not A's step 5
        assert (info.step, info.owner) == (3, b.address)
        assert raw.forecast(sid, 2).outputs.shape == (2, 4)  # B's, from step 3
        assert raw.export_checkpoint(sid)  # B's too
    assert session_dump(redis_url, sid) == before
    assert sid not in a.manager.resident_ids()


def test_sessions_spread_over_workers_as_they_join(start_worker, served_models):
    """Rebalancing rounds, one at a time: 9 sessions on A, then B and C join; A hands
    sessions over (at most 4 a round, down to the mean) until each holds 3, and then
    nobody moves anything. Every session goes on exactly where it was."""
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=41)
    a = start_worker()
    sids = [a.client.create_session("demo").session_id for _ in range(9)]
    for sid in sids:
        stream(a, sid, x[:6])
    b, c = start_worker(), start_worker()
    workers = (a, b, c)

    def rounds() -> list[int]:
        for w in workers:  # the registry's loads as of now (a heartbeat is a few s apart)
            w.call(w.worker.ownership.heartbeat())
        return [w.call(w.worker.rebalancer.round()) for w in workers]

    assert rounds() == [4, 0, 0]  # at most 4 a round; B and C hold fewer than the mean
    assert rounds() == [2, 0, 0]  # down to the mean, 3
    assert rounds() == [0, 0, 0]  # balanced: nobody moves (no back and forth)
    assert [w.manager.resident_count for w in workers] == [3, 3, 3]
    owners = {a.client.get_session(sid).owner for sid in sids}
    assert owners == {a.address, b.address, c.address}
    for sid in sids:  # through A: redirected to wherever the session went
        got, _ = stream(a, sid, x[6:], first_step=7)
        assert_bit_equal(got, reference(model, x)[6:])


def test_rebalancing_leaves_the_http_doors_sessions_on_their_worker(start_worker):
    """The HTTP door's sessions (its prefix cache, labelled created-by=http) stay where
    the door that closes them is; the others spread as usual."""
    a = start_worker()
    door = [
        a.client.create_session("demo", labels={"created-by": "http"}).session_id for _ in range(6)
    ]
    others = [a.client.create_session("demo").session_id for _ in range(4)]
    b = start_worker()
    for w in (a, b):
        w.call(w.worker.ownership.heartbeat())
    assert a.call(a.worker.rebalancer.round()) > 0
    assert set(door) <= set(a.manager.resident_ids())
    assert set(b.manager.resident_ids()) <= set(others)


def test_a_joining_worker_is_filled_by_the_timer_and_drains_give_nothing_back(
    start_worker, served_models
):
    """``--rebalance-every 1``: B joins next to A's 6 streaming sessions and gets half
    of them within a bound while they stream; a draining worker takes none."""
    model = served_models["demo"]
    x = random_inputs(model, 40, seed=42)
    often = RebalanceSettings(every_s=1.0)
    fast = OwnershipSettings(lease_ttl_s=1.0, worker_ttl_s=1.0)  # heartbeats every 1/3 s
    drained = start_worker(rebalance=often, ownership=fast)
    list(drained.client.drain())  # before A has sessions: nothing can have moved there
    a = start_worker(rebalance=often, ownership=fast)
    sids = [a.client.create_session("demo").session_id for _ in range(6)]
    for sid in sids:
        stream(a, sid, x[:10])
    b = start_worker(rebalance=often, ownership=fast)
    # bound: a round every 0.75..1.25 s moves up to 4; one heartbeat later A sees it
    deadline = time.monotonic() + 30
    while [a.manager.resident_count, b.manager.resident_count] != [3, 3]:
        assert time.monotonic() < deadline, (a.manager.resident_count, b.manager.resident_count)
        time.sleep(0.05)
    assert drained.manager.resident_count == 0

    # Exactly the imbalance, counted while nothing else can move a session (no stream
    # runs). Not after the streams below: with leases of 1 s, a starved host can let one
    # lapse, a stream then loads that session where it asks, and the timer rightly moves
    # one back (CI run beside a soak: 4). A round counts its moves when it ends, which
    # may be a moment after this thread saw the last one land (CI: 0 + 0 once).
    def moved() -> int:
        return a.worker.rebalancer.moved + b.worker.rebalancer.moved

    wait_for(lambda: moved() >= 3, [], 10, "the round's count")
    assert moved() == 3
    for i, sid in enumerate(sids):  # each goes on exactly, wherever it is now
        got, _ = stream(a if i % 2 else b, sid, x[10:], first_step=11)
        assert_bit_equal(got, reference(model, x)[10:])
