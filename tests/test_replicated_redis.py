"""Replicated Redis as users run it: Sentinel failovers at default settings, beside CPU
load, and a failover to a replica that missed writes.

Every test here runs real processes on loopback: redis-servers, three sentinels, worker
processes, and TCP proxies where a link must be black-holed.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from ssmserve.client.sync import Client
from ssmserve.server.embedded_redis import find_redis_server
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.cluster_helpers import (
    check_exact,
    moving_on,
    start_workers,
    stream_in_background,
    wait_for,
)
from tests.conftest import random_inputs
from tests.redis_topologies import SentinelHarness


@contextlib.contextmanager
def cpu_hogs(count: int = 2) -> Iterator[None]:
    """``count`` busy processes (``yes``) beside the test: the machine is as loaded as a
    shared host, which widens every scheduling window."""
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


@pytest.fixture
def sentinel_set(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SentinelHarness]:
    """A Sentinel-watched master with one replica (the shared harness) or two (the
    parameter, given indirectly)."""
    if request.param == 1:
        yield request.getfixturevalue("redis_sentinel")
        return
    with SentinelHarness(tmp_path_factory.mktemp("sentinel-2"), replicas=2) as harness:
        yield harness


@pytest.mark.slow
@pytest.mark.topology
# Two of the four pairs (one or two replicas, quiet or beside two CPU hogs): each setting
# of each is run, at ~37 s a run in a CI run that must stay under 30 minutes.
@pytest.mark.parametrize(
    ("sentinel_set", "hogs"),
    [(1, 0), (2, 2)],
    ids=["one-replica-quiet", "two-replicas-beside-two-cpu-hogs"],
    indirect=["sentinel_set"],
)
def test_a_sentinel_failover_at_default_settings_loses_no_acknowledged_step(
    model_dirs, served_models, sentinel_set: SentinelHarness, tmp_path, hogs
):
    """Two workers on Sentinel with no replica flag at all (``auto``: every write waits
    until every replica holds it), quiet or beside two CPU hogs. Twice: a session is created and
    starts streaming one step per message while Sentinel fails the master over. Every
    answered step is still there on the new master, each exactly once, bit-exact.

    Without replica confirmation (``--redis-wait-replicas 0``, the default before) the
    session itself was lost (NOT_FOUND); with two replicas and WAIT 1, steps the replica
    Sentinel re-points confirmed were lost (STEP_GAP "the session is at step 33" after 227
    answers)."""
    redis_sentinel = sentinel_set
    replicas = len(redis_sentinel.replica_ports)
    redis_sentinel.flushall()
    model = served_models["demo"]
    workers = start_workers(2, model_dirs, redis_sentinel.url, tmp_path, lease_ttl_s=2.0)
    addresses = [w.address for w in workers]
    try:
        for w in workers:
            assert f"every write waits until {replicas} replica(s) hold it" in w.log_text()
        with cpu_hogs(hogs):
            for round_ in range(2):
                failed_over: list[int] = []
                refused: list[str] = []

                def fail_over(done: list[int] = failed_over, why: list[str] = refused) -> None:
                    try:
                        done.append(redis_sentinel.failover(60))
                    except Exception as exc:  # said by the assertion below
                        why.append(repr(exc))

                failover = threading.Thread(target=fail_over)
                failover.start()
                # The session is created and streams while the failover runs.
                with Client(addresses) as client:
                    sid = client.create_session("demo", snapshot_every=16).session_id
                xs = [random_inputs(model, 20_000, seed=900 + round_)]
                stop = threading.Event()
                thread, outs, errors = stream_in_background(
                    addresses, [sid], xs, stop, stall_timeout_s=30, window=1
                )
                failover.join(90)
                assert failed_over, f"the failover did not finish: {refused}"
                wait_for(lambda: len(outs[0]) >= 1, errors, 60, "the first answer")  # noqa: B023
                moving_on(outs, errors, 30, timeout_s=90, what="the stream after the failover")
                stop.set()
                thread.join(60)
                assert not errors, errors
                with Client(addresses) as client:
                    check_exact(model, [sid], xs, outs, client)  # acknowledged = still there
    finally:
        for w in workers:
            w.kill()


@pytest.mark.slow
def test_a_failover_to_a_replica_that_missed_a_takeover_never_repeats_a_token(
    start_worker, served_models, tmp_path
):
    """The epoch counter lives in data replication can lose. A master P and a replica R
    that replicates through a proxy; the workers reach "the master" through another proxy.
    A owns X; replication is black-holed; X migrates to B (B acquires epoch 2 on P only);
    P is lost and R promoted in its place. A loads X from R and acquires epoch 2 again.
    B still trusts its lease by its own clock and sends a Rollback with its token: the
    tokens share the epoch but not the nonce, so R refuses it. Nothing changes, B lets X
    go, and A's session is exactly as R holds it.

    Without the nonce both tokens were '<incarnation>.2': B's rollback erased 20 of A's
    client's acknowledged steps, and A still said step 110 while Redis held 90."""
    import grpc

    from ssmserve.server.cluster.ownership import OwnershipSettings
    from tests.test_service import assert_bit_equal, reference, stream, stub

    model = served_models["demo"]
    x = random_inputs(model, 40, seed=910)
    with replica_through_a_proxy(tmp_path) as (primary, replica, link, front):
        # B trusts its lease for 30 s by its own clock and never renews it meanwhile.
        trusting = OwnershipSettings(lease_ttl_s=30.0, worker_ttl_s=30.0, renew_every_s=3600)
        # Replica confirmation off (--redis-wait-replicas 0): with it, the migration
        # below would not complete while R misses writes. Tokens must not repeat
        # even so: a restored backup or an fsync window loses writes the same way.
        a = start_worker(url=front.url, redis_wait_replicas=0)
        b = start_worker(url=front.url, ownership=trusting, redis_wait_replicas=0)
        sid = a.client.create_session("demo", snapshot_every=8).session_id
        stream(a, sid, x[:20])
        assert redis.Redis(port=primary).wait(1, 5000) == 1  # R holds all of it
        link.black_hole()  # from here R misses every write
        assert a.client.migrate(sid, b.address).target == b.address
        stream(b, sid, x[20:30], first_step=21)  # on P only
        b_token = b.manager.resident(sid).lease.token
        # P is lost; R is promoted and takes its address.
        redis.Redis(port=replica).replicaof("NO", "ONE")
        front.retarget("127.0.0.1", replica)
        with Client(a.address, discover=False) as via_a:  # A loads X from R
            assert via_a.get_session(sid).step == 20
            got = [o.output for o in via_a.stream_steps(sid, list(x[20:25]), first_step=21)]
        assert_bit_equal(np.stack(got), reference(model, x[:25])[20:])
        a_token = a.manager.resident(sid).lease.token
        assert a_token.split(".")[:2] == b_token.split(".")[:2]  # the same epoch ...
        assert a_token != b_token  # ... and still not the same token
        with redis.Redis(port=replica) as r:
            before = r.hgetall(f"ssm:{{{sid}}}:meta"), r.hgetall(f"ssm:{{{sid}}}:log")
        # B, sure of its lease, is asked to roll X back: R refuses B's token.
        # (Its first calls may meet the connections the failover reset: sent again.)
        answers: list[str] = []

        def rollback_at_b() -> str:
            with pytest.raises(grpc.RpcError) as refused:
                stub(b).Rollback(pb.RollbackRequest(session_id=sid, step=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            answers.append(str(refused.value.trailing_metadata()))
            return answers[-1]

        wait_until(lambda: "STORE_UNAVAILABLE" not in rollback_at_b(), "B reaching R", 10)
        assert "STALE_EPOCH" in answers[-1], answers[-1]
        with redis.Redis(port=replica) as r:
            after = r.hgetall(f"ssm:{{{sid}}}:meta"), r.hgetall(f"ssm:{{{sid}}}:log")
        assert (after[0].pop(b"beat", None), after) == (before[0].pop(b"beat", None), before)
        assert sid not in b.manager.resident_ids()
        assert a.client.get_session(sid).step == 25


@pytest.mark.slow
def test_a_step_no_replica_confirmed_is_never_reported_then_lost(
    start_worker, served_models, tmp_path
):
    """With replicas required (``--redis-wait-replicas 1``), a step the master applied but
    no replica confirmed has an unknown outcome: a failover loses it. A master P and a
    replica R replicating through a proxy; replication is black-holed; A's step 21 lands
    on P alone (its outcome unknown: 0 of 1 replicas confirmed); A crashes and its lease
    runs out. B, asked where the session stands, must not say 21 from P: R, with step 20,
    is then promoted and P made its replica. B answers UNAVAILABLE while no replica
    confirms, then 20, and step 21 sent again is applied once.

    Before: B read P's meta and said step 21, which a client takes as applied (it resumes
    after it), and then the session stood at 20: a step reported, then lost (the nemesis's
    rule (a) on Sentinel, seeds 5202 and 5204)."""
    import grpc

    from ssmserve.server.cluster.ownership import OwnershipSettings
    from tests.test_service import stream, stub
    from tests.test_store_guard import raw_step

    model = served_models["demo"]
    x = random_inputs(model, 21, seed=911)
    with replica_through_a_proxy(tmp_path) as (primary, replica, link, front):
        short = OwnershipSettings(lease_ttl_s=1.0, worker_ttl_s=1.0)
        a, b = (
            start_worker(url=front.url, ownership=short, redis_wait_replicas=1) for _ in range(2)
        )
        sid = a.client.create_session("demo").session_id  # log durability
        stream(a, sid, x[:20])
        link.black_hole()  # from here R misses every write
        result = raw_step(a.address, sid, 21, x[20])
        assert result.error.reason == "STORE_OUTCOME_UNKNOWN", result
        meta = f"ssm:{{{sid}}}:meta"
        assert int(redis.Redis(port=primary).hget(meta, "step")) == 21  # on P alone
        a.crash()
        wait_until(
            lambda: not redis.Redis(port=primary).exists(f"ssm:{{{sid}}}:lease"),
            "A's lease running out",
        )
        with pytest.raises(grpc.RpcError) as unconfirmed:
            stub(b).GetSession(pb.GetSessionRequest(session_id=sid), timeout=30)
        assert unconfirmed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "could not confirm" in unconfirmed.value.details()
        # R is promoted and takes the master's address; P, as Sentinel would have it,
        # becomes R's replica (and drops step 21 with its full resync).
        redis.Redis(port=replica).replicaof("NO", "ONE")
        front.retarget("127.0.0.1", replica)
        redis.Redis(port=primary).replicaof("127.0.0.1", replica)
        assert b.client.get_session(sid).step == 20
        got = [o.output for o in b.client.stream_steps(sid, [x[20]], first_step=21)]
        np.testing.assert_array_equal(got[0], model.run(x)[0][20])


@contextlib.contextmanager
def replica_through_a_proxy(tmp_path) -> Iterator[tuple[int, int, Any, Any]]:
    """A master P and a replica R (no persistence) that replicates through a proxy (the
    link, to black-hole), and a proxy for the workers' "master" (the front, to retarget):
    (P's port, R's port, link, front), R in sync with P."""
    from ssmserve.server.embedded_redis import free_port
    from tests.tcp_proxy import TcpProxy

    primary, replica = free_port(), free_port()
    args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    servers = [
        subprocess.Popen(
            [find_redis_server(), "--port", str(port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp_path,
        )
        for port in (primary, replica)
    ]
    try:
        for port in (primary, replica):
            wait_until(lambda p=port: redis.Redis(port=p).ping(), f"redis on {port}")
        with (
            TcpProxy("127.0.0.1", primary).start() as link,  # replication: P -> R
            TcpProxy("127.0.0.1", primary).start() as front,  # the workers' "master"
        ):
            redis.Redis(port=replica).replicaof("127.0.0.1", link.port)
            wait_until(
                lambda: redis.Redis(port=replica).info("replication")["master_link_status"] == "up",
                "the replica's initial sync",
            )
            yield primary, replica, link, front
    finally:
        for server in servers:
            server.kill()
            server.wait(10)


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` (errors count as not yet) until it holds, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if condition():
                return
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
