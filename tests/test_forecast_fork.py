"""Forecast and Fork end to end: a real worker on a real redis-server, compared bit for bit
with the offline engine and with sessions stepped through the real stream."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from ssmserve.client.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SsmserveClientError,
)
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.sessions.forecaster import (
    Forecaster,
    ForecastJob,
    ForecastSettings,
    OutputNotFiniteError,
    feedback,
)
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.server.state.checkpoint import Checkpoint, InputHistory
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.harness import next_engine_call
from tests.test_service import as_inputs, assert_bit_equal, reference, stream


def offline_forecast(model, x, horizon, at=None):
    """Step the offline engine through ``x[:at]``, then ``horizon`` steps on its own outputs."""
    x = x if at is None else x[:at]
    outs, state = model.run(x)
    out, result = outs[-1], []
    for _ in range(horizon):
        fed = np.array([np.argmax(out)]) if model.config.is_token_model else out[None]
        o, state = model.run(fed, state)
        out = o[0]
        result.append(out)
    return np.stack(result)


def step_copy_with_own_outputs(worker, sid, first_output, horizon, token):
    """What the contract compares a forecast with: a session fed its own answers."""
    out, got = first_output, []
    for _ in range(horizon):
        fed = int(np.argmax(out)) if token else out
        (answer,) = worker.client.stream_steps(sid, [fed])
        out = answer.output
        got.append(out)
    return np.stack(got)


def session_keys(url, sid):
    """Every Redis key of a session with its DUMP: equal dumps, equal values."""
    with redis.Redis.from_url(url) as conn:
        return {k: conn.dump(k) for k in sorted(conn.scan_iter(f"*{{{sid}}}*"))}


# ---------------------------------------------------------------------------- forecast


@pytest.mark.parametrize("name", ["demo", "lm"])
def test_forecast_equals_the_engine_fed_its_own_outputs(worker, served_models, name):
    model = served_models[name]
    x = random_inputs(model, 20, seed=2)
    sid = worker.client.create_session(name, snapshot_every=8).session_id
    stream(worker, sid, as_inputs(model, x))
    fc = worker.client.forecast(sid, 12)
    assert fc.from_step == 20 and fc.stopped is None
    assert list(fc.steps) == list(range(21, 33))
    assert_bit_equal(fc.outputs, offline_forecast(model, x, 12))
    if model.config.is_token_model:
        np.testing.assert_array_equal(fc.tokens, np.argmax(fc.outputs, axis=1))
    else:
        assert fc.tokens is None


def test_a_forecast_whose_engine_call_is_cancelled_by_someone_else_fails_alone(
    worker, served_models, caplog
):
    """A task a forecast tick awaits is cancelled (not the forecaster): that tick fails
    like any other (its forecast ends with a retryable error, which the client retries)
    and the model's forecaster keeps running, so the retry is answered."""
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=4)
    sid = worker.client.create_session("demo").session_id
    stream(worker, sid, as_inputs(model, x))

    async def cancelled(step, states, values):
        raise asyncio.CancelledError  # as awaiting a task someone else cancelled

    with next_engine_call(worker.engine("demo"), cancelled):
        fc = worker.client.forecast(sid, 5)  # the client's stall bound bounds a hang
    assert "forecast tick failed" in caplog.text and "CancelledError" in caplog.text
    assert fc.stopped is None
    assert_bit_equal(fc.outputs, offline_forecast(model, x, 5))
    task = worker.forecaster("demo")._task
    assert task is not None and not task.done()


def test_a_forecast_that_stops_sending_is_given_up_within_the_stall_bound(worker, served_models):
    """The worker's forecaster hangs mid-forecast on a live connection (keepalive sees
    nothing wrong). The client does not wait forever: no reply within the policy's
    ``stall_timeout_s`` cancels the call, it is retried, and the client gives up after
    ``give_up_after_s`` with a clear error. Once the forecaster moves again, forecasts
    are answered."""
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=5)
    sid = worker.client.create_session("demo").session_id
    stream(worker, sid, as_inputs(model, x))
    release = threading.Event()

    async def hung(step, states, values):
        while not release.is_set():
            await asyncio.sleep(0.01)
        return await step(states, values)

    policy = RetryPolicy(stall_timeout_s=0.3, give_up_after_s=1.0)
    try:
        with (
            next_engine_call(worker.engine("demo"), hung),
            Client(worker.address, retry=policy) as client,
        ):
            started = time.monotonic()
            with pytest.raises(SsmserveClientError, match=r"no reply for 0\.3 s"):
                client.forecast(sid, 5)
            assert time.monotonic() - started < 20  # bound: a hang would be the bug
    finally:
        release.set()
    fc = worker.client.forecast(sid, 5)
    assert_bit_equal(fc.outputs, offline_forecast(model, x, 5))


