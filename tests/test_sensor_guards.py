"""Guards for sensor faults through a real worker: prediction-error, rate and sustained
rules, IMPUTE; the same bits and the same decisions after a rollback, a reload from Redis
after a crash, in a forecast and in GetHistory; malformed rules refused.

The reference is the offline model stepped one input at a time with the guards' pure
functions (``stateful_guards``), which ``test_guards`` checks on their own.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from ssmserve.client.errors import InvalidArgument, StepFailed
from ssmserve.client.guards import guard_rule
from ssmserve.client.sync import Client
from ssmserve.server.api.conversions import guard_from_pb
from ssmserve.server.cluster.ownership import OwnershipSettings
from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.sessions.stateful_guards import initial_state, judge_input, judge_step
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs, write_model
from tests.test_observability import scrape, value
from tests.test_service import assert_bit_equal, stream
from tests.worker_process import WorkerProcess


def guarded_reference(model, rules, inputs):
    """Outputs as answered, events per step, and the inputs applied: ``inputs`` stepped
    one at a time through the offline model under ``rules`` (every step applied)."""
    rules = [guard_from_pb(r) for r in rules]
    c = model.config
    g = initial_state(rules, c.input_dim, c.output_dim)
    state = model.new_state()
    outputs, events, applied = [], [], []
    for t, x in enumerate(inputs, start=1):
        before = judge_input(rules, g, t, np.asarray(x, np.float32))
        assert before.applies_step, before.events
        y, state = model.run(before.applied[None], state)
        verdict = judge_step(rules, g, t, before, y[0])
        assert verdict.applies_step, verdict.events
        g = verdict.state
        outputs.append(verdict.output)
        events.append([(e.guard, e.action.name, e.dims) for e in verdict.events])
        applied.append(before.applied)
    return np.stack(outputs), events, np.stack(applied)


def served_events(outs):
    return [
        [(e.guard, pb.GuardRule.Action.Name(e.action).removeprefix("ACTION_"), tuple(e.dims))
         for e in o.guard_events]
        for o in outs
    ]  # fmt: skip


def calm_signal(model, n, seed):
    """A slow signal (a random walk): each input close to the one before."""
    rng = np.random.default_rng(seed)
    steps = 0.05 * rng.standard_normal((n, model.config.input_dim))
    return np.cumsum(steps, axis=0).astype(np.float32)


def floor_for(model, x):
    """A scale floor above every one-step error of the unguarded model on ``x``: no calm
    step breaks a prediction-error rule with tolerance >= 1."""
    y = model.run(x)[0]
    return float(np.abs(x[1:] - y[:-1]).max()) * 1.01


# ---------------------------------------------------------------------------- each check fires


def test_prediction_error_imputes_a_spike_and_a_rollback_replays_it_exactly(worker, served_models):
    model = served_models["demo"]
    x = calm_signal(model, 24, seed=1)
    floor = floor_for(model, x)
    x[10, 2] += 50 * floor  # step 11: a spike on channel 2
    x[17, 0] -= 50 * floor  # step 18: another on channel 0
    rule = guard_rule("spike", "prediction_error", "impute", tolerance=4, scale_floor=floor)
    sid = worker.client.create_session("demo", snapshot_every=4, guards=[rule]).session_id
    got, outs = stream(worker, sid, x, per_message=5)
    want, events, applied = guarded_reference(model, [rule], x)
    assert_bit_equal(got, want)
    assert served_events(outs) == events
    fired = {o.step: o.guard_events for o in outs if o.guard_events}
    assert sorted(fired) == [11, 18]
    (spike,) = fired[11]
    assert spike.action == pb.GuardRule.ACTION_IMPUTE and list(spike.dims) == [2]
    # The value put in is the previous step's answer: the model's forecast of step 11.
    assert np.float32(spike.imputed[0]) == got[9][2] == applied[10][2]
    assert "imputed" in spike.detail and "predicted" in spike.detail
    assert not np.array_equal(got[10], model.run(x[:11])[0][10])  # the spike never got in
    # Rolled back (the Rollback RPC) behind the spike and streamed again: the same bits
    # and the same decisions, replayed from the snapshot's guard state.
    # The replay starts at the newest kept snapshot at or before step 9: step 8's unless
    # the writer superseded it behind a slow write (snapshot_writer.MAX_WAITING). The
    # listing comes after the rollback, which waits for the writes to settle.
    reply = worker.client.rollback(sid, to_step=9)
    kept = [s.step for s in worker.client.list_snapshots(sid) if s.step <= 9]
    assert reply.step == 9 and reply.replayed_steps == 9 - max(kept)
    again, outs2 = stream(worker, sid, x[9:], first_step=10, per_message=3)
    assert_bit_equal(again, want[9:])
    assert served_events(outs2) == events[9:]
    # GetHistory replays the same answers; its inputs are those the client sent.
    h = worker.client.history(sid, from_step=9, to_step=24)
    assert_bit_equal(h.outputs, want[8:])
    assert_bit_equal(h.inputs, x[8:])
    # A resend of the imputed step is answered with what was answered.
    assert_bit_equal(worker.client.step(sid, x[17], step=18).output, want[17])


def test_a_stuck_sensor_held_for_k_steps_rolls_the_session_back(worker, served_models):
    model = served_models["demo"]
    x = calm_signal(model, 20, seed=2)
    floor = floor_for(model, x)
    stuck = x.copy()
    stuck[12:, 1] = x[11, 1] + 30 * floor  # from step 13 channel 1 reads a frozen value
    rule = guard_rule(
        "stuck", "prediction_error", "rollback", tolerance=3, scale_floor=floor, sustained=3,
        dims=[1],
    )  # fmt: skip
    sid = worker.client.create_session("demo", snapshot_every=4, guards=[rule]).session_id
    _got, outs = stream(worker, sid, stuck[:14], per_message=1)  # steps 13, 14: broken, held
    assert not any(o.guard_events for o in outs)
    with pytest.raises(StepFailed) as err:
        worker.client.step(sid, stuck[14], step=15)  # the third in a row: it fires
    assert err.value.reason == "GUARD_ROLLED_BACK"
    (event,) = err.value.result.guard_events
    assert event.step == 15 and event.rolled_back_to == 12 and "3 steps in a row" in event.detail
    assert worker.client.get_session(sid).step == 12
    # The session is back at step 12 exactly: the calm signal from there is the
    # uninterrupted guarded run's.
    again, outs2 = stream(worker, sid, x[12:], first_step=13)
    want, events, _ = guarded_reference(model, [rule], x)
    assert_bit_equal(again, want[12:])
    assert served_events(outs2) == events[12:] and not any(events)


def test_input_rate_rejects_and_output_rate_clamps(worker, served_models):
    model = served_models["demo"]
    x = calm_signal(model, 12, seed=3)
    jump = float(np.abs(np.diff(x, axis=0)).max()) * 1.01
    y = model.run(x)[0]
    out_rate = float(np.median(np.abs(np.diff(y, axis=0)))) or 1e-3  # breaks on some steps
    rules = [
        guard_rule("jump", "rate", "reject", side="input", max_rate=jump),
        guard_rule("slew", "rate", "clamp", max_rate=out_rate),
    ]
    sid = worker.client.create_session("demo", guards=rules).session_id
    got, outs = stream(worker, sid, x[:8])
    want, events, _ = guarded_reference(model, rules, x[:8])
    assert_bit_equal(got, want)
    assert served_events(outs) == events
    clamped = [o for o in outs if o.guard_events]
    assert clamped and all(e.guard == "slew" for o in clamped for e in o.guard_events)
    assert np.all(np.abs(np.diff(got, axis=0)) <= out_rate * (1 + 1e-6))
    bad = x[8].copy()
    bad[3] += 10 * jump
    with pytest.raises(StepFailed) as err:
        worker.client.step(sid, bad, step=9)
    assert err.value.reason == "GUARD_REJECTED" and "rejected its input" in str(err.value)
    (event,) = err.value.result.guard_events
    assert event.guard == "jump" and list(event.dims) == [3]
    assert not err.value.result.HasField("output")  # the model never ran it
    assert worker.client.get_session(sid).step == 8  # nothing changed
    more, outs2 = stream(worker, sid, x[8:], first_step=9)
    want, events, _ = guarded_reference(model, rules, x)
    assert_bit_equal(more, want[8:])
    assert served_events(outs2) == events[8:]


def test_impute_is_counted_and_recorded(start_worker, served_models):
    model = served_models["demo"]
    w = start_worker(metrics_listen="127.0.0.1:0")
    x = calm_signal(model, 6, seed=4)
    x[4] = 100.0
    rule = guard_rule("range", "range", "impute", side="input", min=-50, max=50)
    sid = w.client.create_session("demo", guards=[rule]).session_id
    _got, outs = stream(w, sid, x)
    assert [len(o.guard_events) for o in outs] == [0, 0, 0, 0, 1, 0]
    assert value(scrape(w), "ssmserve_guard_events_total", action="impute") == 1
    recorded = [e for e in w.client.history(sid).events if e.kind == "guard"]
    assert [(e.step, e.guard, e.action) for e in recorded] == [(5, "range", "impute")]


# ---------------------------------------------------------------------------- crash, forecast


def test_a_crashed_workers_guarded_session_continues_with_the_same_bits_and_decisions(
    start_worker, served_models
):
    """Killed without its shutdown snapshots: the next worker loads the session from the
    newest snapshot (step 15, with its guard state) and the logged inputs as sent, judges
    steps 16 and 17 again (17 was imputed) and goes on as the uninterrupted run; step 13,
    imputed before that snapshot, is judged again by the replays from step 10."""
    model = served_models["demo"]
    x = calm_signal(model, 24, seed=5)
    floor = floor_for(model, x)
    x[12, 3] += 40 * floor  # step 13: imputed, after the snapshot at 10
    x[16, 1] -= 40 * floor  # step 17: imputed, after the snapshot at 15
    x[19:22, 0] += 40 * floor  # steps 20..22: a stuck channel, imputed each step
    rules = [
        guard_rule("spike", "prediction_error", "impute", tolerance=4, scale_floor=floor),
        guard_rule("slew", "rate", "report", max_rate=float(floor)),
    ]
    first = start_worker(ownership=OwnershipSettings(lease_ttl_s=0.4))
    second = start_worker()
    sid = first.client.create_session("demo", snapshot_every=5, guards=rules).session_id
    got, outs = stream(first, sid, x[:15], per_message=4)
    assert [s.step for s in first.client.list_snapshots(sid)] == [0, 5, 10, 15]
    more, outs2 = stream(first, sid, x[15:17], first_step=16)
    first.crash()
    deadline = time.monotonic() + 10
    while second.client.get_session(sid).resident:  # the dead worker's lease runs out
        assert time.monotonic() < deadline, "the crashed worker's lease never ran out"
        time.sleep(0.05)
    rest, outs3 = stream(second, sid, x[17:], first_step=18)
    want, events, _ = guarded_reference(model, rules, x)
    assert_bit_equal(np.concatenate([got, more, rest]), want)
    assert served_events(outs + outs2 + outs3) == events
    assert all(any(e[0] == "spike" for e in events[t]) for t in (12, 16, 19, 20, 21))
    # The outputs of the steps replayed on load are the ones answered before the crash.
    assert_bit_equal(second.client.step(sid, x[12], step=13).output, want[12])
    assert_bit_equal(second.client.history(sid, from_step=11, to_step=17).outputs, want[10:17])
    # Imputed at three steps in a row, replayed (from the snapshot at 15) step by step.
    assert_bit_equal(second.client.history(sid, from_step=16, to_step=24).outputs, want[15:])


def test_forecasts_and_forks_judge_as_the_session_would(worker, served_models):
    """A forecast equals stepping a fork with its own answers, guards and all."""
    model = served_models["demo"]
    x = calm_signal(model, 10, seed=6)
    floor = floor_for(model, x)
    rules = [
        guard_rule("spike", "prediction_error", "impute", tolerance=4, scale_floor=floor),
        guard_rule("slew", "rate", "clamp", max_rate=0.05, sustained=2),
    ]
    sid = worker.client.create_session("demo", snapshot_every=4, guards=rules).session_id
    stream(worker, sid, x)
    ahead = worker.client.forecast(sid, 6, at_step=7)
    fork = worker.client.fork(sid, at_step=7).session.session_id
    fed, last = [], worker.client.history(sid, from_step=7, to_step=7).outputs[0]
    for step in range(8, 14):
        out = worker.client.step(fork, last, step=step)
        fed.append(out)
        last = out.output
    assert ahead.guard_events  # the slew rule clamps some of them
    assert_bit_equal(ahead.outputs, np.stack([o.output for o in fed]))
    assert [list(e.dims) for e in ahead.guard_events] == [
        list(e.dims) for o in fed for e in o.guard_events
    ]


# ---------------------------------------------------------------------------- malformed rules


@pytest.mark.parametrize(
    ("model", "rule", "words"),
    [
        ("demo", guard_rule("g", "prediction_error", "impute", scale_floor=0.1), "tolerance > 0"),
        ("demo", guard_rule("g", "prediction_error", tolerance=2), "scale_floor > 0"),
        ("demo", guard_rule("g", "rate", max_rate=-1), "max_rate > 0"),
        ("demo", guard_rule("g", "range", max=1, sustained=0), "sustained must be between 1"),
        ("demo", guard_rule("g", "range", "impute", max=1), "IMPUTE replaces an input"),
        ("demo", guard_rule("g", "range", "clamp", side="input", max=1), "CLAMP clips an output"),
        ("demo", guard_rule("g", "finite", side="input"), "inputs are always finite"),
        (
            "demo",
            guard_rule("g", "prediction_error", tolerance=2, scale_floor=1, decay=1.5),
            "decay must be in",
        ),
        ("demo", guard_rule("g", "rate", max_rate=1, tolerance=2), "not tolerance"),
        (
            "odd",
            guard_rule("g", "prediction_error", tolerance=2, scale_floor=1),
            "needs output_dim == input_dim",
        ),
        (
            "odd",
            guard_rule("g", "range", "impute", side="input", max=1),
            "needs output_dim == input_dim",
        ),
        ("lm", guard_rule("g", "rate", side="input", max_rate=1), "takes token ids"),
    ],
)
def test_malformed_rules_are_invalid_argument_and_change_nothing(worker, model, rule, words):
    before = worker.client.list_sessions()
    with pytest.raises(InvalidArgument, match=words) as err:
        worker.client.create_session(model, guards=[rule])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert worker.client.list_sessions() == before


def test_stateful_rules_round_trip_through_session_info(worker):
    rules = [
        guard_rule("spike", "prediction_error", "impute", tolerance=6, scale_floor=0.05),
        guard_rule("stuck", "rate", "rollback", side="input", max_rate=2, sustained=4, dims=[1]),
    ]
    info = worker.client.create_session("demo", guards=rules)
    got = list(worker.client.get_session(info.session_id).config.guards)
    assert got[0].side == pb.GuardRule.SIDE_INPUT and got[0].decay == pytest.approx(0.9)
    assert (got[0].tolerance, got[0].scale_floor, got[0].HasField("sustained")) == (6, 0.05, False)
    assert (got[1].side, got[1].max_rate, got[1].sustained, list(got[1].dims)) == (
        pb.GuardRule.SIDE_INPUT, 2.0, 4, [1],
    )  # fmt: skip


@pytest.mark.slow
def test_kill_9_of_the_worker_process_loses_no_decision(
    model_dirs, served_models, redis_url, tmp_path
):
    """A real ``ssmserve-server`` process killed with SIGKILL after an imputed step that
    no snapshot holds: started again, it loads the session from Redis (the snapshot's
    guard state and the logged inputs as sent) and goes on with the same bits and events."""
    model = served_models["demo"]
    x = calm_signal(model, 20, seed=7)
    floor = floor_for(model, x)
    x[9, 0] += 40 * floor  # step 10: imputed, after the snapshot at 8
    x[14:17, 2] -= 40 * floor  # steps 15..17: imputed each, and held for the report
    rules = [
        guard_rule("spike", "prediction_error", "impute", tolerance=4, scale_floor=floor),
        guard_rule("held", "prediction_error", "report", tolerance=4, scale_floor=floor,
                   sustained=2),
    ]  # fmt: skip
    want, events, _ = guarded_reference(model, rules, x)
    w = WorkerProcess({"demo": model_dirs["demo"]}, redis_url, tmp_path / "w", lease_ttl_s=0.5)
    w.start()
    try:
        with Client(w.address) as client:
            sid = client.create_session("demo", snapshot_every=8, guards=rules).session_id
            outs = list(client.stream_steps(sid, list(x[:11])))
        w.kill()
        w.start()
        with Client(w.address) as client:
            outs += list(client.stream_steps(sid, list(x[11:]), first_step=12))
            resent = client.step(sid, x[9], step=10)
        assert_bit_equal(np.stack([o.output for o in outs]), want)
        assert served_events(outs) == events
        assert resent.replayed and resent.output.tobytes() == want[9].tobytes()
    finally:
        w.kill()


def test_a_token_sessions_sustained_output_rule_replays_exactly(worker, served_models):
    """Stateful rules on a token model's logits (a sustained range): rolled back and fed
    again, the same logits and the same events."""
    model = served_models["lm"]
    ids = random_inputs(model, 16, seed=8)
    logits = model.run(ids)[0]
    top = float(np.median(logits.max(axis=1)))  # about half the steps break it
    rule = guard_rule("hot", "range", "report", max=top, sustained=2)
    sid = worker.client.create_session("lm", snapshot_every=4, guards=[rule]).session_id
    outs = list(worker.client.stream_steps(sid, [int(t) for t in ids]))
    assert_bit_equal(np.stack([o.output for o in outs]), logits)  # REPORT changes nothing
    fired = [o.step for o in outs if o.guard_events]
    # a dim above ``top`` at two steps in a row (the counts are per dim)
    held = [t for t in range(2, 17) if (logits[t - 2 : t] > top).all(axis=0).any()]
    assert fired == held and fired
    worker.client.rollback(sid, to_step=6)
    again = list(worker.client.stream_steps(sid, [int(t) for t in ids[6:]], first_step=7))
    assert_bit_equal(np.stack([o.output for o in again]), logits[6:])
    assert served_events(again) == served_events(outs[6:])


def test_an_exported_session_imported_goes_on_with_its_guard_state(worker, served_models):
    model = served_models["demo"]
    x = calm_signal(model, 16, seed=9)
    floor = floor_for(model, x)
    x[11, 1] += 40 * floor  # step 12: imputed after the import at 8
    rules = [
        guard_rule("spike", "prediction_error", "impute", tolerance=4, scale_floor=floor),
        guard_rule("slew", "rate", "report", side="input", max_rate=floor, sustained=2),
    ]
    want, events, _ = guarded_reference(model, rules, x)
    sid = worker.client.create_session("demo", guards=rules).session_id
    stream(worker, sid, x[:8])
    blob = worker.client.export_checkpoint(sid)
    worker.client.close_session(sid)
    copy = worker.client.import_checkpoint(
        blob, session_id="copy", config=pb.SessionConfig(guards=rules)
    ).session_id
    got, outs = stream(worker, copy, x[8:], first_step=9)
    assert_bit_equal(got, want[8:])
    assert served_events(outs) == events[8:]


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two versions of "sig": the demo model's shapes, other weights."""
    root = tmp_path_factory.mktemp("sig-versions")
    return {
        f"sig@{v}": (root / v, write_model(root / v, demo_config(DemoSpec()), seed))
        for v, seed in (("1", 101), ("2", 102))
    }


