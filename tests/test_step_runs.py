"""Steps of one session sent together (``StepRun``): a message's consecutive steps of a
session are queued as one run and stepped in chunks. Every answer must be what the same
steps sent one per message get, bit for bit: outputs, snapshots at their steps, resends,
gaps, guards, errors. A real worker on a real redis-server.
"""

from __future__ import annotations

import numpy as np
import pytest

from ssmserve.client.aio import step_input
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.test_service import assert_bit_equal, reference, stream, stub


def send(worker, sid, first, values, packed=True):
    """One message: ``values`` as steps ``first, first + 1, ...`` of ``sid``."""
    steps = [step_input(sid, first + k, v, packed=packed) for k, v in enumerate(values)]
    (response,) = stub(worker).Stream(iter([pb.StreamRequest(steps=steps, packed_outputs=True)]))
    return list(response.results)


def outputs(results):
    return np.stack([np.frombuffer(r.output.packed, "<f4") for r in results])


def queued_steps(worker) -> int:
    return sum(worker.manager.resident_counts().queued_steps.values())


@pytest.mark.parametrize("packed", [True, False])
def test_a_run_with_snapshots_due_inside_it_equals_single_steps(worker, served_models, packed):
    """Runs of 8 steps; a periodic snapshot every 5 steps at phase 3 falls inside most of
    them. Each snapshot kept is of its own step, and a rollback to it continues exactly."""
    model = served_models["demo"]
    x = random_inputs(model, 40, seed=11)
    sid = worker.client.create_session("demo", snapshot_every=5, snapshot_phase=3).session_id
    got = []
    for first in range(1, 41, 8):
        results = send(worker, sid, first, x[first - 1 : first + 7], packed)
        assert [r.step for r in results] == list(range(first, first + 8))
        assert not any(r.HasField("error") for r in results)
        got.append(outputs(results))
    want = reference(model, x)
    assert_bit_equal(np.concatenate(got), want)
    assert worker.client.get_session(sid).step == 40
    assert queued_steps(worker) == 0
    snapshots = {s.step for s in worker.client.list_snapshots(sid)} - {0}  # 0: creation
    periodic = [s for s in range(1, 41) if s % 5 == 3]
    # A due write that finds MAX_WAITING others waiting supersedes the oldest of them, by
    # design (replay still reaches its step): under CPU load the writes fall behind the runs.
    # The newest is always written, and the writer counts each one it dropped.
    writer = worker.manager.resident(sid).snapshots
    assert snapshots <= set(periodic) and max(snapshots) == periodic[-1] and len(snapshots) >= 3
    assert len(snapshots) + writer.superseded == len(periodic), (snapshots, writer.superseded)
    for step in sorted(snapshots)[-2:]:
        assert worker.client.rollback(sid, to_step=step).replayed_steps == 0  # of its step
        again, _ = stream(worker, sid, x[step:], first_step=step + 1, per_message=8)
        assert_bit_equal(again, want[step:])


@pytest.mark.parametrize("name", ["demo", "lm"])
def test_a_run_that_overlaps_applied_steps_answers_them_as_resends(worker, served_models, name):
    """The run is split into single steps (token ids or vectors): the resends answer
    their recorded outputs, the new steps step."""
    model = served_models[name]
    x = random_inputs(model, 16, seed=12)
    if model.config.is_token_model:
        x = [int(t) for t in x]
    sid = worker.client.create_session(name).session_id
    first = outputs(send(worker, sid, 1, x[:8]))
    results = send(worker, sid, 5, x[4:12])  # 5..8 were applied, 9..12 are new
    assert [r.replayed for r in results] == [True] * 4 + [False] * 4
    assert_bit_equal(outputs(results[:4]), first[4:8])
    assert_bit_equal(outputs(results), reference(model, np.asarray(x[:12]))[4:12])
    assert worker.client.get_session(sid).step == 12
    assert queued_steps(worker) == 0