@pytest.mark.parametrize("at", [7, 10, 16, 20])
def test_forecast_from_an_earlier_step_is_reached_as_rollback_would(
    start_worker, served_models, at
):
    # A window of 2 outputs: steps 7, 10, 16 are not in memory, so the output that seeds
    # the forecast is recomputed by replay (10 and 16 are snapshot steps).
    w = start_worker(manager=ManagerSettings(output_window=2))
    model = served_models["demo"]
    x = random_inputs(model, 20, seed=3)
    sid = w.client.create_session("demo", snapshot_every=5).session_id
    stream(w, sid, as_inputs(model, x))
    fc = w.client.forecast(sid, 9, at_step=at)
    assert fc.from_step == at
    assert_bit_equal(fc.outputs, offline_forecast(model, x, 9, at=at))


def test_forecast_leaves_the_session_bit_identical(worker, served_models, redis_url):
    model = served_models["demo"]
    x = random_inputs(model, 30, seed=4)
    sid = worker.client.create_session("demo", snapshot_every=4, max_snapshots=16).session_id
    stream(worker, sid, as_inputs(model, x[:18]))
    worker.client.snapshot(sid, label="mark")
    resident = worker.manager.resident(sid)
    state_before, step_before = resident.state.copy(), resident.step
    info_before = worker.client.get_session(sid)
    snaps_before = worker.client.list_snapshots(sid)
    keys_before = session_keys(redis_url, sid)
    assert keys_before  # the session's meta, log, snapshots, labels, lease

    for at in (None, 9, 8, 1):
        worker.client.forecast(sid, 16, at_step=at)

    assert resident.state.bit_equal(state_before) and resident.step == step_before
    assert worker.client.get_session(sid) == info_before  # step, counts, updated_at, ...
    assert worker.client.list_snapshots(sid) == snaps_before
    assert session_keys(redis_url, sid) == keys_before
    # and it goes on exactly as if no forecast had run
    got, _ = stream(worker, sid, as_inputs(model, x[18:]))
    assert_bit_equal(got, reference(model, x)[18:])


def test_forecast_equals_a_copy_stepped_with_its_answers_guards_included(worker, served_models):
    # CLAMP clips what is returned, and that clipped output is what gets fed back.
    model = served_models["demo"]
    clamp = pb.GuardRule(
        name="clip", check=pb.GuardRule.CHECK_RANGE, min=-0.05, max=0.05,
        action=pb.GuardRule.ACTION_CLAMP,
    )  # fmt: skip
    sid = worker.client.create_session("demo", snapshot_every=6, guards=[clamp]).session_id
    _, answers = stream(worker, sid, as_inputs(model, random_inputs(model, 13, seed=5)))
    fc = worker.client.forecast(sid, 10)
    assert fc.guard_events and all(e.guard == "clip" for e in fc.guard_events)
    assert np.abs(fc.outputs).max() <= 0.05
    copy = worker.client.fork(sid).session.session_id
    assert_bit_equal(
        fc.outputs, step_copy_with_own_outputs(worker, copy, answers[-1].output, 10, False)
    )


def test_token_forecast_equals_a_copy_fed_its_argmax_tokens(worker, served_models):
    model = served_models["lm"]
    sid = worker.client.create_session("lm", snapshot_every=5).session_id
    _, answers = stream(worker, sid, as_inputs(model, random_inputs(model, 9, seed=6)))
    fc = worker.client.forecast(sid, 8, at_step=6)
    copy = worker.client.fork(sid, at_step=6).session.session_id
    assert_bit_equal(
        fc.outputs, step_copy_with_own_outputs(worker, copy, answers[5].output, 8, True)
    )


