"""Replicated Redis as users run it: Sentinel failovers at default settings, beside CPU
load, and a failover to a replica that missed writes.

Every test here runs real processes on loopback: redis-servers, three sentinels, worker
processes, and TCP proxies where a link must be black-holed.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Iterator

import pytest

from ssmserve.client.sync import Client
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


@pytest.fixture(params=[1, 2], ids=["one-replica", "two-replicas"])
def sentinel_set(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SentinelHarness]:
    """A Sentinel-watched master with one replica (the shared harness) or two."""
    if request.param == 1:
        yield request.getfixturevalue("redis_sentinel")
        return
    with SentinelHarness(tmp_path_factory.mktemp("sentinel-2"), replicas=2) as harness:
        yield harness


@pytest.mark.slow
@pytest.mark.topology
def test_a_sentinel_failover_at_default_settings_loses_no_acknowledged_step(
    model_dirs, served_models, sentinel_set: SentinelHarness, tmp_path
):
    """Two workers on Sentinel with no replica flag at all (``auto``: every write waits
    until every replica holds it), beside two CPU hogs. Twice: a session is created and
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
        with cpu_hogs():
            for round_ in range(2):
                failed_over: list[int] = []
                failover = threading.Thread(
                    target=lambda done=failed_over: done.append(redis_sentinel.failover(60))
                )
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
                assert failed_over, "the failover did not finish"
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
