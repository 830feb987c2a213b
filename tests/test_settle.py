"""What memory holds after a fault or a rollback, against a real Redis and worker.

- Settling a session whose write had an unknown outcome: what the store holds decides,
  and a store that lost acknowledged steps of a ``log`` session is said loudly (a WARNING
  naming the steps), not only as a reload.
- A rollback keeps the output of the step it went back to, which a fork made then
  carries in its first snapshot.
"""

from __future__ import annotations

import logging

import numpy as np
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


def test_a_fork_just_after_a_long_rollback_carries_the_output_of_its_step(worker, served_models):
    """Memory keeps outputs for fewer steps (64) than inputs (256). A rollback to a step
    whose input memory still held but whose output it did not replayed that output and
    threw it away; a fork made then wrote its first snapshot without it, and the fork,
    once reloaded from that snapshot (its only one), could never forecast (the nemesis's
    final forecast, seed 5204 on Sentinel: FAILED_PRECONDITION, output of step 3959 not
    known)."""
    from ssmserve.server.state.checkpoint import Checkpoint

    model = served_models["demo"]
    x = random_inputs(model, 150, seed=12)
    sid = worker.client.create_session("demo", snapshot_every=50).session_id
    stream(worker, sid, x)
    worker.client.rollback(sid, to_step=60)  # replays 51..60 from the snapshot at 50
    child = worker.client.fork(sid).session.session_id
    (first,) = worker.client.list_snapshots(child)
    ckpt = Checkpoint.decode(worker.client.export_checkpoint(child, first.snapshot_id))
    assert ckpt.step == 60 and ckpt.output is not None
    np.testing.assert_array_equal(ckpt.output, model.run(x[:60])[0][-1])