def test_a_guard_that_would_reject_ends_the_forecast_there(worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=7)
    ref = offline_forecast(model, x, 30)
    # REJECT outside the box the first 3 forecast outputs span, one rule per dim
    lo, hi = ref[:3].min(axis=0), ref[:3].max(axis=0)
    outside = ((ref < lo) | (ref > hi)).any(axis=1)
    assert outside.any(), "pick another seed: the forecast never leaves the box"
    first_bad = int(np.argmax(outside))
    assert first_bad == 3
    rules = [
        pb.GuardRule(
            name=f"box{d}", check=pb.GuardRule.CHECK_RANGE, min=float(lo[d]), max=float(hi[d]),
            dims=[d], action=pb.GuardRule.ACTION_REJECT,
        )
        for d in range(model.config.output_dim)
    ]  # fmt: skip
    # the history is streamed unguarded, then the session comes back with the rules
    plain = worker.client.create_session("demo").session_id
    stream(worker, plain, as_inputs(model, x))
    blob = worker.client.export_checkpoint(plain)
    sid = worker.client.import_checkpoint(
        blob, "guarded", config=pb.SessionConfig(guards=rules)
    ).session_id
    fc = worker.client.forecast(sid, 30)
    assert fc.stopped is not None and fc.stopped.reason == "GUARD_REJECTED"
    assert fc.stopped.code == 9  # FAILED_PRECONDITION, as a rejected step would be
    assert "step 14" in fc.stopped.message
    assert_bit_equal(fc.outputs, ref[:first_bad])
    assert [e.step for e in fc.guard_events] and {e.step for e in fc.guard_events} == {14}
    assert worker.client.get_session(sid).step == 10


def test_forecast_errors_are_clear_and_change_nothing(start_worker, served_models):
    limits = ForecastSettings(max_horizon=64, max_output_bytes=37 * 4 * 20)
    w = start_worker(manager=ManagerSettings(forecast=limits))
    model = served_models["demo"]
    demo = w.client.create_session("demo", snapshot_every=4, max_snapshots=2).session_id
    stream(w, demo, as_inputs(model, random_inputs(model, 12, seed=8)))
    odd = w.client.create_session("odd").session_id
    lm = w.client.create_session("lm").session_id
    fresh = w.client.create_session("demo").session_id

    with pytest.raises(InvalidArgument, match="at least 1"):
        w.client.forecast(demo, 0)
    with pytest.raises(ResourceExhausted, match="limit of 64"):
        w.client.forecast(demo, 65)
    with pytest.raises(InvalidArgument, match="5 input values to 3 output"):
        w.client.forecast(odd, 4)
    with pytest.raises(ResourceExhausted, match="at most 20 steps"):
        w.client.forecast(lm, 21)
    with pytest.raises(FailedPrecondition, match="at step 13: it is at step 12"):
        w.client.forecast(demo, 4, at_step=13)
    with pytest.raises(FailedPrecondition, match="oldest kept snapshot is at step 8"):
        w.client.forecast(demo, 4, at_step=3)
    with pytest.raises(FailedPrecondition, match="no output yet"):
        w.client.forecast(fresh, 4)
    with pytest.raises(NotFound, match="does not exist"):
        w.client.forecast("nobody", 4)
    assert w.client.get_session(demo).step == 12
    assert len(w.client.forecast(demo, 64).outputs) == 64  # the limit itself is fine


def test_forecasts_of_many_sessions_share_engine_calls(demo_model):
    """Submitted together, three forecasts run as one batch: ticks = the longest horizon."""

    async def run() -> tuple[list[np.ndarray], int]:
        lane = EngineLane(demo_model, offload_min_flop=float("inf"))
        forecaster = Forecaster(demo_model, lane, ForecastSettings())
        x = [random_inputs(demo_model, 5, seed=s) for s in range(3)]
        jobs = []
        for i, horizon in enumerate((4, 9, 6)):
            outs, state = demo_model.run(x[i])
            jobs.append(ForecastJob(f"s{i}", (), 5, horizon, state, outs[-1]))
            forecaster.submit(jobs[-1])
        forecaster.start()
        got = []
        for job in jobs:
            steps = [item async for batch in job.batches(1 << 20) for item in batch]
            got.append(np.stack([item.output for item in steps]))
        await forecaster.stop()
        lane.shutdown()
        for i, horizon in enumerate((4, 9, 6)):
            assert_bit_equal(got[i], offline_forecast(demo_model, x[i], horizon))
        return got, forecaster.ticks

    _, ticks = asyncio.run(run())
    assert ticks == 9


