"""How many replicas confirm each write (``--redis-wait-replicas auto``) counts every
replica the topology knows, up or down, not only those connected when the worker starts:
a worker started while a replica is away (a failover's old master not yet rejoined, a
replica restarting) must not acknowledge writes that no replica holds. Found by the
nemesis (Sentinel, seed 3): such a worker acknowledged 242 steps of a ``log`` session
that the next failover threw away."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from ssmserve.server.state.store import Store, StoreSettings
from tests.redis_topologies import RedisClusterHarness, SentinelHarness


def _connected_replicas(port: int) -> int:
    with redis.Redis(port=port, socket_timeout=2) as r:
        return len(r.execute_command("ROLE")[2])


def _until_no_replica_is_connected(port: int) -> None:
    deadline = time.monotonic() + 20
    while _connected_replicas(port):
        assert time.monotonic() < deadline, "the master still lists its replica"
        time.sleep(0.05)


def _auto(url: str) -> int:
    async def main() -> int:
        store = Store(StoreSettings(url=url, wait_replicas=None))  # auto
        try:
            decided = await store.settle_replica_confirmation()
            return decided.replicas
        finally:
            await store.aclose()

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.topology
def test_a_sentinel_master_whose_replica_is_down_still_waits_for_it(tmp_path):
    with SentinelHarness(tmp_path, replicas=1) as sentinel:
        assert _auto(sentinel.url) == 1
        sentinel.processes.stop(sentinel.replica_ports[0])
        _until_no_replica_is_connected(sentinel.master_port)
        assert _auto(sentinel.url) == 1  # Sentinel still knows it: writes wait for it


@pytest.mark.slow
@pytest.mark.topology
def test_a_cluster_master_whose_replica_is_down_still_waits_for_it(tmp_path):
    with RedisClusterHarness(tmp_path, masters=3, replicas=1) as cluster:
        assert _auto(cluster.url) == 1
        master = cluster.live_masters()[0]
        cluster.kill_node(cluster.replica_of(master))
        _until_no_replica_is_connected(master)
        assert _auto(cluster.url) == 1  # the cluster still lists it as that master's
