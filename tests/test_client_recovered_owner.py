"""A worker the client gave up on, answering again, is gone to at once.

The client marks a worker unreachable when a call to it fails without an answer (it was
frozen, or restarting). When a redirect later names that worker as a session's owner, the
client used to wait out the owner's lease (``retry_after_ms``: a lease TTL, since the
owner renews it) before going there, on every such session, although the worker had long
come back. Now it asks the worker once; a worker that answers is gone to at once.
Real worker processes on a real Redis, the sync client.
"""

from __future__ import annotations

import time

import pytest

from ssmserve.client.sync import Client
from tests.cluster_helpers import start_workers
from tests.conftest import random_inputs

#: Long, so that waiting out a lease (the bug) is far from anything a loaded machine makes
#: of going there at once.
TTL_S = 20.0


@pytest.mark.slow
def test_a_redirect_to_a_worker_given_up_on_goes_there_once_it_answers(
    model_dirs, served_models, redis_url, tmp_path
):
    model = served_models["demo"]
    a, b = start_workers(2, model_dirs, redis_url, tmp_path, TTL_S)
    try:
        x = random_inputs(model, 3, seed=50)
        with Client(a.address) as via_a:
            sid = via_a.create_session("demo").session_id
            via_a.step(sid, x[0], step=1)
        with Client([b.address, a.address], discover=False) as client:
            b.pause()
            try:
                assert client.get_session(sid).step == 1  # B does not answer: A does
            finally:
                b.resume()
            assert b.address in client._aio.router._unreachable  # given up on
            via = Client(a.address)
            with via:
                assert via.migrate(sid, b.address).target == b.address
            # The session's owner as the client knows it (A) redirects to B, whose lease
            # runs for a TTL: the client asks B and steps there.
            started = time.monotonic()
            assert client.step(sid, x[1], step=2).step == 2
            took = time.monotonic() - started
            assert took < TTL_S / 2, f"{took:.1f} s: the client waited out B's lease"
            assert b.address not in client._aio.router._unreachable
            assert client.get_session(sid).owner == b.address
    finally:
        a.kill()
        b.kill()
