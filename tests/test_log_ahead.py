"""Log ahead (``sessions/log_ahead.py``): a batch's log appends go to Redis before its
engine call and are answered after; what the log and the answers hold must not change,
and a step logged ahead but not applied must not leave memory and Redis apart."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.log_ahead import LogAhead
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.server.sessions.session import SessionGoneError, StepOutcome
from ssmserve.server.sessions.stepper import StepperSettings
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.harness import next_engine_call
from tests.test_service import assert_bit_equal, reference

STEPS = 40


def _log_ahead_settings(on: bool) -> ManagerSettings:
    return ManagerSettings(stepper=StepperSettings(log_ahead=on))


async def _step(manager, sid: str, step: int, value: np.ndarray) -> StepOutcome:
    return await asyncio.wait_for(await manager.intake.submit(sid, step, value), 10)


def _log_session(
    start_worker, served_models, steps: int, seed: int, stepped: int, on: bool = True, **config
):
    """A worker with log ahead ``on``, a log-durability demo session stepped through its
    first ``stepped`` of ``steps`` random inputs: (model, inputs, worker, session id)."""
    model = served_models["demo"]
    x = random_inputs(model, steps, seed=seed)
    worker = start_worker(manager=_log_ahead_settings(on))
    sid = worker.client.create_session("demo", durability=pb.DURABILITY_LOG, **config).session_id
    for t in range(1, stepped + 1):
        assert worker.call(_step(worker.manager, sid, t, x[t - 1])).error is None
    return model, x, worker, sid


async def _drive(manager, sid: str, x: np.ndarray, output_dim: int) -> np.ndarray:
    """Steps 1..STEPS in every shape a batch takes: lone steps (logged ahead), eight
    queued singles (one batch of eight ticks: all eight logged ahead of the first), a run
    of 16 cut by snapshots at steps 16 and 24 (its first chunk ahead, the other two in the
    group commit after), lone steps again. Returns the outputs ``(STEPS, o)``."""
    out = np.empty((STEPS, output_dim), np.float32)
    for t in range(1, 4):
        out[t - 1] = (await _step(manager, sid, t, x[t - 1])).output
    futures = [manager.intake.submit_resident(sid, t, x[t - 1], True) for t in range(4, 12)]
    for t, outcome in zip(range(4, 12), await asyncio.gather(*futures), strict=True):
        assert outcome.error is None, outcome.error
        out[t - 1] = outcome.output
    run_future = manager.intake.submit_run_resident(sid, 12, x[11:27])
    assert run_future is not None
    run = await asyncio.wait_for(run_future, 10)
    assert all(o is None or o.error is None for o in run.outcomes)
    out[11:27] = run.outputs
    for t in range(28, STEPS + 1):
        out[t - 1] = (await _step(manager, sid, t, x[t - 1])).output
    return out


def _logged(worker, sid: str) -> dict[int, bytes]:
    async def read() -> dict[int, bytes]:
        raw = await worker.manager.store.read_log(sid, 1, STEPS)
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
    for on in (True, False):
        worker = start_worker(manager=_log_ahead_settings(on))
        sid = worker.client.create_session(
            "demo", durability=pb.DURABILITY_LOG, snapshot_every=8, snapshot_phase=0
        ).session_id
        sent_ahead.clear()
        outputs = worker.call(_drive(worker.manager, sid, x, model.config.output_dim))
        assert_bit_equal(outputs, reference(model, x))
        logs[on] = _logged(worker, sid)
        ahead_counts[on] = list(sent_ahead)
        assert worker.client.get_session(sid).step == STEPS
    assert logs[True] == logs[False]
    assert len(logs[True]) == STEPS
    # Ahead: the lone steps, the 8 queued singles, the first chunk of the run (12..16, up
    # to the snapshot); the run's other 11 steps in the group commit.
    assert ahead_counts[True] == [1] * 3 + [8] + [5] + [1] * 13
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
    manager = worker.manager
    session = manager.residents.get(sid)
    assert session.config.durability == Durability.LOG

    async def fails(step, states, values):
        await asyncio.sleep(0.05)  # the append sent ahead reaches Redis meanwhile
        raise RuntimeError("injected engine failure")

    with next_engine_call(manager.lanes.engines["demo"], fails):
        failed = worker.call(_step(manager, sid, 4, x[3]))
    assert isinstance(failed.error, SessionGoneError), failed.error
    assert "injected engine failure" in str(failed.error)
    assert manager.residents.by_id.get(sid) is not session  # left memory
    assert sorted(_logged_upto(worker, sid, 4)) == [1, 2, 3, 4]  # Redis kept step 4
    outputs = [worker.call(_step(manager, sid, t, x[t - 1])) for t in (4, 5, 6)]
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
    manager = worker.manager

    async def cancelled(step, states, values):
        raise asyncio.CancelledError  # as awaiting a task someone else cancelled

    with next_engine_call(manager.lanes.engines["demo"], cancelled):
        failed = worker.call(_step(manager, sid, 4, x[3]))
    assert isinstance(failed.error, SessionGoneError), failed.error
    assert "CancelledError" in str(failed.error)
    outputs = [worker.call(_step(manager, sid, t, x[t - 1])) for t in (4, 5, 6)]  # bounded
    assert [o.error for o in outputs] == [None, None, None]
    expected = reference(model, x)
    for t, o in zip((4, 5, 6), outputs, strict=True):
        assert_bit_equal(o.output, expected[t - 1])
    task = manager.steppers["demo"]._task
    assert task is not None and not task.done()


def _logged_upto(worker, sid: str, last: int) -> dict[int, bytes]:
    async def read() -> dict[int, bytes]:
        return dict(enumerate(await worker.manager.store.read_log(sid, 1, last), start=1))

    return worker.call(read())


@pytest.mark.parametrize("on", [True, False])
def test_a_refused_append_takes_the_step_back_either_way(start_worker, served_models, on):
    """A closed session's append is refused: with the log ahead as after, the step is
    answered with the error, and nothing of it is in the log."""
    _model, x, worker, sid = _log_session(start_worker, served_models, 3, 1903, 2, on)
    manager = worker.manager
    session = manager.residents.get(sid)

    async def close_in_redis_then_step():
        keys = manager.store.keys(sid)
        await manager.store.redis.hset(keys.meta, "closed", "1")
        return await _step(manager, sid, 3, x[2])

    outcome = worker.call(close_in_redis_then_step())
    assert outcome.error is not None and outcome.output is None
    assert "closed" in str(outcome.error)
    assert session.step == 2
    assert sorted(_logged_upto(worker, sid, 2)) == [1, 2]
    with pytest.raises(Exception, match="lacks steps 3"):
        _logged_upto(worker, sid, 3)


def test_a_queued_step_logged_ahead_that_leaves_the_queue_reloads_the_session(
    start_worker, served_models, monkeypatch
):
    """Queued single steps go to the log ahead with the first of them, as the batch's
    later ticks will apply them. Should one leave the queue before its tick (nothing in
    the server does that today but dropping the session), memory ends behind the log:
    the session leaves memory, the steps it applied are answered, and the one that left
    is answered on its resend from the log."""
    model, x, worker, sid = _log_session(start_worker, served_models, 7, 1904, 2)
    manager = worker.manager
    session = manager.residents.get(sid)
    send = LogAhead.send
    taken_out = SessionGoneError("taken out of the queue by the test")

    async def send_then_take_one_out(self, blocks):
        await send(self, blocks)
        for s, block in blocks:
            if block.count > 1:  # the queued singles: the last leaves the queue
                last = list(s.queue)[-1]
                s.queue.remove(last)
                s.queued_steps -= 1
                last.future.set_result(StepOutcome(s.id, last.step, error=taken_out))

    monkeypatch.setattr(LogAhead, "send", send_then_take_one_out)

    async def queue_four():
        futures = [manager.intake.submit_resident(sid, t, x[t - 1], True) for t in (3, 4, 5, 6)]
        return await asyncio.wait_for(asyncio.gather(*futures), 10)

    outcomes = worker.call(queue_four())
    monkeypatch.setattr(LogAhead, "send", send)
    assert [o.error for o in outcomes] == [None, None, None, taken_out]
    expected = reference(model, x)
    for t, o in zip((3, 4, 5), outcomes[:3], strict=True):
        assert_bit_equal(o.output, expected[t - 1])
    assert manager.residents.by_id.get(sid) is not session  # left memory
    assert sorted(_logged_upto(worker, sid, 6)) == [1, 2, 3, 4, 5, 6]
    resent, nxt = (worker.call(_step(manager, sid, t, x[t - 1])) for t in (6, 7))
    assert resent.error is None and resent.replayed
    assert nxt.error is None and not nxt.replayed
    assert_bit_equal(resent.output, expected[5])
    assert_bit_equal(nxt.output, expected[6])


def test_a_step_is_computed_before_its_append_replies_and_answered_only_after(
    start_worker, served_models
):
    """The overlap, and durable before acknowledged: with the append held up, the step
    is already applied in memory, yet not answered until the append's reply."""
    model, x, worker, sid = _log_session(start_worker, served_models, 1, 1905, 0)
    manager = worker.manager
    session = manager.residents.get(sid)
    append = manager.store.append_logs

    async def held_step():
        gate = asyncio.Event()

        async def held(appends, updated_at):
            await gate.wait()
            return await append(appends, updated_at)

        manager.store.append_logs = held
        try:
            future = await manager.intake.submit(sid, 1, x[0])
            await asyncio.sleep(0.2)
            computed, answered = session.step, future.done()
            gate.set()
            return computed, answered, await asyncio.wait_for(future, 10)
        finally:
            manager.store.append_logs = append

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
    manager = worker.manager
    session = manager.residents.get(sid)
    append, lane = manager.store.append_logs, manager.lanes.engines["demo"]
    step = lane.step

    async def unknown(appends, updated_at):
        return [StoreOutcomeUnknownError("injected: no answer")] * len(appends)

    async def fails(states, values):
        await asyncio.sleep(0.05)  # the append's reply is in by now
        raise RuntimeError("injected engine failure")

    manager.store.append_logs, lane.step = unknown, fails
    try:
        failed = worker.call(_step(manager, sid, 4, x[3]))
    finally:
        manager.store.append_logs, lane.step = append, step
    assert failed.error is not None and failed.output is None
    assert manager.residents.by_id.get(sid) is not session  # left memory
    again = worker.call(_step(manager, sid, 4, x[3]))
    assert again.error is None
    assert_bit_equal(again.output, reference(model, x)[3])


