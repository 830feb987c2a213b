"""The service end to end: a real worker (grpc.aio on loopback) on a real redis-server.

Every served output is compared bit for bit with the offline engine (``MambaModel.run``)
on the same inputs: the uninterrupted reference.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ssmserve.client.aio import step_input
from ssmserve.client.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StepFailed,
    Unavailable,
)
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.api.service import ServiceSettings
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.server.state.checkpoint import Checkpoint
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.conftest import random_inputs
from tests.redis_topologies import sync_client

#: The service on one Redis, a Redis Cluster and Sentinel (the last two slow-marked, see
#: conftest).
ALL_TOPOLOGIES = True


def reference(model, inputs):
    return model.run(inputs)[0]


def stream(worker, sid, inputs, first_step=None, per_message=7):
    outs = list(
        worker.client.stream_steps(
            sid, list(inputs), first_step=first_step, steps_per_message=per_message
        )
    )
    return np.stack([o.output for o in outs]), outs


def as_inputs(model, arr):
    return [int(t) for t in arr] if model.config.is_token_model else list(arr)


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_bit_equal(a, b):
    np.testing.assert_array_equal(bits(a), bits(b))


def stub(worker):
    return pb_grpc.SessionServiceStub(grpc.insecure_channel(worker.address))


# ---------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("name", ["demo", "odd", "lm", "m2", "lm2"])
def test_served_outputs_equal_the_offline_engine(worker, served_models, name):
    model = served_models[name]
    x = random_inputs(model, 30, seed=1)
    sid = worker.client.create_session(name).session_id
    got, outs = stream(worker, sid, as_inputs(model, x))
    assert_bit_equal(got, reference(model, x))
    assert [o.step for o in outs] == list(range(1, 31))
    assert worker.client.get_session(sid).step == 30


def test_one_stream_carries_many_sessions_and_steps(worker, served_models):
    model = served_models["demo"]
    sids = [worker.client.create_session("demo").session_id for _ in range(5)]
    xs = {sid: random_inputs(model, 12, seed=i) for i, sid in enumerate(sids)}

    def requests():
        for t in range(0, 12, 4):  # 4 steps of each of 5 sessions per message
            steps = [step_input(sid, t + k + 1, xs[sid][t + k]) for k in range(4) for sid in sids]
            yield pb.StreamRequest(steps=steps)

    outs = {sid: [] for sid in sids}
    responses = list(stub(worker).Stream(requests()))
    assert len(responses) == 3
    for response in responses:
        assert len(response.results) == 20
        for r in response.results:
            assert not r.HasField("error"), r.error
            outs[r.session_id].append(np.asarray(r.output.values, np.float32))
    for sid in sids:
        assert_bit_equal(np.stack(outs[sid]), reference(model, xs[sid]))


def test_resent_steps_return_the_recorded_output(worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 10, seed=2)
    sid = worker.client.create_session("demo").session_id
    got, _ = stream(worker, sid, x)
    again = worker.client.step(sid, x[6], step=7)  # the same input: the record
    assert again.replayed
    assert_bit_equal(again.output, got[6])
    other = np.full(4, 9.0, np.float32)  # another input: refused (tests/test_resend_inputs.py)
    with pytest.raises((StepFailed, FailedPrecondition), match="already taken"):
        worker.client.step(sid, other, step=7)
    assert worker.client.get_session(sid).step == 10
    nxt, _ = stream(worker, sid, random_inputs(model, 1, seed=3))
    full = np.concatenate([x, random_inputs(model, 1, seed=3)])
    assert_bit_equal(nxt[0], reference(model, full)[10])


def test_resend_older_than_memory_is_recomputed_exactly(start_worker, served_models):
    worker = start_worker(manager=ManagerSettings(output_window=2))
    model = served_models["odd"]
    x = random_inputs(model, 20, seed=4)
    sid = worker.client.create_session("odd", snapshot_every=6).session_id
    got, _ = stream(worker, sid, x)
    for step in (1, 5, 13, 19):
        out = worker.client.step(sid, x[step - 1], step=step)
        assert out.replayed
        assert_bit_equal(out.output, got[step - 1])


def test_a_gap_is_an_error_and_changes_nothing(worker, served_models):
    model = served_models["demo"]
    sid = worker.client.create_session("demo").session_id
    stream(worker, sid, random_inputs(model, 3, seed=5))
    with pytest.raises(StepFailed) as err:
        worker.client.step(sid, np.zeros(4), step=5)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.reason == "STEP_GAP"
    assert "next input is step 4" in str(err.value)
    assert worker.client.get_session(sid).step == 3


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("value", "reason", "words"),
    [
        (np.zeros(3, np.float32), "BAD_STEP_INPUT", "takes vectors of 4 values, got 3"),
        (np.array([0, np.nan, 0, 0], np.float32), "BAD_STEP_INPUT", "NaN or Inf"),
        (np.array([0, np.inf, 0, 0], np.float32), "BAD_STEP_INPUT", "NaN or Inf"),
        (3, "BAD_STEP_INPUT", "takes float vectors, not token ids"),
    ],
)
def test_bad_inputs_are_refused_and_change_nothing(worker, served_models, value, reason, words):
    model = served_models["demo"]
    x = random_inputs(model, 6, seed=6)
    sid = worker.client.create_session("demo").session_id
    stream(worker, sid, x[:3])
    with pytest.raises(StepFailed) as err:
        worker.client.step(sid, value, step=4)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.reason == reason
    assert words in str(err.value)
    assert worker.client.get_session(sid).step == 3
    rest, _ = stream(worker, sid, x[3:])
    assert_bit_equal(rest, reference(model, x)[3:])


def test_packed_vectors_in_and_out_are_the_same_bits(worker, served_models):
    """Vector.packed (little-endian float32 bytes) carries inputs, and packed_outputs asks
    for outputs in it: the same bits as ``values``; a malformed one is refused per step,
    the session untouched."""
    model = served_models["demo"]
    x = random_inputs(model, 8, seed=31)
    sid = worker.client.create_session("demo").session_id

    def packed_step(step, raw, packed_out=True):
        vector = pb.Vector(packed=raw)
        request = pb.StreamRequest(
            steps=[pb.StepInput(session_id=sid, step=step, vector=vector)],
            packed_outputs=packed_out,
        )
        (response,) = stub(worker).Stream(iter([request]), timeout=10)
        (result,) = response.results
        return result

    got = []
    for t in range(4):
        result = packed_step(t + 1, x[t].astype("<f4").tobytes(), packed_out=t % 2 == 0)
        assert not result.HasField("error"), result.error
        assert (len(result.output.packed) > 0) == (t % 2 == 0)
        assert (len(result.output.values) > 0) == (t % 2 == 1)
        got.append(
            np.frombuffer(result.output.packed, "<f4")
            if t % 2 == 0
            else np.asarray(result.output.values, np.float32)
        )
    assert_bit_equal(np.stack(got), reference(model, x[:4]))
    bad = {
        x[4].astype("<f4").tobytes()[:-1]: "15 bytes, not a multiple of 4",
        x[4].astype("<f4").tobytes()[:-4]: "takes vectors of 4 values, got 3",
        np.array([0, np.nan, 0, 0], "<f4").tobytes(): "NaN or Inf",
    }
    for raw, words in bad.items():
        result = packed_step(5, raw)
        assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], result
        assert words in result.error.message
    both = pb.Vector(values=[0.0] * 4, packed=x[4].astype("<f4").tobytes())
    request = pb.StreamRequest(steps=[pb.StepInput(session_id=sid, step=5, vector=both)])
    (response,) = stub(worker).Stream(iter([request]), timeout=10)
    assert "values or packed, not both" in response.results[0].error.message
    assert worker.client.get_session(sid).step == 4
    rest, _ = stream(worker, sid, x[4:])
    assert_bit_equal(rest, reference(model, x)[4:])
    forecast = worker.client.forecast(sid, 3)  # the client asks for packed outputs
    fed = np.concatenate([x, rest[-1:], forecast.outputs[:2]])  # each output is the next input
    assert_bit_equal(forecast.outputs, model.run(fed)[0][8:])


def test_a_message_of_packed_steps_is_decoded_at_once_and_each_bad_step_refused(
    worker, served_models
):
    """A message whose steps all carry packed vectors is decoded in one copy and checked
    finite at once; a step whose vector has the wrong length for its model, or a message
    with any NaN, malformed or non-packed step (decoded step by step), still gets an error
    for each bad step alone: the good steps of the same message are applied."""
    model = served_models["demo"]
    x, y = random_inputs(model, 3, seed=41), random_inputs(model, 3, seed=42)
    sids = [worker.client.create_session("demo").session_id for _ in range(3)]

    def send(steps):
        request = pb.StreamRequest(steps=steps, packed_outputs=True)
        return [r for response in stub(worker).Stream(iter([request]), timeout=10)
                for r in response.results]  # fmt: skip

    def packed(sid, step, raw):
        return pb.StepInput(session_id=sid, step=step, vector=pb.Vector(packed=raw))

    raw = [v.astype("<f4").tobytes() for v in x]
    other = [v.astype("<f4").tobytes() for v in y]  # sids[2]'s inputs
    nan = np.array([0, np.nan, 0, 0], "<f4").tobytes()
    messages = [  # (steps, the error of each step: None when applied)
        ([packed(sids[0], 1, raw[0]), packed(sids[1], 1, raw[0][:-4]),
          packed(sids[2], 1, other[0])], [None, "takes vectors of 4 values, got 3", None]),
        ([packed(sids[0], 2, raw[1]), packed(sids[1], 1, nan), packed(sids[2], 2, other[1])],
         [None, "NaN or Inf", None]),
        ([packed(sids[0], 3, raw[2]), packed(sids[1], 1, raw[0][:-1]),
          pb.StepInput(session_id=sids[2], step=3, vector=pb.Vector(values=y[2].tolist()))],
         [None, "not a multiple of 4", None]),
    ]  # fmt: skip
    outputs: dict[str, list[np.ndarray]] = {sid: [] for sid in sids}
    for steps, errors in messages:
        results = send(steps)
        for result, words in zip(results, errors, strict=True):
            if words is None:
                assert not result.HasField("error"), result.error
                outputs[result.session_id].append(np.frombuffer(result.output.packed, "<f4"))
            else:
                assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert words in result.error.message
    for sid, inputs in ((sids[0], x), (sids[2], y)):
        assert_bit_equal(np.stack(outputs[sid]), reference(model, inputs))
        assert worker.client.get_session(sid).step == 3
    assert worker.client.get_session(sids[1]).step == 0  # every step of it was refused


def test_token_model_refuses_vectors_and_bad_ids(worker):
    sid = worker.client.create_session("lm").session_id
    for value, words in ((np.zeros(4), "takes token ids"), (37, "outside [0, 37)")):
        with pytest.raises(StepFailed, match=words.replace("[", r"\[").replace(")", r"\)")):
            worker.client.step(sid, value, step=1)
    assert worker.client.get_session(sid).step == 0


def test_unknown_session_and_model(worker):
    with pytest.raises(NotFound, match="session 'nope' does not exist") as err:
        worker.client.get_session("nope")
    assert err.value.reason == "SESSION_MISSING"
    with pytest.raises(StepFailed) as step_err:
        worker.client.step("nope", np.zeros(4), step=1)
    assert step_err.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(NotFound, match="model 'gpt' is not served here"):
        worker.client.create_session("gpt")
    for call in (
        lambda: worker.client.rollback("nope", to_step=0),
        lambda: worker.client.snapshot("nope"),
        lambda: worker.client.list_snapshots("nope"),
        lambda: worker.client.export_checkpoint("nope"),
        lambda: worker.client.close_session("nope"),
    ):
        with pytest.raises(NotFound):
            call()


def test_create_validates_ids_and_settings(worker):
    worker.client.create_session("demo", "s-1")
    with pytest.raises(AlreadyExists, match="already exists"):
        worker.client.create_session("demo", "s-1")
    with pytest.raises(InvalidArgument, match="session id"):
        worker.client.create_session("demo", "bad{id}")
    bad_guard = pb.GuardRule(name="g", check=pb.GuardRule.CHECK_RANGE, max=1.0, dims=[9])
    with pytest.raises(InvalidArgument, match="output dim 9 does not exist"):
        worker.client.create_session("demo", guards=[bad_guard])
    no_bounds = pb.GuardRule(name="g", check=pb.GuardRule.CHECK_RANGE)
    with pytest.raises(InvalidArgument, match="needs min, max or both"):
        worker.client.create_session("demo", guards=[no_bounds])
    with pytest.raises(InvalidArgument, match="max_snapshots must be between"):
        worker.client.create_session("demo", max_snapshots=100_000)
    ids = [s.session_id for s in worker.client.list_sessions()]
    assert ids == ["s-1"]


def test_oversize_message_is_resource_exhausted(start_worker):
    worker = start_worker(max_message_bytes=64 << 10)
    sid = worker.client.create_session("demo").session_id
    big = pb.StreamRequest(steps=[step_input(sid, i + 1, np.zeros(4)) for i in range(5000)])
    assert big.ByteSize() > 64 << 10
    with pytest.raises(grpc.RpcError) as err:
        list(stub(worker).Stream(iter([big])))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert worker.client.get_session(sid).step == 0


def test_too_many_steps_in_one_message(start_worker):
    worker = start_worker(service=ServiceSettings(max_steps_per_message=8))
    sid = worker.client.create_session("demo").session_id
    msg = pb.StreamRequest(steps=[step_input(sid, i + 1, np.zeros(4)) for i in range(9)])
    (response,) = list(stub(worker).Stream(iter([msg])))
    assert {r.error.code for r in response.results} == {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
    assert "at most 8 steps" in response.results[0].error.message
    assert worker.client.get_session(sid).step == 0


# ---------------------------------------------------------------------------- rollback


def _rollback_case(worker, model):
    x = random_inputs(model, 40, seed=7)
    ref = reference(model, x)
    sid = worker.client.create_session("demo", snapshot_every=5).session_id
    stream(worker, sid, x[:12])
    labelled = worker.client.snapshot(sid, label="twelve")
    stream(worker, sid, x[12:23])
    return sid, x, ref, labelled


@pytest.mark.parametrize("kind", ["step", "snapshot", "label", "back"])
def test_rollback_is_bit_exact(worker, served_models, kind):
    model = served_models["demo"]
    sid, x, ref, labelled = _rollback_case(worker, model)
    snaps = {s.step: s.snapshot_id for s in worker.client.list_snapshots(sid)}
    args, want_step, want_replayed = {
        "step": ({"to_step": 17}, 17, 2),
        "snapshot": ({"to_snapshot": snaps[10]}, 10, 0),
        "label": ({"to_label": "twelve"}, 12, 0),
        "back": ({"back": 9}, 14, 2),  # from the labelled snapshot at 12
    }[kind]
    reply = worker.client.rollback(sid, **args)
    assert (reply.step, reply.replayed_steps) == (want_step, want_replayed)
    assert worker.client.get_session(sid).step == want_step
    ckpt = Checkpoint.decode(worker.client.export_checkpoint(sid))
    _, state = model.run(x[:want_step])
    assert ckpt.state.bit_equal(state)
    got, outs = stream(worker, sid, x[want_step : want_step + 10])
    assert outs[0].step == want_step + 1
    assert_bit_equal(got, ref[want_step : want_step + 10])
    assert labelled.step == 12


def test_rollback_cuts_later_history(worker, served_models):
    model = served_models["demo"]
    sid, x, _ref, _ = _rollback_case(worker, model)
    worker.client.rollback(sid, to_step=7)
    assert [s.step for s in worker.client.list_snapshots(sid)] == [0, 5]
    other = random_inputs(model, 3, seed=99)
    got, outs = stream(worker, sid, other)
    assert not any(o.replayed for o in outs)  # step 8 is new again, not a resend
    assert_bit_equal(got, reference(model, np.concatenate([x[:7], other]))[7:])
    with pytest.raises(NotFound, match="labelled 'twelve'"):
        worker.client.rollback(sid, to_label="twelve")


def test_rollback_errors_change_nothing(worker, served_models):
    sid, *_ = _rollback_case(worker, served_models["demo"])
    with pytest.raises(FailedPrecondition, match="forward to step 30"):
        worker.client.rollback(sid, to_step=30)
    with pytest.raises(FailedPrecondition, match="cannot go 24 steps back"):
        worker.client.rollback(sid, back=24)
    with pytest.raises(NotFound, match="no snapshot 'x'"):
        worker.client.rollback(sid, to_snapshot="x")
    with pytest.raises(AlreadyExists, match="label 'twelve' already names"):
        worker.client.snapshot(sid, label="twelve")
    assert worker.client.get_session(sid).step == 23


def test_rollback_is_ordered_with_queued_steps(worker, served_models):
    """A rollback never lands between the steps of one message."""
    model = served_models["demo"]
    x = random_inputs(model, 300, seed=8)
    sid = worker.client.create_session("demo").session_id
    stream(worker, sid, x[:20])
    channel_stub = stub(worker)
    msg = pb.StreamRequest(steps=[step_input(sid, 21 + i, x[20 + i]) for i in range(280)])
    responses = []
    t = threading.Thread(target=lambda: responses.extend(channel_stub.Stream(iter([msg]))))
    t.start()
    time.sleep(0.01)
    reply = worker.client.rollback(sid, to_step=5)
    t.join(30)
    errors = [r.HasField("error") for r in responses[0].results]
    assert errors in ([False] * 280, [True] * 280)  # all before the rollback, or none
    assert reply.step == 5
    assert worker.client.get_session(sid).step == 5
    got, _ = stream(worker, sid, x[5:10])
    assert_bit_equal(got, reference(model, x)[5:10])


# ---------------------------------------------------------------------------- guards


def _guard_case(model, n=16, spike_at=10):
    """Inputs, a one-dim bound, and a calm variant, found offline for a deterministic test.

    Every output on dim ``d`` stays under ``bound`` except the one at ``spike_at``; with the
    spike replaced (``calm``), every output stays under it.
    """
    for seed in range(50):
        for level in (40.0, -40.0, 8.0, -8.0, 3.0, -3.0):
            x = random_inputs(model, n, seed=seed)
            x[spike_at] = level
            ref = reference(model, x)
            calm = x.copy()
            calm[spike_at] = x[spike_at - 1]
            calm_ref = reference(model, calm)
            for d in range(ref.shape[1]):
                others = np.delete(ref[:, d], spike_at)
                top = max(others.max(), calm_ref[:, d].max())
                if ref[spike_at, d] > top + 0.05:
                    bound = float((top + ref[spike_at, d]) / 2)
                    return x, calm, ref, calm_ref, d, bound
    raise AssertionError("no guard case found")


@pytest.mark.parametrize("action", ["report", "clamp", "reject", "rollback"])
def test_guard_actions(worker, served_models, action):
    model = served_models["demo"]
    spike = 10  # step 11
    x, calm, ref, calm_ref, dim, bound = _guard_case(model, spike_at=spike)
    rule = pb.GuardRule(
        name="bounds",
        check=pb.GuardRule.CHECK_RANGE,
        max=bound,
        dims=[dim],
        action=getattr(pb.GuardRule, f"ACTION_{action.upper()}"),
    )
    sid = worker.client.create_session("demo", snapshot_every=4, guards=[rule]).session_id
    got, outs = stream(worker, sid, x[:spike])
    assert_bit_equal(got, ref[:spike])
    assert not any(o.guard_events for o in outs)
    if action in ("report", "clamp"):
        out = worker.client.step(sid, x[spike], step=spike + 1)
        (event,) = out.guard_events
        assert (event.guard, event.step, list(event.dims)) == ("bounds", spike + 1, [dim])
        want = ref[spike].copy()
        if action == "clamp":
            want[dim] = np.float32(bound)
        assert_bit_equal(out.output, want)
        # only the answer is clamped: the state is the model's, so what follows is exact
        got, _ = stream(worker, sid, x[spike + 1 :])
        assert_bit_equal(got, ref[spike + 1 :])
        return
    with pytest.raises(StepFailed) as err:
        worker.client.step(sid, x[spike], step=spike + 1)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    event = err.value.result.guard_events[0]
    if action == "reject":
        assert err.value.reason == "GUARD_REJECTED"
        assert worker.client.get_session(sid).step == spike
    else:
        assert err.value.reason == "GUARD_ROLLED_BACK"
        assert event.rolled_back_to == 8  # the newest snapshot before the violation
        assert worker.client.get_session(sid).step == 8
    at = worker.client.get_session(sid).step
    got, _ = stream(worker, sid, calm[at:])
    assert_bit_equal(got, calm_ref[at:])


# ---------------------------------------------------------------------------- snapshots


def test_periodic_snapshots_are_written_in_the_background_and_reported_later(worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 30, seed=21)
    sid = worker.client.create_session("demo", snapshot_every=4).session_id
    got, outs = stream(worker, sid, x[:25], per_message=1)
    assert_bit_equal(got, reference(model, x[:25]))
    # Read your writes: every due snapshot is committed before ListSnapshots answers. A
    # write that waits behind MAX_WAITING others is superseded by design (replay still
    # reaches its step): seen once on a machine running two CPU hogs and another suite.
    # Then the newest is still there, and the writer counted each one it dropped.
    steps = [s.step for s in worker.client.list_snapshots(sid)]
    writer = worker.manager.resident(sid).snapshots
    assert steps[0] == 0 and steps[-1] == 24 and set(steps) <= {0, 4, 8, 12, 16, 20, 24}
    assert len(steps) + writer.superseded == 7, (steps, writer.superseded)
    # Each is reported once, in an answer after the step it was taken at.
    _, more = stream(worker, sid, x[25:30], per_message=1)
    reported = [(o.step, e.step) for o in outs + more for e in o.snapshot_events]
    # (the snapshot at 28 is reported too when its write beats the answer to step 30)
    assert [s for _, s in reported] in (steps[1:], [*steps[1:], 28])
    assert all(answered >= taken for answered, taken in reported)
    assert all(e.reason == "periodic" for o in outs + more for e in o.snapshot_events)
    # Rollback to a background snapshot is exact.
    reply = worker.client.rollback(sid, to_step=20)
    assert reply.replayed_steps == 20 - max(s for s in steps if s <= 20)
    again, _ = stream(worker, sid, x[20:30], first_step=21)
    assert_bit_equal(again, reference(model, x)[20:30])


def test_a_rollback_past_a_snapshot_not_yet_reported_never_reports_it(worker, served_models):
    """A periodic snapshot committed after the answer to its step waits for the next
    answer to be reported. A rollback behind it cuts it from the history, so the next
    answer (of the new steps) must not report it: a client would take it for a snapshot
    of its new steps (the nemesis, Cluster seed 5, read it so)."""
    model = served_models["demo"]
    x = random_inputs(model, 8, seed=22)
    sid = worker.client.create_session("demo", snapshot_every=4).session_id
    _, outs = stream(worker, sid, x[:4], per_message=1)
    assert not [e for o in outs for e in o.snapshot_events]  # committed after step 4's answer
    assert [s.step for s in worker.client.list_snapshots(sid)] == [0, 4]  # committed now
    worker.client.rollback(sid, to_step=2)
    got, outs = stream(worker, sid, x[2:4], first_step=3, per_message=1)
    assert_bit_equal(got, reference(model, x[:4])[2:4])
    assert [(o.step, e.step) for o in outs for e in o.snapshot_events] == []


def test_snapshots_of_lockstep_sessions_are_committed_in_batches(worker, served_models):
    """Sessions stepped in one message come due for their periodic snapshots in the same
    stepper batch; their writes go to Redis as one batch per ``snapshot_writes_in_flight``
    of them (``snapshot_commits``), not one round of Redis commands each. Every snapshot
    lands, bit-exact to restore from."""
    model = served_models["demo"]
    count, due_ticks = 20, 2
    bound = ManagerSettings().snapshot_writes_in_flight
    sids = [worker.client.create_session("demo", snapshot_every=2).session_id for _ in range(count)]
    x = random_inputs(model, 2 * due_ticks, seed=31)
    commits = worker.checkpoints.commits
    before = commits.batches
    channel = grpc.insecure_channel(worker.address)
    try:
        call = pb_grpc.SessionServiceStub(channel).Stream
        for t in range(2 * due_ticks):  # one message: step t + 1 of every session
            request = pb.StreamRequest(steps=[step_input(sid, t + 1, x[t]) for sid in sids])
            (response,) = list(call(iter([request]), timeout=30))
            assert [r.step for r in response.results] == [t + 1] * count
            assert not any(r.HasField("error") for r in response.results)
    finally:
        channel.close()
    for sid in sids:
        worker.call(worker.checkpoints.settled(sid))
        assert [s.step for s in worker.client.list_snapshots(sid)] == [0, 2, 4]
    # Per due tick: the writes in flight together, then the ones that waited for them.
    assert commits.batches - before <= due_ticks * -(-count // bound)
    reply = worker.client.rollback(sids[7], to_step=2)
    assert reply.replayed_steps == 0
    again, _ = stream(worker, sids[7], x[2:4], first_step=3)
    assert_bit_equal(again, reference(model, x)[2:4])


def test_retention_keeps_n_snapshots_and_trims_the_log(worker, served_models, redis_url):
    model = served_models["demo"]
    sid = worker.client.create_session("demo", snapshot_every=2, max_snapshots=3).session_id
    stream(worker, sid, random_inputs(model, 21, seed=11))
    snaps = worker.client.list_snapshots(sid)
    assert [s.step for s in snaps] == [16, 18, 20]
    info = worker.client.get_session(sid)
    assert (info.snapshot_count, info.oldest_rollback_step) == (3, 16)
    with sync_client(redis_url) as r:
        logged = sorted(int(k) for k in r.hkeys(f"ssm:{{{sid}}}:log"))
        assert logged == [17, 18, 19, 20, 21]
        blobs = [k for k in r.scan_iter(match=f"ssm:{{{sid}}}:blob:*")]
        assert len(blobs) == 3
    with pytest.raises(FailedPrecondition, match="oldest kept snapshot is at step 16"):
        worker.client.rollback(sid, to_step=15)
    worker.client.rollback(sid, to_step=16)


def test_keys_of_a_session_carry_its_hash_tag(worker, served_models, redis_url):
    model = served_models["demo"]
    sid = worker.client.create_session("demo", snapshot_every=3).session_id
    stream(worker, sid, random_inputs(model, 7, seed=12))
    worker.client.snapshot(sid, label="l")
    with sync_client(redis_url) as r:
        keys = sorted(k.decode() for k in r.scan_iter(match="*"))
        global_keys = {"ssm:sessions", "ssm:workers", "ssm:store"}
        session_keys = [k for k in keys if k not in global_keys and not k.startswith("ssm:worker")]
        assert session_keys and all(k.startswith(f"ssm:{{{sid}}}:") for k in session_keys)
        assert {k.split(":")[2] for k in session_keys} == {
            "meta",
            "log",
            "snaps",
            "labels",
            "lease",
            "snap",
            "blob",
        }
        assert r.hget(f"ssm:{{{sid}}}:meta", "step") == b"7"


def test_list_sessions_pages(worker):
    for i in range(5):
        worker.client.create_session("demo" if i % 2 else "odd", f"s{i}")
    pages = []
    token = ""
    s = stub(worker)
    while True:
        page = s.ListSessions(pb.ListSessionsRequest(page_size=2, page_token=token))
        pages.append([x.session_id for x in page.sessions])
        token = page.next_page_token
        if not token:
            break
    assert [i for p in pages for i in p] == ["s0", "s1", "s2", "s3", "s4"]
    assert max(len(p) for p in pages) == 2
    assert [x.session_id for x in worker.client.list_sessions(model="demo")] == ["s1", "s3"]


def test_close_with_and_without_final_snapshot(worker, served_models, redis_url):
    model = served_models["demo"]
    x = random_inputs(model, 9, seed=13)
    gone = worker.client.create_session("demo").session_id
    kept = worker.client.create_session("demo").session_id
    for sid in (gone, kept):
        stream(worker, sid, x)
    assert worker.client.close_session(gone).step == 9
    reply = worker.client.close_session(kept, final_snapshot=True)
    assert reply.snapshot_id
    with pytest.raises(NotFound):
        worker.client.get_session(gone)
    with sync_client(redis_url) as r:
        assert list(r.scan_iter(match=f"ssm:{{{gone}}}:*")) == []
    info = worker.client.get_session(kept)
    assert info.closed and not info.resident and info.snapshot_count == 1
    with pytest.raises(StepFailed) as err:
        worker.client.step(kept, x[0], step=10)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    ckpt = Checkpoint.decode(worker.client.export_checkpoint(kept))
    assert ckpt.step == 9 and ckpt.state.bit_equal(model.run(x)[1])


# ---------------------------------------------------------------------------- export / import


def test_export_import_round_trip(worker, served_models):
    model = served_models["odd"]
    x = random_inputs(model, 30, seed=14)
    ref = reference(model, x)
    sid = worker.client.create_session("odd", snapshot_every=4).session_id
    stream(worker, sid, x[:17])
    blob = worker.client.export_checkpoint(sid)
    info = worker.client.import_checkpoint(blob, "copy")
    assert (info.session_id, info.step, info.model) == ("copy", 17, "odd")
    for target in (sid, "copy"):
        got, _ = stream(worker, target, x[17:])
        assert_bit_equal(got, ref[17:])
    with pytest.raises(AlreadyExists):
        worker.client.import_checkpoint(blob, "copy")
    back = worker.client.import_checkpoint(blob, "copy", replace=True)
    assert back.step == 17
    got, _ = stream(worker, "copy", x[17:20])
    assert_bit_equal(got, ref[17:20])
    snap = worker.client.list_snapshots(sid)[1]
    old = Checkpoint.decode(worker.client.export_checkpoint(sid, snap.snapshot_id))
    assert old.step == snap.step and old.state.bit_equal(model.run(x[: snap.step])[1])


def test_import_refuses_foreign_and_corrupt_checkpoints(worker, served_models):
    sid = worker.client.create_session("odd").session_id
    stream(worker, sid, random_inputs(served_models["odd"], 3, seed=15))
    blob = worker.client.export_checkpoint(sid)
    with pytest.raises(FailedPrecondition, match="not 'demo'") as err:
        worker.client.import_checkpoint(blob, "x", model="demo")
    assert err.value.reason == "CHECKPOINT_MODEL_MISMATCH"
    corrupt = bytearray(blob)
    corrupt[100] ^= 1
    with pytest.raises(InvalidArgument, match="checksum") as err2:
        worker.client.import_checkpoint(bytes(corrupt), "x")
    assert err2.value.reason == "CHECKPOINT_CHECKSUM"
    with pytest.raises(InvalidArgument, match="bad magic"):
        worker.client.import_checkpoint(b"hello", "x")
    with pytest.raises(NotFound):
        worker.client.get_session("x")


def _import_stream(worker, messages):
    return stub(worker).ImportCheckpoint(iter(messages))


@pytest.mark.parametrize(
    ("order", "words"),
    [
        ("no-header", "first message must be the header"),
        ("swapped", "chunk 1 arrived where chunk 0 was expected"),
        ("missing-last", "without the last chunk"),
        ("after-last", "arrived after the last chunk"),
        ("wrong-total", "says the total is"),
    ],
)
def test_import_checks_chunk_order(worker, served_models, order, words):
    sid = worker.client.create_session("demo").session_id
    blob = worker.client.export_checkpoint(sid)
    half = len(blob) // 2
    header = pb.ImportCheckpointRequest(header=pb.ImportHeader(session_id="y"))

    def chunk(i, data, last, total=None):
        total = len(blob) if total is None else total
        return pb.ImportCheckpointRequest(
            chunk=pb.CheckpointChunk(index=i, data=data, total_size=total, last=last)
        )

    c0, c1 = chunk(0, blob[:half], False), chunk(1, blob[half:], True)
    messages = {
        "no-header": [c0, c1],
        "swapped": [header, c1, c0],
        "missing-last": [header, c0],
        "after-last": [header, c0, c1, chunk(2, b"", True)],
        "wrong-total": [header, c0, chunk(1, blob[half:], True, total=len(blob) + 1)],
    }[order]
    with pytest.raises(grpc.RpcError) as err:
        _import_stream(worker, messages)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    with pytest.raises(NotFound):
        worker.client.get_session("y")


class _PausedUpload:
    """An ImportCheckpoint request stream in small chunks that stops half way until told
    to go on (gRPC reads it on its own thread)."""

    def __init__(self, blob: bytes, session_id: str, chunk: int = 1000) -> None:
        self.blob, self.session_id, self.chunk = blob, session_id, chunk
        self.paused, self.resume = threading.Event(), threading.Event()

    def __iter__(self):
        yield pb.ImportCheckpointRequest(header=pb.ImportHeader(session_id=self.session_id))
        starts = range(0, len(self.blob), self.chunk)
        for i, start in enumerate(starts):
            if start >= len(self.blob) // 2 and not self.paused.is_set():
                self.paused.set()
                assert self.resume.wait(30), "the test never resumed the upload"
            yield pb.ImportCheckpointRequest(
                chunk=pb.CheckpointChunk(
                    index=i,
                    data=self.blob[start : start + self.chunk],
                    total_size=len(self.blob),
                    last=i == len(starts) - 1,
                )
            )


def _staged_uploads(url: str) -> dict[bytes, int]:
    """The staging lists of running imports: key -> bytes staged."""
    with sync_client(url) as r:
        return {k: sum(map(len, r.lrange(k, 0, -1))) for k in r.scan_iter("ssm:upload:*")}


def test_an_import_is_staged_in_redis_while_it_arrives(
    start_worker, served_models, redis_url, monkeypatch
):
    """Chunks go to a Redis staging list in pieces as they arrive, so a slow upload holds
    no memory on the worker; only the finished checkpoint is read back, counted in the
    memory budget while it is decoded; the list is gone afterwards."""
    from ssmserve.server.api import imports

    monkeypatch.setattr(imports, "PIECE_BYTES", 1024)  # several pieces of a small blob
    w = start_worker()
    model = served_models["odd"]
    x = random_inputs(model, 40, seed=61)
    sid = w.client.create_session("odd").session_id
    stream(w, sid, x[:25])
    blob = w.client.export_checkpoint(sid)
    assert len(blob) > 6 * 1024
    upload = _PausedUpload(blob, "staged", chunk=300)
    future = stub(w).ImportCheckpoint.future(iter(upload), timeout=60)
    assert upload.paused.wait(30)
    deadline = time.monotonic() + 30  # bound: the worker stages what it was sent
    while sum(_staged_uploads(redis_url).values()) < len(blob) // 2 - 1024 - 300:
        assert time.monotonic() < deadline, "the first half of the upload was never staged"
        time.sleep(0.02)
    assert w.memory.held_by["imports"] == 0  # nothing held whole yet
    assert w.worker.service.budgets.import_bytes == len(blob)  # the staging budget
    upload.resume.set()
    info = future.result(60)
    assert (info.session_id, info.step) == ("staged", 25)
    assert _staged_uploads(redis_url) == {}
    assert w.memory.held_by["imports"] == 0
    assert w.worker.service.budgets.import_bytes == 0
    got, _ = stream(w, "staged", x[25:])
    assert_bit_equal(got, reference(model, x)[25:])


def test_an_import_whose_staging_expired_is_refused_and_changes_nothing(
    start_worker, served_models, redis_url, monkeypatch
):
    from ssmserve.server.api import imports

    monkeypatch.setattr(imports, "PIECE_BYTES", 1024)
    w = start_worker()
    sid = w.client.create_session("odd").session_id
    stream(w, sid, random_inputs(served_models["odd"], 25, seed=62))
    upload = _PausedUpload(w.client.export_checkpoint(sid), "late", chunk=300)
    future = stub(w).ImportCheckpoint.future(iter(upload), timeout=60)
    assert upload.paused.wait(30)
    deadline = time.monotonic() + 30  # bound: the worker stages what it was sent
    while not _staged_uploads(redis_url):
        assert time.monotonic() < deadline, "the first half of the upload was never staged"
        time.sleep(0.02)
    # The staging expires (stage_ttl_s) if the client takes too long; here it is made to
    # expire now, by deleting it, rather than by waiting out a short TTL and hoping the
    # test sees the key in between.
    with sync_client(redis_url) as r:
        for key in _staged_uploads(redis_url):
            assert 0 < r.ttl(key) <= w.worker.store.settings.stage_ttl_s
            r.delete(key)
    upload.resume.set()
    with pytest.raises(grpc.RpcError) as err:
        future.result(60)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # sending it again can work
    assert "staging" in err.value.details()
    with pytest.raises(NotFound):
        w.client.get_session("late")
    assert w.worker.service.budgets.import_bytes == 0


def test_forecasts_and_imports_count_in_the_worker_memory_budget(start_worker, served_models):
    """One budget: a forecast holds its state copy and its answer, an import its
    checkpoint while decoded; past the budget each is RESOURCE_EXHAUSTED naming it, and
    what ended gives its bytes back."""
    from ssmserve.client.errors import ResourceExhausted
    from ssmserve.server.sessions.config import SessionConfig, SessionDefaults

    model = served_models["demo"]
    c = model.config
    probe = start_worker()
    each = probe.loader.footprint(model, SessionConfig().resolve(SessionDefaults(), c.output_dim))
    probe.stop()
    room = 1000 * c.output_dim * 4 + c.state_bytes  # a forecast of 1000 steps fits ...
    w = start_worker(manager=ManagerSettings(memory_budget_bytes=each + room))
    sid = w.client.create_session("demo").session_id
    stream(w, sid, random_inputs(model, 5, seed=63))
    assert len(w.client.forecast(sid, 1000).outputs) == 1000
    assert w.memory.held_by["forecasts"] == 0  # given back when it ended
    with pytest.raises(ResourceExhausted, match=r"forecast of 1001 steps .* memory budget"):
        w.client.forecast(sid, 1001)  # ... one more step does not
    blob = w.client.export_checkpoint(sid)
    assert len(blob) < room
    with pytest.raises(ResourceExhausted, match="memory budget"):
        w.client.import_checkpoint(blob, "copy")  # checkpoint and one more session
    with pytest.raises(NotFound):
        w.client.get_session("copy")
    assert sum(w.memory.held_by.values()) == 0
    assert w.memory.held == each


# ---------------------------------------------------------------------------- lifecycle


def test_idle_sessions_are_evicted_and_restored_exactly(start_worker, served_models):
    worker = start_worker(manager=ManagerSettings(idle_check_s=0.05))
    model = served_models["demo"]
    x = random_inputs(model, 20, seed=16)
    sid = worker.client.create_session("demo", snapshot_every=4, idle_ttl_s=0.2).session_id
    stream(worker, sid, x[:9])
    deadline = time.monotonic() + 10
    while worker.client.get_session(sid).resident and time.monotonic() < deadline:
        time.sleep(0.05)
    info = worker.client.get_session(sid)
    assert not info.resident and info.step == 9
    got, _ = stream(worker, sid, x[9:])
    assert_bit_equal(got, reference(model, x)[9:])


@pytest.mark.parametrize(
    ("durability", "survives"), [(pb.DURABILITY_LOG, 13), (pb.DURABILITY_SNAPSHOT, 10)]
)
def test_a_new_worker_continues_after_a_crash(start_worker, served_models, durability, survives):
    """The first worker stops without its shutdown snapshots (a crash, as Redis sees it)."""
    model = served_models["demo"]
    x = random_inputs(model, 24, seed=17)
    first = start_worker(ownership=OwnershipSettings(lease_ttl_s=0.4))
    second = start_worker()
    sid = first.client.create_session("demo", snapshot_every=5, durability=durability).session_id
    stream(first, sid, x[:13])
    # Periodic snapshots are written in the background; ListSnapshots waits for the ones
    # already due, so after it the snapshot at 10 is in Redis (what `snapshot` promises).
    assert [s.step for s in first.client.list_snapshots(sid)] == [0, 5, 10]
    first.crash()
    info = second.client.get_session(sid)
    deadline = time.monotonic() + 10  # bound: the dead worker's lease runs 0.4 s more
    while info.resident:  # the dead worker's lease still runs: it is shown as the owner
        assert info.owner == first.address
        assert time.monotonic() < deadline, "the crashed worker's lease never ran out"
        time.sleep(0.05)
        info = second.client.get_session(sid)
    assert info.step == survives and not info.resident and not info.owner
    got, _ = stream(second, sid, x[survives:])
    assert_bit_equal(got, reference(model, x)[survives:])
    again = second.client.step(sid, x[survives - 1], step=survives)
    assert again.replayed
    assert_bit_equal(again.output, reference(model, x)[survives - 1])


def test_health_and_reflection(worker):
    channel = grpc.insecure_channel(worker.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "ssmserve.v1.SessionService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in answer.list_services_response.service}
    assert "ssmserve.v1.SessionService" in names
    assert "grpc.health.v1.Health" in names


def test_async_client_and_no_durability_mode(worker, served_models, redis_url):
    """The asyncio API end to end; in mode NONE nothing is logged per step, yet rollback
    is exact (from memory) and a snapshot writes the inputs it needs."""
    import asyncio

    from ssmserve.client.aio import AsyncClient

    model = served_models["odd"]
    x = random_inputs(model, 12, seed=30)

    async def body():
        async with AsyncClient(worker.address) as client:
            info = await client.create_session("odd", durability=pb.DURABILITY_NONE)
            sid = info.session_id
            outs = [o async for o in client.stream_steps(sid, list(x), steps_per_message=5)]
            with sync_client(redis_url) as r:
                assert r.hlen(f"ssm:{{{sid}}}:log") == 0
                assert r.hget(f"ssm:{{{sid}}}:meta", "step") == b"0"
            reply = await client.rollback(sid, to_step=4)
            assert (reply.step, reply.replayed_steps) == (4, 4)
            again = [o async for o in client.stream_steps(sid, list(x[4:]))]
            snap = await client.snapshot(sid)
            with sync_client(redis_url) as r:
                assert r.hget(f"ssm:{{{sid}}}:meta", "step") == b"12"
            return outs, again, snap, await client.list_sessions()

    outs, again, snap, listed = asyncio.run(body())
    ref = reference(model, x)
    assert_bit_equal(np.stack([o.output for o in outs]), ref)
    assert_bit_equal(np.stack([o.output for o in again]), ref[4:])
    assert snap.step == 12 and [s.session_id for s in listed] == [outs[0].session_id]


def test_snapshots_at_one_step_keep_the_newest(worker, served_models):
    sid = worker.client.create_session("demo", max_snapshots=2).session_id
    stream(worker, sid, random_inputs(served_models["demo"], 3, seed=31))
    first = worker.client.snapshot(sid)
    assert worker.client.snapshot(sid).snapshot_id == first.snapshot_id  # nothing moved
    labelled = [worker.client.snapshot(sid, label=f"l{i}") for i in range(4)]
    kept = [s.snapshot_id for s in worker.client.list_snapshots(sid)]
    assert kept == [labelled[2].snapshot_id, labelled[3].snapshot_id]


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_redis_restart_during_streaming_loses_no_acknowledged_step(
    model_dirs, served_models, tmp_path, how
):
    """Redis goes away mid-stream (a clean restart, or kill -9 with appendfsync always):
    steps meanwhile are not applied (UNAVAILABLE, which a client that gives up quickly
    sees), the streaming client retries with backoff and continues, bit-exact."""
    from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
    from tests.harness import WorkerHarness

    model = served_models["demo"]
    x = random_inputs(model, 120, seed=40)
    settings = EmbeddedRedisSettings(data_dir=tmp_path / "r", appendfsync="always")
    redis_server = EmbeddedRedis(settings).start()
    settings = replace(settings, port=redis_server.port)
    worker = WorkerHarness(model_dirs, redis_server.url)
    impatient = Client(worker.address, retry=RetryPolicy(give_up_after_s=0.3))
    try:
        sid = worker.client.create_session("demo").session_id
        other = worker.client.create_session("demo").session_id
        answered: list[int] = []

        async def paced():
            for row in x:
                await asyncio.sleep(0.01)
                yield row

        outs = []
        streaming = threading.Thread(
            target=lambda: outs.extend(worker.client.stream_steps(sid, paced(), first_step=1))
        )
        streaming.start()
        while len(outs) < 20:
            time.sleep(0.01)
        redis_server.kill() if how == "kill" else redis_server.stop()
        with pytest.raises(Unavailable):
            impatient.step(other, x[0], step=1)
        answered = [o.step for o in outs]
        time.sleep(0.5)
        assert [o.step for o in outs] == answered  # nothing answered while Redis is away
        redis_server = EmbeddedRedis(settings).start()
        streaming.join(60)
        assert [o.step for o in outs] == list(range(1, 121))
        assert_bit_equal(np.stack([o.output for o in outs]), reference(model, x))
        assert worker.client.get_session(sid).step == 120
        assert worker.client.get_session(other).step == 0
    finally:
        impatient.close()
        worker.stop()
        redis_server.stop()


def test_a_cancelled_stream_leaves_no_reader_behind(start_worker, served_models):
    """A client that goes away while its read-ahead is full (its steps wait behind a held
    session) ends the Stream: the reader task ends with it, and the session serves on."""
    model = served_models["demo"]
    w = start_worker(service=ServiceSettings(max_inflight_messages=2))
    sid = w.client.create_session("demo").session_id
    x = random_inputs(model, 12, seed=40)
    release = asyncio.Event()
    held = asyncio.Event()

    async def hold() -> None:
        s = w.manager.resident(sid)
        async with s.exclusive():
            held.set()
            await release.wait()

    holder = asyncio.run_coroutine_threadsafe(hold(), w.loop)
    w.call(held.wait())

    def readers() -> int:
        async def count() -> int:
            return sum(t.get_name() == "stream-reader" for t in asyncio.all_tasks())

        return w.call(count())

    with Client(w.address) as raw:

        async def send_and_leave(worker) -> None:
            requests = [pb.StreamRequest(steps=[step_input(sid, i + 1, x[i])]) for i in range(10)]
            call = worker.sessions.Stream(iter(requests))
            await asyncio.sleep(0.3)  # the server reads 2 messages ahead, then waits
            call.cancel()

        raw._run(send_and_leave(raw._aio.router.worker(w.address)))
    deadline = time.monotonic() + 10
    while (readers() or w.worker.service.open_streams) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert readers() == 0 and w.worker.service.open_streams == 0
    w.loop.call_soon_threadsafe(release.set)
    holder.result(10)
    step = w.client.get_session(sid).step  # the steps it had read may have been applied
    got = [o.output for o in w.client.stream_steps(sid, list(x[step:]), first_step=step + 1)]
    assert_bit_equal(np.stack(got), reference(model, x)[step:])


def test_the_memory_budget_bounds_what_resident_sessions_may_hold(start_worker, served_models):
    """Each resident session counts at its bound (state, history, recorded outputs); past
    the worker's budget a create or fork is RESOURCE_EXHAUSTED, and closing makes room."""
    from ssmserve.client.errors import ResourceExhausted
    from ssmserve.server.sessions.config import SessionConfig, SessionDefaults
    from ssmserve.server.sessions.manager import ManagerSettings

    model = served_models["demo"]
    probe = start_worker()
    config = SessionConfig().resolve(SessionDefaults(), model.config.output_dim)
    each = probe.loader.footprint(model, config)
    assert each >= model.config.state_bytes + 256 * 4 * model.config.input_dim
    w = start_worker(manager=ManagerSettings(memory_budget_bytes=2 * each + each // 2))
    first = w.client.create_session("demo").session_id
    w.client.create_session("demo")
    with pytest.raises(ResourceExhausted, match="memory budget"):
        w.client.create_session("demo")
    with pytest.raises(ResourceExhausted, match="memory budget"):
        w.client.fork(first)
    assert w.memory.resident_bytes == 2 * each
    w.client.close_session(first)
    assert w.memory.resident_bytes == each
    w.client.create_session("demo")  # room again


def test_a_snapshot_phase_places_periodic_snapshots_and_stays_with_the_session(
    start_worker, served_models
):
    """Periodic snapshots at steps s with s % snapshot_every == snapshot_phase; the phase is
    part of the session's config (it survives a reload from Redis); a worker started with
    spread snapshots gives each session that does not choose one a phase of its own, so
    sessions created together come due on different ticks."""
    from ssmserve.server.sessions.config import SessionDefaults

    model = served_models["demo"]
    x = random_inputs(model, 20, seed=31)
    spread = ManagerSettings(defaults=SessionDefaults(spread_snapshots=True))
    w = start_worker(manager=spread)
    sid = w.client.create_session("demo", snapshot_every=8, snapshot_phase=3).session_id
    got, _ = stream(w, sid, x, per_message=4)
    assert_bit_equal(got, reference(model, x))
    steps = sorted(s.step for s in w.client.list_snapshots(sid))
    assert steps == [0, 3, 11, 19], steps  # the creation snapshot, then s % 8 == 3
    w.call(w.loader.park(sid, "test"))  # out of memory: the phase comes from Redis
    more = random_inputs(model, 8, seed=32)
    again, _ = stream(w, sid, more, first_step=21, per_message=4)
    assert_bit_equal(again, reference(model, np.concatenate([x, more]))[20:])
    assert max(s.step for s in w.client.list_snapshots(sid)) == 27
    assert w.client.get_session(sid).config.snapshot_phase == 3

    phases = {
        w.client.create_session("demo", snapshot_every=1000).config.snapshot_phase for _ in range(8)
    }
    assert len(phases) > 1 and all(0 <= p < 1000 for p in phases)
    aligned = start_worker()  # the default: snapshots at multiples of snapshot_every
    assert aligned.client.create_session("demo", snapshot_every=8).config.snapshot_phase == 0

    with pytest.raises(InvalidArgument, match=r"snapshot_phase must be in .*\[0, 8\), got 8"):
        w.client.create_session("demo", snapshot_every=8, snapshot_phase=8)


def test_configs_stored_before_snapshot_phases_keep_their_snapshots_at_multiples():
    import msgpack

    from ssmserve.server.sessions.config import SessionConfig

    new = SessionConfig(snapshot_every=8, snapshot_phase=5)
    old = msgpack.unpackb(new.to_bytes())
    del old["snapshot_phase"]
    restored = SessionConfig.from_bytes(msgpack.packb(old))
    assert restored.snapshot_phase == 0 and restored.snapshot_due(16)
    assert SessionConfig.from_bytes(new.to_bytes()).snapshot_due(13)