def test_concurrent_forecasts_through_the_service(worker, served_models):
    model = served_models["demo"]
    xs = [random_inputs(model, 6, seed=30 + i) for i in range(4)]
    sids = []
    for x in xs:
        sids.append(worker.client.create_session("demo").session_id)
        stream(worker, sids[-1], as_inputs(model, x))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda sid: worker.client.forecast(sid, 40), sids))
    for x, fc in zip(xs, results, strict=True):
        assert_bit_equal(fc.outputs, offline_forecast(model, x, 40))


def test_an_output_with_nan_is_not_fed_back(demo_model):
    with pytest.raises(OutputNotFiniteError, match="step 7 contains NaN or Inf"):
        feedback(demo_model, 7, np.array([0, np.nan, 0, 0], np.float32))


# ---------------------------------------------------------------------------- fork


def fork_fixture(worker, model, sid_config=None):
    """A source at step 20 (snapshots every 5, a labelled one at 12) and its inputs."""
    x = random_inputs(model, 20, seed=9)
    sid = worker.client.create_session(model.name, snapshot_every=5, **(sid_config or {}))
    sid = sid.session_id
    stream(worker, sid, as_inputs(model, x[:12]))
    worker.client.snapshot(sid, label="mark")
    stream(worker, sid, as_inputs(model, x[12:]))
    return sid, x


@pytest.mark.parametrize("how", ["step", "snapshot", "label", "now"])
@pytest.mark.parametrize("name", ["demo", "lm"])
def test_fork_continues_exactly_like_the_source_would(worker, served_models, how, name):
    model = served_models[name]
    sid, x = fork_fixture(worker, model)
    if how == "step":
        reply, at = worker.client.fork(sid, at_step=9), 9
        assert reply.replayed_steps == 4 and reply.from_snapshot_id.startswith("000000000005")
    elif how == "snapshot":
        snap = next(s for s in worker.client.list_snapshots(sid) if s.step == 15)
        reply, at = worker.client.fork(sid, at_snapshot=snap.snapshot_id), 15
        assert reply.replayed_steps == 0 and reply.from_snapshot_id == snap.snapshot_id
    elif how == "label":
        reply, at = worker.client.fork(sid, at_label="mark"), 12
    else:
        reply, at = worker.client.fork(sid), 20
        assert reply.from_snapshot_id == ""
    fork = reply.session
    assert reply.step == at and fork.step == at and fork.session_id != sid
    assert reply.source_session_id == sid and fork.oldest_rollback_step == at
    y = random_inputs(model, 10, seed=10)
    got, outs = stream(worker, fork.session_id, as_inputs(model, y))
    assert [o.step for o in outs] == list(range(at + 1, at + 11))
    assert_bit_equal(got, reference(model, np.concatenate([x[:at], y]))[at:])
    assert worker.client.get_session(sid).step == 20  # the source did not move
    # a forecast of the fork from its first step is the source's forecast from there
    assert_bit_equal(
        worker.client.forecast(sid, 5, at_step=at).outputs,
        worker.client.forecast(fork.session_id, 5, at_step=at).outputs,
    )


def test_forks_are_independent_under_rollback(worker, served_models):
    model = served_models["demo"]
    sid, x = fork_fixture(worker, model)
    fork = worker.client.fork(sid, at_step=10, new_session_id="branch").session.session_id
    assert fork == "branch"
    y = random_inputs(model, 10, seed=11)
    stream(worker, fork, as_inputs(model, y))  # fork at 20 on its own inputs
    stream(worker, sid, as_inputs(model, y[:5]))  # source at 25

    worker.client.rollback(sid, to_step=3)  # the source back to before the fork point
    got, _ = stream(worker, fork, as_inputs(model, y[:4]))
    assert_bit_equal(got, reference(model, np.concatenate([x[:10], y, y[:4]]))[20:])

    worker.client.rollback(fork, to_step=10)  # the fork back to its first snapshot
    with pytest.raises(FailedPrecondition, match="cannot reach step 9"):
        worker.client.rollback(fork, to_step=9)  # its history starts at the fork point
    got, _ = stream(worker, sid, as_inputs(model, x[3:8]))
    assert_bit_equal(got, reference(model, x[:8])[3:])
    got, _ = stream(worker, fork, as_inputs(model, x[10:14]))
    assert_bit_equal(got, reference(model, x[:14])[10:])


