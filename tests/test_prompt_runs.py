"""Runs of steps at prefill speed, end to end on a real worker and Redis: a message's run
is prefilled (``batch_plan``), replays are prefills (``replay``), and
``StreamRequest.last_outputs_only`` answers only a run's last output. Every output and
state is compared bit for bit with stepping (the offline engine, or the same inputs sent
one step per message)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ssmserve.client.aio import step_input
from ssmserve.client.cli import main
from ssmserve.server.state.checkpoint import Checkpoint
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.conftest import random_inputs
from tests.test_service import as_inputs, assert_bit_equal, reference

CALL_S = 60.0  # bound on one Stream call's answers (a few hundred steps of a small model)


def _message(sid: str, first: int, values: list, last_only: bool = False) -> pb.StreamRequest:
    return pb.StreamRequest(
        steps=[step_input(sid, first + t, v) for t, v in enumerate(values)],
        packed_outputs=True,
        last_outputs_only=last_only,
    )


def _call(worker, *messages: pb.StreamRequest) -> list[pb.StepResult]:
    """Each message on one Stream, in order; every answer, in order."""
    stub = pb_grpc.SessionServiceStub(grpc.insecure_channel(worker.address))
    results: list[pb.StepResult] = []
    for response in stub.Stream(iter(messages), timeout=CALL_S):
        results.extend(response.results)
    return results


def _outputs(results: list[pb.StepResult]) -> np.ndarray:
    for r in results:
        assert not r.HasField("error"), r.error
    return np.stack([np.frombuffer(r.output.packed, "<f4") for r in results])


def _state(worker, sid: str) -> Checkpoint:
    return Checkpoint.decode(worker.client.export_checkpoint(sid))


@pytest.mark.parametrize("name", ["demo", "lm", "m2", "lm2"])
def test_a_run_sent_as_one_message_is_prefilled_with_the_bits_of_single_steps(
    worker, served_models, name
):
    """The same 150 inputs: to one session as one message (prefilled in chunks that end
    where its snapshots fall due, every 32 steps), to another one step per message (each
    stepped). Every output and both states are bit-equal, and to the offline engine."""
    model = served_models[name]
    x = as_inputs(model, random_inputs(model, 150, seed=31))
    lane = worker.engine(name)
    ran = worker.client.create_session(name, snapshot_every=32).session_id
    stepped = worker.client.create_session(name, snapshot_every=32).session_id
    before = lane.prefilled_steps
    whole = _outputs(_call(worker, _message(ran, 1, x)))
    assert lane.prefilled_steps - before == 128 + 22  # four prefills of 32, then 22
    single = _outputs(_call(worker, *(_message(stepped, t + 1, [v]) for t, v in enumerate(x))))
    assert_bit_equal(whole, single)
    assert_bit_equal(whole, reference(model, np.asarray(x)))
    assert _state(worker, ran).state.bit_equal(_state(worker, stepped).state)
    assert {s.step for s in worker.client.list_snapshots(ran)} == {0, 32, 64, 96, 128}


@pytest.mark.parametrize("name", ["lm", "m2"])
def test_last_outputs_only_answers_the_last_output_and_resends_keep_the_flag(
    worker, served_models, name
):
    """A 100-step message with last_outputs_only: only step 100 carries an output (bit
    equal to stepping), the others are answered without one. Resent with the flag, steps
    40..42 answer only 42's output; step 40 resent without it is answered with its output,
    never computed before, by replay from the snapshot before it."""
    model = served_models[name]
    x = as_inputs(model, random_inputs(model, 110, seed=32))
    ref = reference(model, np.asarray(x))
    sid = worker.client.create_session(name, snapshot_every=16).session_id
    results = _call(worker, _message(sid, 1, x[:100], last_only=True))
    assert [r.step for r in results] == list(range(1, 101))
    assert not any(r.HasField("error") for r in results)
    assert not any(r.HasField("output") for r in results[:-1])
    assert_bit_equal(_outputs(results[-1:]), ref[99:100])

    again = _call(
        worker,
        _message(sid, 40, x[39:42], last_only=True),
        _message(sid, 40, x[39:40]),
        _message(sid, 101, x[100:110], last_only=True),
    )
    assert [r.step for r in again] == [40, 41, 42, 40, *range(101, 111)]
    assert all(r.replayed for r in again[:4]) and not any(r.HasField("error") for r in again)
    assert [r.HasField("output") for r in again[:3]] == [False, False, True]
    assert_bit_equal(_outputs(again[2:3]), ref[41:42])
    assert_bit_equal(_outputs(again[3:4]), ref[39:40])  # replayed: never computed before
    assert_bit_equal(_outputs(again[-1:]), ref[109:110])
    assert _state(worker, sid).state.bit_equal(model.run(np.asarray(x))[1])


def test_a_guarded_session_computes_every_output_but_answers_the_last(worker, served_models):
    """Guards read every output, so a guarded session steps one step at a time; with
    last_outputs_only its guard events still come on their steps, without outputs."""
    model = served_models["demo"]
    x = random_inputs(model, 30, seed=33)
    ref = reference(model, x)
    bound = float(np.median(ref[:, 0]))
    guard = pb.GuardRule(
        name="cap", check=pb.GuardRule.CHECK_RANGE, action=pb.GuardRule.ACTION_REPORT,
        max=bound, dims=[0],
    )  # fmt: skip
    sid = worker.client.create_session("demo", guards=[guard]).session_id
    results = _call(worker, _message(sid, 1, list(x), last_only=True))
    assert not any(r.HasField("output") for r in results[:-1])
    assert_bit_equal(_outputs(results[-1:]), ref[-1:])
    flagged = [r.step for r in results if r.guard_events]
    assert flagged == [t + 1 for t in range(30) if ref[t, 0] > bound] and flagged


def test_a_run_refused_as_a_run_goes_step_by_step_and_still_answers_only_its_last(
    worker, served_models
):
    """A token out of range refuses the message's run: its steps go one by one, the bad
    one answered with its error and the rest applied; under last_outputs_only only the
    run's last step carries an output."""
    model = served_models["lm"]
    x = as_inputs(model, random_inputs(model, 12, seed=34))
    sid = worker.client.create_session("lm").session_id
    bad = [*x[:5], model.config.vocab_size + 3]
    results = _call(worker, _message(sid, 1, bad, last_only=True))
    assert [r.HasField("error") for r in results] == [False] * 5 + [True]
    assert not any(r.HasField("output") for r in results)  # the last one failed
    results = _call(worker, _message(sid, 6, x[5:12], last_only=True))
    assert [r.HasField("output") for r in results] == [False] * 6 + [True]
    assert_bit_equal(_outputs(results[-1:]), reference(model, np.asarray(x))[-1:])