def test_an_upgrade_judges_the_kept_inputs_again_through_the_new_version(redis_url, versions):
    """Upgrade replays the kept inputs through the new version from a fresh guard state:
    the session is then what the new version, guarded from its first step, makes of them."""
    from tests.harness import WorkerHarness

    v1, v2 = versions["sig@1"][1], versions["sig@2"][1]
    x = calm_signal(v1, 24, seed=10)
    floor = floor_for(v1, x)
    x[11, 2] += 60 * floor  # step 12: imputed by both versions
    rules = [guard_rule("spike", "prediction_error", "impute", tolerance=4, scale_floor=floor)]
    w = WorkerHarness({k: versions[k][0] for k in ("sig@1", "sig@2")}, redis_url)
    try:
        sid = w.client.create_session(
            "sig@1", snapshot_every=8, max_snapshots=64, guards=rules
        ).session_id
        stream(w, sid, x[:16])
        assert w.client.upgrade(sid).replayed_steps == 16
        got, outs = stream(w, sid, x[16:], first_step=17)
        want, events, _ = guarded_reference(v2, rules, x)
        assert_bit_equal(got, want[16:])
        assert served_events(outs) == events[16:]
        assert any(e[0] == "spike" for e in events[11])
        assert_bit_equal(w.client.step(sid, x[15], step=16).output, want[15])
    finally:
        w.stop()