def test_fork_lands_on_another_worker_and_outlives_its_source(start_worker, served_models):
    a, b = start_worker(), start_worker()
    model = served_models["demo"]
    sid, x = fork_fixture(a, model, {"durability": pb.DURABILITY_SNAPSHOT})
    # asked at b: redirected to the source's owner a, which places the fork on b
    reply = b.client.fork(sid, at_step=17, target=b.address)
    fork = reply.session.session_id
    assert reply.session.owner == b.address and reply.step == 17
    assert fork in b.manager.resident_ids() and fork not in a.manager.resident_ids()
    # b loaded it from its first snapshot, which carries the output to forecast from
    assert_bit_equal(
        b.client.forecast(fork, 6).outputs, a.client.forecast(sid, 6, at_step=17).outputs
    )
    a.client.close_session(sid)
    y = random_inputs(model, 6, seed=12)
    got, _ = stream(b, fork, as_inputs(model, y))
    assert_bit_equal(got, reference(model, np.concatenate([x[:17], y]))[17:])
    assert b.client.rollback(fork, to_step=17).step == 17
    got, _ = stream(b, fork, as_inputs(model, x[17:]))
    assert_bit_equal(got, reference(model, x)[17:])


def test_fork_errors_are_clear_and_leave_nothing_behind(start_worker, served_models):
    a = start_worker()
    model = served_models["demo"]
    sid, _ = fork_fixture(a, model)
    before = sorted(s.session_id for s in a.client.list_sessions())
    with pytest.raises(NotFound, match="no snapshot 'nope'"):
        a.client.fork(sid, at_snapshot="nope")
    with pytest.raises(NotFound, match="labelled 'nope'"):
        a.client.fork(sid, at_label="nope")
    with pytest.raises(FailedPrecondition, match="at step 21: it is at step 20"):
        a.client.fork(sid, at_step=21)
    with pytest.raises(AlreadyExists):
        a.client.fork(sid, new_session_id=sid)
    with pytest.raises(InvalidArgument, match="session id"):
        a.client.fork(sid, new_session_id="bad id!")
    with pytest.raises(NotFound, match=r"no live worker is registered at '127\.0\.0\.1:1'"):
        a.client.fork(sid, new_session_id="orphan", target="127.0.0.1:1")
    with pytest.raises(NotFound, match="does not exist"):
        a.client.fork("nobody")
    assert sorted(s.session_id for s in a.client.list_sessions()) == before
    assert a.client.get_session(sid).step == 20


def test_a_checkpoint_without_its_output_cannot_seed_a_forecast_until_it_steps(
    worker, served_models
):
    model = served_models["demo"]
    x = random_inputs(model, 9, seed=13)
    _, state = model.run(x[:8])
    legacy = Checkpoint(
        "legacy", 8, "demo", model.fingerprint, state, InputHistory(8, x[7:8])
    )  # no output: as written before checkpoints carried it
    sid = worker.client.import_checkpoint(legacy.encode()).session_id
    with pytest.raises(FailedPrecondition, match=r"output of step 8 .* is not known"):
        worker.client.forecast(sid, 3)
    stream(worker, sid, as_inputs(model, x[8:]))
    assert_bit_equal(worker.client.forecast(sid, 3).outputs, offline_forecast(model, x, 3))


def test_too_many_forecasts_at_once_are_refused(start_worker, served_models):
    w = start_worker(manager=ManagerSettings(forecast=ForecastSettings(max_running=1)))
    model = served_models["demo"]
    sid = w.client.create_session("demo").session_id
    stream(w, sid, as_inputs(model, random_inputs(model, 3, seed=14)))
    forecaster = w.forecaster("demo")
    blocker = ForecastJob("x", (), 0, 1, model.new_state(), np.zeros(4, np.float32))
    released = w.call(_new_event())

    async def held(step, states, values):  # the blocker's tick waits in the engine
        await released.wait()
        return await step(states, values)

    with next_engine_call(w.engine("demo"), held):
        w.call(_submit(forecaster, blocker))  # holds the one slot until its tick ends
        try:
            with pytest.raises(ResourceExhausted, match="limit 1"):
                w.client.forecast(sid, 4)
        finally:
            blocker.cancelled = True
            w.loop.call_soon_threadsafe(released.set)
    assert len(w.client.forecast(sid, 4).outputs) == 4


async def _new_event() -> asyncio.Event:
    return asyncio.Event()  # made on the worker's loop, which waits on it


async def _submit(forecaster, job) -> None:
    forecaster.submit(job)