def test_a_group_commit_refused_after_an_append_ahead_of_the_same_session_reloads_it(
    start_worker, served_models
):
    """A run cut by a snapshot: its first chunk goes ahead (accepted), its later chunks
    in the group commit (refused here). Memory gives back the whole batch while Redis
    holds the first chunk: the session leaves memory; resent, the first chunk's steps
    are answered from the log and the rest computed, all bit-exact."""
    from ssmserve.server.state.store_errors import StoreError

    model, x, worker, sid = _log_session(
        start_worker, served_models, 16, 1907, 4, snapshot_every=8, snapshot_phase=0
    )
    manager = worker.manager
    session = manager.residents.get(sid)
    append = manager.store.append_logs

    async def refuse_later_chunks(appends, updated_at):
        if appends[0][1].first == 5:  # the first chunk, 5..8, sent ahead
            return await append(appends, updated_at)
        return [StoreError("injected refusal")] * len(appends)

    async def run(first: int, last: int):
        future = manager.intake.submit_run_resident(sid, first, x[first - 1 : last])
        assert future is not None
        return await asyncio.wait_for(future, 10)

    manager.store.append_logs = refuse_later_chunks
    try:
        refused = worker.call(run(5, 12))
    finally:
        manager.store.append_logs = append
    assert all(o is not None and o.error is not None for o in refused.outcomes)
    assert manager.residents.by_id.get(sid) is not session  # left memory
    assert sorted(_logged_upto(worker, sid, 8)) == list(range(1, 9))
    outcomes = [worker.call(_step(manager, sid, t, x[t - 1])) for t in range(5, 13)]
    assert [o.error for o in outcomes] == [None] * 8
    assert [o.replayed for o in outcomes] == [True] * 4 + [False] * 4
    expected = reference(model, x)
    for t, o in zip(range(5, 13), outcomes, strict=True):
        assert_bit_equal(o.output, expected[t - 1])