def test_a_rollback_replays_by_prefill_to_the_bits_of_the_session_that_never_rolled_back(
    worker, served_models
):
    """300 steps, snapshots every 100; rollback to 250 replays 250..250 from the snapshot
    at 200 (50 steps, one prefill). The state, and the outputs of the next 20 steps, equal
    a session that took only the first 250 steps."""
    model = served_models["lm"]
    x = as_inputs(model, random_inputs(model, 320, seed=35))
    lane = worker.engine("lm")
    rolled = worker.client.create_session("lm", snapshot_every=100).session_id
    straight = worker.client.create_session("lm", snapshot_every=100).session_id
    list(worker.client.stream_steps(rolled, x[:300], steps_per_message=50))
    list(worker.client.stream_steps(straight, x[:250], steps_per_message=50))
    before = lane.prefilled_steps
    reply = worker.client.rollback(rolled, to_step=250)
    assert (reply.step, reply.replayed_steps) == (250, 50)
    assert lane.prefilled_steps - before == 50
    assert _state(worker, rolled).state.bit_equal(_state(worker, straight).state)
    a = [o.output for o in worker.client.stream_steps(rolled, x[250:270])]
    b = [o.output for o in worker.client.stream_steps(straight, x[250:270])]
    assert_bit_equal(np.stack(a), np.stack(b))
    assert_bit_equal(np.stack(a), reference(model, np.asarray(x[:270]))[250:])


def test_the_clients_prefill_and_last_outputs_only_stream(worker, served_models):
    model = served_models["lm"]
    x = as_inputs(model, random_inputs(model, 90, seed=36))
    ref = reference(model, np.asarray(x))
    sid = worker.client.create_session("lm").session_id
    last = worker.client.prefill(sid, x[:60])
    assert last.step == 60 and last.error is None
    assert_bit_equal(last.output, ref[59])
    outs = list(
        worker.client.stream_steps(sid, x[60:], steps_per_message=10, last_outputs_only=True)
    )
    assert [o.step for o in outs] == list(range(61, 91))
    assert [o.output.size > 0 for o in outs] == [t % 10 == 9 for t in range(30)]
    assert_bit_equal(np.stack([o.output for o in outs[9::10]]), ref[69::10])


def test_the_cli_streams_a_prompt_with_last_only_and_writes_one_row(
    worker, served_models, tmp_path, capsys
):
    model = served_models["lm"]
    x = random_inputs(model, 70, seed=37)
    np.save(tmp_path / "ids.npy", x)
    sid = worker.client.create_session("lm").session_id
    ids, out_path = str(tmp_path / "ids.npy"), str(tmp_path / "out.npy")
    argv = ["--server", worker.address, "session", "stream", sid, "--input", ids,
            "--output", out_path, "--last-only"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    out = np.load(tmp_path / "out.npy")
    assert out.shape == (1, model.config.output_dim)
    assert_bit_equal(out, reference(model, x)[-1:])
    assert worker.client.get_session(sid).step == 70
