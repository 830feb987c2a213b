"""Log ahead (``sessions/log_ahead.py``): a batch's log appends go to Redis before its
engine calls and are answered after; what the log and the answers hold must not change
from the group commit after the engine calls (the path of a session with guards), and a
step logged ahead but not applied must not leave memory and Redis apart."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.log_ahead import LogAhead
from ssmserve.server.sessions.session import SessionGoneError, StepOutcome
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.harness import next_engine_call
from tests.test_service import assert_bit_equal, reference

STEPS = 40


#: A guard that never fires: a session with guards logs in the group commit after its
#: engine calls, never ahead (a guard may refuse an output).
NEVER_FIRES = pb.GuardRule(
    name="never", check=pb.GuardRule.CHECK_FINITE, action=pb.GuardRule.ACTION_REPORT
)


async def _step(intake, sid: str, step: int, value: np.ndarray) -> StepOutcome:
    return await asyncio.wait_for(await intake.submit(sid, step, value), 10)


def _log_session(
    start_worker,
    served_models,
    steps: int,
    seed: int,
    stepped: int,
    ahead: bool = True,
    **config,
):
    """A worker with a log-durability demo session (logged ahead, or with ``ahead``
    False a guard that never fires: logged after) stepped through its first ``stepped``
    of ``steps`` random inputs: (model, inputs, worker, session id)."""
    model = served_models["demo"]
    x = random_inputs(model, steps, seed=seed)
    worker = start_worker()
    guards = () if ahead else (NEVER_FIRES,)
    sid = worker.client.create_session(
        "demo", durability=pb.DURABILITY_LOG, guards=guards, **config
    ).session_id
    for t in range(1, stepped + 1):
        assert worker.call(_step(worker.intake, sid, t, x[t - 1])).error is None
    return model, x, worker, sid


async def _drive(intake, sid: str, x: np.ndarray, output_dim: int) -> np.ndarray:
    """Steps 1..STEPS in every shape a batch takes: lone steps, eight queued singles (one
    batch: all eight in one append), a run of 16 cut by snapshots at steps 16 and 24
    (one batch, three engine calls, one append), lone steps again. Returns the outputs
    ``(STEPS, o)``."""
    out = np.empty((STEPS, output_dim), np.float32)
    for t in range(1, 4):
        out[t - 1] = (await _step(intake, sid, t, x[t - 1])).output
    futures = [intake.submit_resident(sid, t, x[t - 1], True) for t in range(4, 12)]
    for t, outcome in zip(range(4, 12), await asyncio.gather(*futures), strict=True):
        assert outcome.error is None, outcome.error
        out[t - 1] = outcome.output
    run_future = intake.submit_run_resident(sid, 12, x[11:27])
    assert run_future is not None
    run = await asyncio.wait_for(run_future, 10)
    assert all(o is None or o.error is None for o in run.outcomes)
    for t, o in enumerate(run.outcomes):  # a step's own outcome, else its row of outputs
        out[11 + t] = run.outputs[t] if o is None else o.output
    for t in range(28, STEPS + 1):
        out[t - 1] = (await _step(intake, sid, t, x[t - 1])).output
    return out


def _logged(worker, sid: str) -> dict[int, bytes]:
    async def read() -> dict[int, bytes]:
        raw = await worker.store.read_log(sid, 1, STEPS)
        return dict(enumerate(raw, start=1))

    return worker.call(read())


def test_logging_ahead_or_after_the_engine_call_logs_and_answers_the_same(
    start_worker, served_models, monkeypatch
):
    model = served_models["demo"]
    x = random_inputs(model, STEPS, seed=1901)
    sent_ahead: list[int] = []
    send = LogAhead.send

    async def counted(self, blocks):  # counts, then sends as it would
        sent_ahead.extend(block.count for _, block in blocks)
        return await send(self, blocks)

    monkeypatch.setattr(LogAhead, "send", counted)
    logs, ahead_counts = {}, {}
    for ahead in (True, False):
        worker = start_worker()
        sid = worker.client.create_session(
            "demo", durability=pb.DURABILITY_LOG, snapshot_every=8, snapshot_phase=0,
            guards=() if ahead else (NEVER_FIRES,),
        ).session_id  # fmt: skip
        sent_ahead.clear()
        outputs = worker.call(_drive(worker.intake, sid, x, model.config.output_dim))
        assert_bit_equal(outputs, reference(model, x))
        logs[ahead] = _logged(worker, sid)
        ahead_counts[ahead] = list(sent_ahead)
        assert worker.client.get_session(sid).step == STEPS
    assert logs[True] == logs[False]
    assert len(logs[True]) == STEPS
    # Ahead: each batch's whole advance in one append (the lone steps, the 8 queued
    # singles, the run's 16 steps); with a guard, everything in the group commit after.
    assert ahead_counts[True] == [1] * 3 + [8] + [16] + [1] * 13
    assert ahead_counts[False] == []


def test_a_step_logged_ahead_whose_engine_call_fails_reloads_the_session(
    start_worker, served_models
):
    """The engine call raises after the step's input went to the log: the step is answered
    with a retryable error and the session leaves memory, since Redis may hold the step
    while memory does not. The resend of that step is then answered from the reloaded
    session, right the first time: kept in memory at the earlier step, it would apply the
    step again and find the log already past it."""
    model, x, worker, sid = _log_session(start_worker, served_models, 6, 1902, 3)
    session = worker.manager.resident(sid)
    assert session.config.durability == Durability.LOG

    async def fails(step, states, values):
        await asyncio.sleep(0.05)  # the append sent ahead reaches Redis meanwhile
        raise RuntimeError("injected engine failure")

    with next_engine_call(worker.engine("demo"), fails):
        failed = worker.call(_step(worker.intake, sid, 4, x[3]))
    assert isinstance(failed.error, SessionGoneError), failed.error
    assert "injected engine failure" in str(failed.error)
    assert worker.manager.resident(sid) is not session  # left memory
    assert sorted(_logged_upto(worker, sid, 4)) == [1, 2, 3, 4]  # Redis kept step 4
    outputs = [worker.call(_step(worker.intake, sid, t, x[t - 1])) for t in (4, 5, 6)]
    assert [o.error for o in outputs] == [None, None, None]
    assert outputs[0].replayed  # step 4 came from the log
    expected = reference(model, x)
    for t, o in zip((4, 5, 6), outputs, strict=True):
        assert_bit_equal(o.output, expected[t - 1])


def test_a_batch_whose_engine_call_is_cancelled_by_someone_else_fails_and_steps_go_on(
    start_worker, served_models
):
    """A task a batch awaits is cancelled, not the stepper (an offloaded engine call's
    future cancelled, say): the batch fails like any other (its step answered with the
    error, the session reloaded since its input was logged ahead), and the model's stepper
    keeps running. Ending it on that CancelledError left every later step of every
    session of the model unanswered."""
    model, x, worker, sid = _log_session(start_worker, served_models, 6, 1903, 3)

    async def cancelled(step, states, values):
        raise asyncio.CancelledError  # as awaiting a task someone else cancelled

    with next_engine_call(worker.engine("demo"), cancelled):
        failed = worker.call(_step(worker.intake, sid, 4, x[3]))
    assert isinstance(failed.error, SessionGoneError), failed.error
    assert "CancelledError" in str(failed.error)
    outputs = [worker.call(_step(worker.intake, sid, t, x[t - 1])) for t in (4, 5, 6)]  # bounded
    assert [o.error for o in outputs] == [None, None, None]
    expected = reference(model, x)
    for t, o in zip((4, 5, 6), outputs, strict=True):
        assert_bit_equal(o.output, expected[t - 1])
    task = worker.stepper("demo")._task
    assert task is not None and not task.done()


def _logged_upto(worker, sid: str, last: int) -> dict[int, bytes]:
    async def read() -> dict[int, bytes]:
        return dict(enumerate(await worker.store.read_log(sid, 1, last), start=1))

    return worker.call(read())


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "after"])
def test_a_refused_append_takes_the_step_back_either_way(start_worker, served_models, ahead):
    """A closed session's append is refused: with the log ahead as after, the step is
    answered with the error, and nothing of it is in the log."""
    _model, x, worker, sid = _log_session(start_worker, served_models, 3, 1903, 2, ahead)
    session = worker.manager.resident(sid)

    async def close_in_redis_then_step():
        keys = worker.store.keys(sid)
        await worker.store.redis.hset(keys.meta, "closed", "1")
        return await _step(worker.intake, sid, 3, x[2])

    outcome = worker.call(close_in_redis_then_step())
    assert outcome.error is not None and outcome.output is None
    assert "closed" in str(outcome.error)
    assert session.step == 2
    assert sorted(_logged_upto(worker, sid, 2)) == [1, 2]
    with pytest.raises(Exception, match="lacks steps 3"):
        _logged_upto(worker, sid, 3)


def test_a_step_is_computed_before_its_append_replies_and_answered_only_after(
    start_worker, served_models
):
    """The overlap, and durable before acknowledged: with the append held up, the step
    is already applied in memory, yet not answered until the append's reply."""
    model, x, worker, sid = _log_session(start_worker, served_models, 1, 1905, 0)
    session = worker.manager.resident(sid)
    store = worker.store
    append = store.append_logs

    async def held_step():
        gate = asyncio.Event()

        async def held(appends, updated_at):
            await gate.wait()
            return await append(appends, updated_at)

        store.append_logs = held
        try:
            future = await worker.intake.submit(sid, 1, x[0])
            await asyncio.sleep(0.2)
            computed, answered = session.step, future.done()
            gate.set()
            return computed, answered, await asyncio.wait_for(future, 10)
        finally:
            store.append_logs = append

    computed, answered, outcome = worker.call(held_step())
    assert computed == 1 and not answered
    assert outcome.error is None
    assert_bit_equal(outcome.output, reference(model, x)[0])
    assert sorted(_logged_upto(worker, sid, 1)) == [1]