def test_a_run_past_the_next_step_changes_nothing(worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 20, seed=13)
    sid = worker.client.create_session("demo").session_id
    send(worker, sid, 1, x[:4])
    results = send(worker, sid, 7, x[6:14])
    assert [r.error.reason for r in results] == ["STEP_GAP"] * 8
    assert worker.client.get_session(sid).step == 4
    results = send(worker, sid, 5, x[4:12])  # the session goes on as if nothing came
    assert_bit_equal(outputs(results), reference(model, x[:12])[4:12])
    assert queued_steps(worker) == 0


def test_a_guard_that_rejects_inside_a_run_stops_the_run_there(worker, served_models):
    """A session with guards goes step by step: the rejected step is not applied, and
    the steps after it in the run skip ahead of the session (STEP_GAP), exactly as
    single steps would."""
    model = served_models["demo"]
    x = random_inputs(model, 8, seed=14)
    want = reference(model, x)
    # The first step from the third on whose dim 0 exceeds all before it: a guard with that
    # bound passes every earlier step and rejects this one.
    k = next(t for t in range(2, 8) if want[t, 0] > want[:t, 0].max())
    bound = float(want[:k, 0].max())
    rule = pb.GuardRule(
        name="cap", check=pb.GuardRule.CHECK_RANGE, max=bound, dims=[0],
        action=pb.GuardRule.ACTION_REJECT,
    )  # fmt: skip
    sid = worker.client.create_session("demo", guards=[rule]).session_id
    results = send(worker, sid, 1, x)
    assert not any(r.HasField("error") for r in results[:k])
    assert_bit_equal(outputs(results[:k]), want[:k])
    assert results[k].error.reason == "GUARD_REJECTED"
    assert [r.error.reason for r in results[k + 1 :]] == ["STEP_GAP"] * (7 - k)
    assert worker.client.get_session(sid).step == k
    assert queued_steps(worker) == 0


def test_runs_and_single_steps_of_many_sessions_answer_in_message_order(worker, served_models):
    """One message: a run of A, a single step of B, a run of B, a run of C whose inputs
    are of the wrong width (each of its steps is checked alone and refused), tokens for a
    signal model."""
    model = served_models["demo"]
    x = random_inputs(model, 8, seed=15)
    a, b, c, d = (worker.client.create_session("demo").session_id for _ in range(4))
    narrow = np.zeros(model.config.input_dim - 1, np.float32)
    steps = (
        [step_input(a, 1 + k, x[k], packed=True) for k in range(4)]
        + [step_input(b, 1, x[0], packed=True)]
        + [step_input(b, 2 + k, x[1 + k], packed=True) for k in range(3)]
        + [step_input(c, 1 + k, narrow, packed=True) for k in range(3)]
        + [step_input(d, 1 + k, k) for k in range(2)]
    )
    (response,) = stub(worker).Stream(iter([pb.StreamRequest(steps=steps, packed_outputs=True)]))
    results = list(response.results)
    assert [(r.session_id, r.step) for r in results] == [(s.session_id, s.step) for s in steps]
    want = reference(model, x[:4])
    assert_bit_equal(outputs(results[:4]), want)
    assert_bit_equal(outputs(results[4:8]), want)
    assert [r.error.reason for r in results[8:]] == ["BAD_STEP_INPUT"] * 5
    assert [worker.client.get_session(s).step for s in (a, b, c, d)] == [4, 4, 0, 0]
    assert queued_steps(worker) == 0


def test_an_answered_run_is_freed_by_reference_counting_alone() -> None:
    """A run resolves its future with itself; if it kept holding that future, the two
    would form a cycle that only the cyclic collector frees, and a worker tuned to
    collect rarely kept thousands of answered runs (and their outputs) while idle."""
    import asyncio
    import gc
    import weakref

    from ssmserve.server.sessions.session import StepRun

    async def scenario() -> None:
        future: asyncio.Future[StepRun] = asyncio.get_running_loop().create_future()
        run = StepRun("s", 1, np.zeros((3, 4), np.float32), b"\0" * 48, 2, future)
        run.answer(0, 2)
        assert not future.done()
        run.answer(2, 3)
        assert future.result() is run
        gone = weakref.ref(future)
        del future, run
        assert gone() is None

    enabled = gc.isenabled()
    gc.disable()
    try:
        asyncio.run(scenario())
    finally:
        if enabled:
            gc.enable()
