"""Settling a session whose write had an unknown outcome, against a real Redis: what the
store holds decides, and a store that lost acknowledged steps of a ``log`` session is
said loudly (a WARNING naming the steps), not only as a reload."""

from __future__ import annotations

import logging

import redis

from ssmserve.server.state.store_errors import StoreOutcomeUnknownError
from tests.conftest import random_inputs
from tests.test_service import stream


def test_a_store_that_lost_acknowledged_log_steps_is_a_warning(
    worker, served_models, redis_url, caplog
):
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=3)
    sid = worker.client.create_session("demo").session_id  # log durability
    stream(worker, sid, x)
    # A write of it had an unknown outcome (memory answers nothing until the store says
    # which), and the store lost steps 8..10 meanwhile (as a failover to a replica that
    # missed them would).
    worker.manager.resident(sid).unsettled = StoreOutcomeUnknownError("a lost answer")
    with redis.Redis.from_url(redis_url) as r:
        r.hset(f"ssm:{{{sid}}}:meta", "step", 7)
        r.hdel(f"ssm:{{{sid}}}:log", *(str(s) for s in range(8, 11)))
    with caplog.at_level(logging.WARNING, logger="ssmserve.server.sessions.residency"):
        info = worker.client.get_session(sid)
    assert info.step == 7  # reloaded from the store, which decides
    (warning,) = [r for r in caplog.records if "lost acknowledged steps" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert f"session {sid}: the store lost acknowledged steps 8..10" in warning.getMessage()