def test_an_unknown_append_outcome_then_an_engine_failure_reloads_the_session(
    start_worker, served_models
):
    """The append sent ahead came back as an unknown outcome (Redis may hold the step),
    then the engine call raised: the session must leave memory even though its append
    did not succeed, and the resend is answered right after a reload."""
    from ssmserve.server.state.store_errors import StoreOutcomeUnknownError

    model, x, worker, sid = _log_session(start_worker, served_models, 4, 1906, 3)
    session = worker.manager.resident(sid)
    store, lane = worker.store, worker.engine("demo")
    append = store.append_logs
    step = lane.step

    async def unknown(appends, updated_at):
        return [StoreOutcomeUnknownError("injected: no answer")] * len(appends)

    async def fails(states, values):
        await asyncio.sleep(0.05)  # the append's reply is in by now
        raise RuntimeError("injected engine failure")

    store.append_logs, lane.step = unknown, fails
    try:
        failed = worker.call(_step(worker.intake, sid, 4, x[3]))
    finally:
        store.append_logs, lane.step = append, step
    assert failed.error is not None and failed.output is None
    assert worker.manager.resident(sid) is not session  # left memory
    again = worker.call(_step(worker.intake, sid, 4, x[3]))
    assert again.error is None
    assert_bit_equal(again.output, reference(model, x)[3])
