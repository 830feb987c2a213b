"""ssmserve on Redis Cluster and Sentinel: the same sessions, bit for bit, on a 3-master
cluster (slots moving under live streams) and on a Sentinel-watched master (failing over
under live streams)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from ssmserve.client.sync import Client
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.redis_topology import BadRedisUrlError, RedisUrl
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import StoreError
from tests.cluster_helpers import check_exact, moving_on, stream_in_background, wait_for
from tests.conftest import random_inputs
from tests.redis_topologies import RedisClusterHarness, SentinelHarness, sync_client
from tests.test_service import assert_bit_equal, reference

ALL_TOPOLOGIES = True  # every test here that uses redis_url runs on each topology


def ids_on_every_master(cluster: RedisClusterHarness, count: int) -> list[str]:
    """Session ids whose hash tags fall on different masters (all three, round robin)."""
    with sync_client(cluster.url) as r:
        by_port: dict[int, list[str]] = {}
        i = 0
        while min((len(v) for v in by_port.values()), default=0) < count or len(by_port) < 3:
            sid = f"s{i}"
            port = cluster.owner_of_slot(r.keyslot(f"ssm:{{{sid}}}:meta"))
            by_port.setdefault(port, []).append(sid)
            i += 1
    return [sid for group in zip(*by_port.values(), strict=False) for sid in group][: 3 * count]


def test_every_session_rpc_is_exact(start_worker, served_models, redis_url):
    """Create, stream, snapshot, rollback, fork, forecast, export/import, list and close,
    checked bit for bit against the offline model, on each topology."""
    model = served_models["demo"]
    x = random_inputs(model, 40, seed=17)
    w = start_worker()
    c = w.client
    sids = [c.create_session("demo", session_id=f"t{i}", snapshot_every=8).session_id
            for i in range(4)]  # fmt: skip
    for sid in sids:
        got = np.stack([o.output for o in c.stream_steps(sid, list(x[:20]), first_step=1)])
        assert_bit_equal(got, reference(model, x[:20]))
    sid = sids[0]
    assert c.snapshot(sid, label="mark").step == 20
    assert c.rollback(sid, to_step=12).step == 12
    again = np.stack([o.output for o in c.stream_steps(sid, list(x[12:30]), first_step=13)])
    assert_bit_equal(again, reference(model, x[:30])[12:])
    fork = c.fork(sid, at_step=20, new_session_id="t-fork").session.session_id
    branch = np.stack([o.output for o in c.stream_steps(fork, list(x[20:25]), first_step=21)])
    assert_bit_equal(branch, reference(model, x[:25])[20:])
    ahead = c.forecast(sid, 5)
    assert ahead.from_step == 30 and ahead.outputs.shape[0] == 5
    assert_bit_equal(c.forecast(sid, 5).outputs, ahead.outputs)  # and nothing moved
    assert c.get_session(sid).step == 30
    blob = c.export_checkpoint(sid)
    c.import_checkpoint(blob, "t-copy")
    tail = np.stack([o.output for o in c.stream_steps("t-copy", list(x[30:40]), first_step=31)])
    assert_bit_equal(tail, reference(model, x)[30:])
    listed = {s.session_id for s in c.list_sessions()}
    assert listed == {*sids, "t-fork", "t-copy"}
    c.close_session(sids[1])
    assert {s.session_id for s in c.list_sessions()} == {*sids, "t-fork", "t-copy"} - {sids[1]}


@pytest.mark.slow
@pytest.mark.topology
def test_resharding_live_sessions_while_they_stream(model_dirs, served_models, redis_cluster,
                                                    tmp_path):  # fmt: skip
    """Two worker processes on the cluster; six sessions (two per master) stream while
    the slot of each moves to another master key by key (MIGRATING/IMPORTING, so the
    workers meet ASK and TRYAGAIN). No step fails, every output is exact."""
    from tests.cluster_helpers import start_workers

    redis_cluster.flushall()
    model = served_models["demo"]
    workers = start_workers(2, model_dirs, redis_cluster.url, tmp_path, lease_ttl_s=2.0)
    addresses = [w.address for w in workers]
    try:
        sids = ids_on_every_master(redis_cluster, 2)
        for i, sid in enumerate(sids):
            Client(addresses[i % 2]).create_session("demo", session_id=sid, snapshot_every=16)
        xs = [random_inputs(model, 20_000, seed=500 + i) for i in range(len(sids))]
        stop = threading.Event()
        thread, outs, errors = stream_in_background(addresses, sids, xs, stop, stall_timeout_s=5)
        wait_for(lambda: min(len(o) for o in outs) >= 20, errors)
        with sync_client(redis_cluster.url) as r:
            slots = [r.keyslot(f"ssm:{{{sid}}}:meta") for sid in sids]
        for slot in slots:
            here = redis_cluster.owner_of_slot(slot)
            there = next(p for p in redis_cluster.ports if p != here)
            redis_cluster.move_slot(slot, there, pause_s=0.02)
            assert redis_cluster.owner_of_slot(slot) == there
            moving_on(outs, errors, 1, timeout_s=60, what="every stream after a slot moved")
        stop.set()
        thread.join(60)
        assert not errors, errors
        with Client(addresses) as client:
            check_exact(model, sids, xs, outs, client)
    finally:
        for w in workers:
            w.kill()


@pytest.mark.slow
@pytest.mark.topology
def test_sentinel_failover_while_streaming_loses_no_acknowledged_step(
    model_dirs, served_models, redis_sentinel: SentinelHarness, tmp_path
):
    """A worker on Sentinel with --redis-wait-replicas 1; four sessions stream while
    Sentinel fails the master over. Clients see UNAVAILABLE and resume; every answered
    step is still there on the new master and every output is exact."""
    from tests.cluster_helpers import start_workers

    redis_sentinel.flushall()
    model = served_models["demo"]
    workers = start_workers(
        1, model_dirs, redis_sentinel.url, tmp_path, lease_ttl_s=2.0,
        extra_args=("--redis-wait-replicas", "1"),
    )  # fmt: skip
    address = workers[0].address
    try:
        sids = [Client(address).create_session("demo", snapshot_every=16).session_id
                for _ in range(4)]  # fmt: skip
        xs = [random_inputs(model, 20_000, seed=700 + i) for i in range(4)]
        stop = threading.Event()
        thread, outs, errors = stream_in_background([address], sids, xs, stop, stall_timeout_s=5)
        wait_for(lambda: min(len(o) for o in outs) >= 20, errors)
        old = redis_sentinel.master()
        assert redis_sentinel.failover() != old
        moving_on(outs, errors, 21, timeout_s=60, what="every stream after the failover")
        stop.set()
        thread.join(60)
        assert not errors, errors
        with Client(address) as client:
            check_exact(model, sids, xs, outs, client)
            for sid, out in zip(sids, outs, strict=True):  # acknowledged = durable
                assert client.get_session(sid).step >= len(out)
    finally:
        for w in workers:
            w.kill()


@pytest.fixture
def redis_cluster_with_replicas(tmp_path_factory: pytest.TempPathFactory):
    """Three masters with a replica each (its own, since a test fails a master over)."""
    with RedisClusterHarness(tmp_path_factory.mktemp("redis-cluster-r"), replicas=1) as c:
        yield c


@pytest.mark.slow
@pytest.mark.topology
def test_cluster_failover_with_wait_replicas_loses_no_acknowledged_step(
    model_dirs, served_models, redis_cluster_with_replicas: RedisClusterHarness, tmp_path
):
    """A worker on a Redis Cluster whose masters have a replica each, with
    --redis-wait-replicas 1; three sessions (one per master) stream while the master
    of one of them is killed and its replica takes over (and, restarted, the old master
    becomes the new one's replica). Clients see UNAVAILABLE and resume; every answered
    step is still there and every output is exact."""
    from tests.cluster_helpers import start_workers

    cluster = redis_cluster_with_replicas
    model = served_models["demo"]
    workers = start_workers(
        1, model_dirs, cluster.url, tmp_path, lease_ttl_s=2.0,
        extra_args=("--redis-wait-replicas", "1"),
    )  # fmt: skip
    address = workers[0].address
    try:
        sids = ids_on_every_master(cluster, 1)
        for sid in sids:
            Client(address).create_session("demo", session_id=sid, snapshot_every=16)
        xs = [random_inputs(model, 20_000, seed=800 + i) for i in range(len(sids))]
        stop = threading.Event()
        thread, outs, errors = stream_in_background([address], sids, xs, stop, stall_timeout_s=5)
        wait_for(lambda: min(len(o) for o in outs) >= 20, errors)
        with sync_client(cluster.url) as r:
            victim = cluster.owner_of_slot(r.keyslot(f"ssm:{{{sids[0]}}}:meta"))
        cluster.kill_node(victim)
        with sync_client(cluster.url) as r:  # its replica takes over its slots
            slot = r.keyslot(f"ssm:{{{sids[0]}}}:meta")
        wait_for(lambda: cluster.owner_of_slot(slot) != victim, errors, 60, "the failover")
        # The new master has no replica to confirm writes until the old one rejoins as
        # its replica: till then no write of its sessions counts (they reload, clients
        # retry), and the sessions on the other masters go on.
        moving_on([outs[1], outs[2]], errors, 21, timeout_s=60, what="the other masters' streams")
        cluster.restart_node(victim)
        moving_on(outs, errors, 21, timeout_s=60, what="every stream after the failover")
        stop.set()
        thread.join(60)
        assert not errors, errors
        with Client(address) as client:
            check_exact(model, sids, xs, outs, client)  # acknowledged = still there
    finally:
        for w in workers:
            w.kill()


def test_waiting_for_replicas_that_do_not_exist_answers_unavailable(redis_cluster):
    """With --redis-wait-replicas 1 on a cluster without replicas, no write counts: the
    store says the outcome is unknown (the WAIT is sent on the writing connection)."""
    from ssmserve.server.state.store_errors import StoreOutcomeUnknownError
    from tests.test_store import new

    redis_cluster.flushall()

    async def main() -> None:
        store = Store(StoreSettings(url=redis_cluster.url, wait_replicas=1, wait_timeout_ms=50))
        try:
            with pytest.raises(StoreOutcomeUnknownError, match="0 of 1 replicas confirmed"):
                await new(store, "w-x")  # applied on the master, not confirmed
        finally:
            await store.aclose()

    asyncio.run(main())


def test_a_master_whose_replica_is_silent_leaves_the_other_masters_writes_standing(
    redis_cluster_with_replicas: RedisClusterHarness,
):
    """With --redis-wait-replicas 1, one group commit for a session on every master while
    one master's replica is frozen: that master's session gets an unknown outcome (its
    write is not confirmed); the other two are recorded, and their logs hold the input.
    (Were one node's short WAIT to fail the whole batch, every session on every master
    would stall after a master's failover, until the old master rejoined as a replica.)"""
    from ssmserve.server.state.store_errors import StoreOutcomeUnknownError
    from tests.test_store import new

    cluster = redis_cluster_with_replicas
    cluster.flushall()
    sids = ids_on_every_master(cluster, 1)
    with sync_client(cluster.url) as r:
        master = cluster.owner_of_slot(r.keyslot(f"ssm:{{{sids[0]}}}:meta"))
    replica = cluster.replica_of(master)

    async def main() -> None:
        store = Store(StoreSettings(url=cluster.url, wait_replicas=1, wait_timeout_ms=200))
        try:
            leases = [await new(store, sid) for sid in sids]
            appends = [(lease, InputBlock.of(1, [b"in01"])) for lease in leases]
            with cluster.stopped(replica):
                outcomes = await store.append_logs(appends, 1.0)
            assert isinstance(outcomes[0], StoreOutcomeUnknownError), outcomes
            assert "0 of 1 replicas confirmed" in str(outcomes[0])
            assert outcomes[1:] == [None, None], outcomes
            for sid in sids[1:]:
                assert await store.read_log(sid, 1, 1) == [b"in01"]
        finally:
            await store.aclose()

    asyncio.run(main())


def test_a_batch_whose_slot_stays_refused_answers_per_call_and_runs_nothing_twice(
    redis_cluster,
):
    """One call of a batch lands on a slot left MIGRATING to a node that does not import
    it (ASK there, MOVED back, for as long as it lasts): past the deadline that call gets
    its refusal (a "did not run" error: UNAVAILABLE, retried by clients) and the other
    call's result stands; the batch is not sent again as a whole, so it ran once."""
    from ssmserve.server.state import redis_topology
    from ssmserve.server.state.script_batches import ScriptBatches
    from ssmserve.server.state.store_errors import StoreUnavailableError, reply_outcome

    redis_cluster.flushall()
    with sync_client(redis_cluster.url) as r:
        stuck_slot, fine_slot = r.keyslot("{stuck}:n"), r.keyslot("{fine}:n")
    here = redis_cluster.owner_of_slot(stuck_slot)
    there = next(p for p in redis_cluster.ports if p != here)
    source = redis_cluster.node(here)
    source.execute_command(
        "CLUSTER", "SETSLOT", stuck_slot, "MIGRATING", redis_cluster.node_id(there)
    )
    assert fine_slot != stuck_slot

    async def main() -> list:
        cluster = redis_topology.connect(redis_cluster.url, 2.0)
        try:
            script = cluster.register_script("return redis.call('INCR', KEYS[1])")
            # 2 s: the fine call must answer within the deadline on a loaded machine too
            # (missing it is a refusal, which is right, but not what this test looks at);
            # the stuck call is refused at the deadline whatever its length.
            batches = ScriptBatches(cluster, 0, 0, deadline_s=2.0)
            return await batches.run(script, [(["{stuck}:n"], []), (["{fine}:n"], [])])
        finally:
            await cluster.aclose()

    try:
        stuck, fine = asyncio.run(main())
    finally:
        source.execute_command("CLUSTER", "SETSLOT", stuck_slot, "STABLE")
    assert fine == 1
    assert isinstance(reply_outcome(stuck), StoreUnavailableError)
    with sync_client(redis_cluster.url) as r:
        assert r.get("{fine}:n") == b"1" and r.get("{stuck}:n") is None


def test_redis_urls_are_read_or_refused_clearly():
    cluster = RedisUrl.parse("redis+cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001")
    assert cluster.kind == "cluster" and cluster.hosts == (("10.0.0.1", 7000), ("::1", 7001))
    assert (cluster.username, cluster.password) == ("u", "p@ss")
    sentinel = RedisUrl.parse("rediss+sentinel://h:26379/main?ssl_ca_certs=/ca.pem")
    assert sentinel.tls and sentinel.master_name == "main"
    assert sentinel.options == {"ssl_ca_certs": "/ca.pem"}
    for bad, says in [
        ("redis+sentinel://h:26379", "master's name"),
        ("redis+cluster://h:7000/0", "no master name"),
        ("redis+cluster://h", "HOST:PORT"),
        ("redis+cluster://h:99999", "HOST:PORT"),
        ("redis+cluster://h:7000?timeout=3", "unknown option"),
    ]:
        with pytest.raises(BadRedisUrlError, match=says):
            RedisUrl.parse(bad)


def test_bad_topology_flags_are_refused_at_start():
    from ssmserve.server.main import build_parser, settings_from_args

    def settings(*argv: str) -> object:
        return settings_from_args(build_parser().parse_args(["--demo", *argv]))

    with pytest.raises(SystemExit, match="needs --redis-url"):
        settings("--redis-wait-replicas", "1")
    with pytest.raises(SystemExit, match="master's name"):
        settings("--redis-url", "redis+sentinel://127.0.0.1:26379")


@pytest.mark.slow
@pytest.mark.topology
def test_a_worker_runs_as_a_least_privilege_acl_user_on_the_cluster(
    model_dirs, served_models, redis_cluster
):
    """The ACL of docs/redis.md, plus its two cluster rules, set on every node, is enough for
    every session operation on Redis Cluster; without the cluster rules it is not."""
    from ssmserve.server.state.store_layout import WORKER_ACL_RULES, WORKER_CLUSTER_ACL_RULES
    from tests.harness import WorkerHarness
    from tests.test_store import every_session_operation

    redis_cluster.flushall()
    hosts = ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports[:2])
    url = f"redis+cluster://ssmserve-worker:worker-secret-1234@{hosts}"

    def grant(*rules: str) -> None:
        for port in redis_cluster.ports:
            redis_cluster.node(port).execute_command(
                "ACL", "SETUSER", "ssmserve-worker", "reset", "on", ">worker-secret-1234", *rules
            )

    try:
        grant(*WORKER_ACL_RULES.split())
        with pytest.raises(StoreError, match=r"permission|Cluster mode"):
            asyncio.run(_connect(url))
        grant(*WORKER_ACL_RULES.split(), *WORKER_CLUSTER_ACL_RULES.split())
        every_session_operation(WorkerHarness(model_dirs, url), served_models["demo"])
    finally:
        for port in redis_cluster.ports:
            redis_cluster.node(port).execute_command("ACL", "DELUSER", "ssmserve-worker")


async def _connect(url: str) -> None:
    """What a worker does first with the store: connect (learning the slots), read."""
    store = Store(StoreSettings(url=url))
    try:
        await store.ping()
        await store.live_workers()
    finally:
        await store.aclose()


@pytest.mark.slow
@pytest.mark.topology
def test_the_store_goes_on_after_a_cluster_node_restarts(redis_cluster):
    """A master is killed under the group commit: the append on its slots has an unknown
    outcome (the store never guesses), the other masters' appends stand, the client is told
    to learn the slot map again, and once the node is back the same Store appends on every
    master without a restart."""
    from ssmserve.server.state.store_errors import StoreOutcomeUnknownError
    from tests.test_store import new

    redis_cluster.flushall()
    sids = ids_on_every_master(redis_cluster, 1)  # one session per master
    victim = redis_cluster.owner_of_slot(_slot(redis_cluster, sids[0]))
    # The victim is SIGKILLed right after the writes, and what it acknowledged must come
    # back with it. With `appendfsync everysec` Redis may hold the AOF write back while an
    # earlier fsync is slow (up to 2 s) and reply all the same, so a kill loses acknowledged
    # writes on a busy disk (CI beside a soak: a session created just before the kill was
    # gone after the restart). `always` writes and syncs before replying, as docs/redis.md
    # says a deployment that must lose nothing on a Redis crash should.
    redis_cluster.node(victim).config_set("appendfsync", "always")

    async def body() -> None:
        store = Store(StoreSettings(url=redis_cluster.url, socket_timeout_s=2.0))
        try:
            leases = [await new(store, sid) for sid in sids]
            assert (
                await store.append_logs([(le, InputBlock.of(1, [b"a"])) for le in leases], 1.0)
                == [None] * 3
            )
            redis_cluster.kill_node(victim)
            outcomes = await store.append_logs(
                [(le, InputBlock.of(2, [b"b"])) for le in leases], 2.0
            )
            assert isinstance(outcomes[0], StoreOutcomeUnknownError), outcomes
            assert outcomes[1:] == [None, None], outcomes
            assert store.redis._initialize  # the slot map is learned again before next use
            redis_cluster.restart_node(victim)
            # unknown outcomes: read where each log ends, as a reload would, and go on
            steps = [(await store.get_meta(sid)).step for sid in sids]
            appends = [
                (le, InputBlock.of(step + 1, [b"c"]))
                for le, step in zip(leases, steps, strict=True)
            ]
            assert await store.append_logs(appends, 3.0) == [None] * 3
            assert [(await store.get_meta(sid)).step for sid in sids] == [s + 1 for s in steps]
        finally:
            await store.aclose()

    try:
        asyncio.run(body())
    finally:
        if victim not in redis_cluster.processes.procs:
            redis_cluster.restart_node(victim)


def _slot(cluster: RedisClusterHarness, sid: str) -> int:
    with sync_client(cluster.url) as r:
        return r.keyslot(f"ssm:{{{sid}}}:meta")


def test_the_harness_starts_a_server_elsewhere_when_its_port_was_taken(tmp_path) -> None:
    """Ports are found free, then bound by redis-server a moment later; on a shared
    machine something else can take one in between (a cluster node once failed to bind its
    bus port, and its test waited 30 s and erred). The harness starts it on another port."""
    import socket
    from contextlib import closing

    import redis

    from tests.redis_topologies import _Processes, free_cluster_port

    processes = _Processes(tmp_path)
    with closing(socket.socket()) as holder:
        taken = free_cluster_port()
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        try:
            port = processes.start_on_free_port(
                taken, lambda p: ["--port", str(p), "--bind", "127.0.0.1", "--save", ""]
            )
            assert port != taken
            with redis.Redis(port=port, socket_timeout=5) as r:
                assert r.ping()
        finally:
            processes.stop_all()


def test_a_harness_picks_ports_that_are_not_each_others_bus_ports(tmp_path) -> None:
    """Ports are picked before any server starts, so the OS does not keep them apart: one
    node once got another's cluster bus port (port + 10000) and could not start."""
    from tests.redis_topologies import RedisClusterHarness, SentinelHarness

    for _ in range(20):
        ports = RedisClusterHarness(tmp_path, replicas=1).ports
        assert len({*ports, *(p + 10000 for p in ports)}) == 2 * len(ports)
        sentinel = SentinelHarness(tmp_path)
        assert len(set(sentinel._ports)) == 5


@pytest.mark.slow
@pytest.mark.topology
def test_the_held_connection_follows_the_master_sentinel_names(redis_sentinel: SentinelHarness):
    """The store's held connection (a lone session's appends) is not the pool's, so the
    pool does not close it when it learns that the master moved. It follows on its own:
    once the pool knows another master, the next append reconnects through Sentinel."""
    from ssmserve.server.state.input_log import InputBlock
    from ssmserve.server.state.store import Store
    from ssmserve.server.state.store_calls import StoreSettings
    from tests.test_store import new

    redis_sentinel.flushall()

    async def body() -> None:
        s = Store(StoreSettings(url=redis_sentinel.url))
        try:
            lease = await new(s, "follow")
            assert await s.append_logs([(lease, InputBlock.of(1, [b"a"]))], 1.0) == [None]
            held = s.batches._held
            assert held is not None and held._connection is not None
            first = held._connection._reader
            pool = s.redis.connection_pool
            master = pool.master_address
            assert master == (held._connection.host, held._connection.port)
            pool.master_address = ("127.0.0.1", 1)  # as after a failover the pool learned
            assert await s.append_logs([(lease, InputBlock.of(2, [b"b"]))], 1.0) == [None]
            assert held._connection._reader is not first  # a new connection, asked again
            assert pool.master_address == master  # Sentinel named the real master again
            assert await s.read_log("follow", 1, 2) == [b"a", b"b"]
        finally:
            await s.aclose()

    asyncio.run(body())
