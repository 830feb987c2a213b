"""Guard checks on their own: which dims break, clamping, NaN, the strongest action wins;
the stateful ones (input checks, RATE, sustained, IMPUTE) step by step, as pure functions
of the guard state."""

from __future__ import annotations

import numpy as np
import pytest

from ssmserve.server.sessions.guards import (
    GuardAction,
    GuardCheck,
    GuardRule,
    GuardRuleError,
    GuardSide,
    check_output,
    stronger,
)
from ssmserve.server.sessions.stateful_guards import (
    initial_state,
    judge_input,
    judge_step,
    state_of_checkpoint,
)


def rule(check, action, **kw):
    return GuardRule(name=kw.pop("name", "g"), check=check, action=action, **kw)


def test_no_rules_and_no_violation_return_the_output_itself():
    out = np.array([0.5, -0.5], np.float32)
    assert check_output([], 1, out).output is out
    verdict = check_output([rule(GuardCheck.RANGE, GuardAction.REJECT, min=-1, max=1)], 1, out)
    assert verdict.output is out and verdict.action is None and verdict.applies_step


def test_finite_check_finds_nan_and_inf_and_clamps_them():
    out = np.array([np.nan, 1.0, np.inf, -np.inf], np.float32)
    verdict = check_output([rule(GuardCheck.FINITE, GuardAction.CLAMP)], 7, out)
    (event,) = verdict.events
    assert event.dims == (0, 2, 3) and event.step == 7 and "not finite" in event.detail
    big = np.finfo(np.float32).max
    np.testing.assert_array_equal(verdict.output, [0.0, 1.0, big, -big])
    assert np.isnan(out[0])  # the model's output is never modified


def test_range_on_chosen_dims_with_nan_outside():
    out = np.array([5.0, np.nan, -5.0], np.float32)
    r = rule(GuardCheck.RANGE, GuardAction.CLAMP, min=-1.0, max=2.0, dims=(1, 2))
    verdict = check_output([r], 1, out)
    assert verdict.events[0].dims == (1, 2)  # dim 0 is not watched
    np.testing.assert_array_equal(verdict.output, [5.0, -1.0, -1.0])


def test_strongest_action_wins():
    out = np.array([3.0], np.float32)
    rules = [
        rule(GuardCheck.RANGE, GuardAction.REPORT, max=1.0, name="a"),
        rule(GuardCheck.RANGE, GuardAction.ROLLBACK, max=2.0, name="b"),
        rule(GuardCheck.RANGE, GuardAction.REJECT, max=2.5, name="c"),
    ]
    verdict = check_output(rules, 1, out)
    assert verdict.action == GuardAction.ROLLBACK and not verdict.applies_step
    assert [e.guard for e in verdict.events] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("r", "words"),
    [
        (rule(GuardCheck.RANGE, GuardAction.REPORT), "needs min, max or both"),
        (rule(GuardCheck.RANGE, GuardAction.REPORT, min=2.0, max=1.0), "is above max"),
        (rule(GuardCheck.RANGE, GuardAction.REPORT, max=float("nan")), "finite numbers"),
        (rule(GuardCheck.FINITE, GuardAction.REPORT, max=1.0), "takes no bounds"),
        (rule(GuardCheck.FINITE, GuardAction.REPORT, dims=(4,)), "dim 4 does not exist"),
        (rule(GuardCheck.FINITE, GuardAction.REPORT, dims=(1, 1)), "listed twice"),
        (rule(GuardCheck.FINITE, GuardAction.REPORT, name=""), "name"),
    ],
)
def test_malformed_rules(r, words):
    with pytest.raises(GuardRuleError, match=words):
        r.validate(output_dim=4)


# ---------------------------------------------------------------------------- stateful guards


def pred_rule(action=GuardAction.REPORT, **kw):
    fields = {"tolerance": 4.0, "decay": 0.5, "scale_floor": 0.1, "side": GuardSide.INPUT}
    fields.update(kw)
    return rule(GuardCheck.PREDICTION_ERROR, action, **fields)


def step_once(rules, g, step, x, y):
    """One applied-or-not step: the input judged, the model "ran" and gave ``y``."""
    before = judge_input(rules, g, step, np.asarray(x, np.float32))
    if not before.applies_step:
        return before, None
    return before, judge_step(rules, g, step, before, np.asarray(y, np.float32))


def test_the_order_of_strength():
    order = sorted(GuardAction, key=lambda a: a.strength)
    assert order == [
        GuardAction.REPORT, GuardAction.CLAMP, GuardAction.IMPUTE, GuardAction.REJECT,
        GuardAction.ROLLBACK,
    ]  # fmt: skip
    assert [a.applies_step for a in order] == [True, True, True, False, False]
    assert stronger(GuardAction.IMPUTE, GuardAction.CLAMP) == GuardAction.IMPUTE
    assert stronger(None, GuardAction.REPORT) == GuardAction.REPORT


def test_prediction_error_scale_follows_the_stated_update_rule():
    """scale <- max(floor, decay * scale + (1 - decay) * |x - p|) where the check passed;
    held where it broke, where it had no prediction, and where the input was imputed."""
    r = pred_rule(dims=(0, 1))
    rules = [r]
    g = initial_state(rules, 2, 2)
    assert g is not None and g.rules[0].scale.tolist() == [0.1, 0.1]
    # step 1: no prediction yet, nothing judged, the scale stays at the floor
    before, after = step_once(rules, g, 1, [1.0, 2.0], [1.1, 2.0])
    assert before.events == () and after.state.rules[0].scale.tolist() == [0.1, 0.1]
    g = after.state
    assert g.last_output.tolist() == pytest.approx([1.1, 2.0])
    # step 2: errors |1.3 - 1.1| = 0.2 (<= 4 x 0.1: learns) and |5 - 2| = 3 (breaks: held)
    before, after = step_once(rules, g, 2, [1.3, 5.0], [1.0, 1.0])
    (event,) = before.events
    assert (
        event.dims == (1,) and event.action == GuardAction.REPORT and "predicted 2" in event.detail
    )
    e = abs(np.float64(np.float32(1.3)) - np.float64(np.float32(1.1)))
    want = max(0.1, 0.5 * 0.1 + 0.5 * e)
    assert after.state.rules[0].scale.tolist() == [want, 0.1]
    # a small error pulls the scale down, never below the floor
    g = after.state
    _before, after = step_once(rules, g, 3, [1.0, 1.0], [1.0, 1.0])
    assert after.state.rules[0].scale.tolist() == [max(0.1, 0.5 * want), 0.1]


def test_impute_puts_the_forecast_in_and_does_not_teach_the_scale():
    rules = [pred_rule(GuardAction.IMPUTE)]
    g = initial_state(rules, 3, 3, np.zeros(3, np.float32), np.array([0.5, 0.5, 0.5], np.float32))
    before, after = step_once(rules, g, 9, [0.6, 30.0, 0.4], [0.7, 0.7, 0.7])
    (event,) = before.events
    assert event.action == GuardAction.IMPUTE and event.dims == (1,) and event.imputed == (0.5,)
    assert before.applied.tolist() == [np.float32(0.6), 0.5, np.float32(0.4)]
    assert before.applied.dtype == np.float32 and before.sent[1] == 30.0  # as sent, kept
    assert after.applies_step and after.action == GuardAction.IMPUTE
    assert after.state.last_input.tolist() == before.applied.tolist()  # as applied
    scale = after.state.rules[0].scale
    assert scale[1] == 0.1 and scale[0] > 0.1 - 1e-12  # the imputed dim learned nothing


def test_impute_without_a_forecast_rejects():
    r = rule(GuardCheck.RANGE, GuardAction.IMPUTE, side=GuardSide.INPUT, max=1.0)
    g = initial_state([r], 2, 2)  # the first step: no output yet
    before = judge_input([r], g, 1, np.array([5.0, 0.0], np.float32))
    (event,) = before.events
    assert before.action == GuardAction.REJECT and not before.applies_step
    assert "no finite forecast" in event.detail


def test_input_rate_compares_with_the_input_applied_before():
    r = rule(GuardCheck.RATE, GuardAction.REJECT, side=GuardSide.INPUT, max_rate=1.0)
    g = initial_state([r], 2, 2)
    before, after = step_once([r], g, 1, [5.0, 5.0], [0.0, 0.0])  # first step: no change
    assert before.events == () and after.applies_step
    before, after = step_once([r], after.state, 2, [5.5, 7.0], [0.0, 0.0])
    assert after is None and before.action == GuardAction.REJECT
    assert before.events[0].dims == (1,) and "changed by more than 1" in before.events[0].detail


def test_output_rate_clamps_to_the_last_answer():
    r = rule(GuardCheck.RATE, GuardAction.CLAMP, max_rate=0.5)
    g = initial_state([r], 2, 2)
    _b, first = step_once([r], g, 1, [0.0, 0.0], [1.0, 1.0])
    _b, second = step_once([r], first.state, 2, [0.0, 0.0], [3.0, 1.2])
    assert second.action == GuardAction.CLAMP and second.events[0].dims == (0,)
    assert second.output.tolist() == [1.5, np.float32(1.2)]
    assert second.state.last_output.tolist() == [1.5, np.float32(1.2)]  # as answered


def test_sustained_fires_after_k_consecutive_broken_steps_and_resets():
    r = rule(GuardCheck.RANGE, GuardAction.REPORT, max=1.0, sustained=3)
    g = initial_state([r], 1, 1)
    fired = []
    for step, y in enumerate([2.0, 2.0, 2.0, 2.0, 0.0, 2.0, 2.0, 2.0], start=1):
        _b, v = step_once([r], g, step, [0.0], [y])
        fired.append(bool(v.events))
        g = v.state
    assert fired == [False, False, True, True, False, False, False, True]
    assert "3 steps in a row" in v.events[0].detail


def test_a_refused_step_changes_no_guard_state():
    counting = rule(GuardCheck.RANGE, GuardAction.REPORT, max=1.0, sustained=5, name="c")
    refusing = rule(GuardCheck.RANGE, GuardAction.REJECT, max=3.0, name="r")
    rules = [counting, refusing]
    g = initial_state(rules, 1, 1)
    _b, v = step_once(rules, g, 1, [0.0], [5.0])  # both break: REJECT, not applied
    assert not v.applies_step and v.state is g


def test_check_output_is_unchanged_for_plain_rules():
    out = np.array([5.0, 0.0], np.float32)
    r = rule(GuardCheck.RANGE, GuardAction.CLAMP, max=1.0)
    assert not r.stateful and initial_state([r], 2, 2) is None
    assert check_output([r], 1, out).output.tolist() == [1.0, 0.0]


def test_rules_round_trip_through_their_stored_form():
    rules = [
        pred_rule(GuardAction.IMPUTE, sustained=2, dims=(1,)),
        rule(GuardCheck.RATE, GuardAction.CLAMP, max_rate=0.25),
        rule(GuardCheck.RANGE, GuardAction.REPORT, min=-1.0),
    ]
    assert [GuardRule.from_dict(r.to_dict()) for r in rules] == rules
    # a rule stored before these fields existed reads with their defaults
    assert set(rules[2].to_dict()) == {"name", "check", "action", "min", "max", "dims"}


def test_a_checkpoints_guard_state_is_used_when_it_fits_else_rebuilt():
    from ssmserve.server.state.checkpoint import Checkpoint, GuardState, InputHistory, RuleState

    rules = [pred_rule()]

    def ckpt(guards):
        return Checkpoint(
            "s", 2, "m", "f", None, InputHistory(1, np.ones((2, 2), np.float32)),  # type: ignore[arg-type]
            output=np.array([3.0, 4.0], np.float32), guards=guards,
        )  # fmt: skip

    fresh = state_of_checkpoint(ckpt(None), rules, 2, 2)
    assert fresh.last_input.tolist() == [1.0, 1.0] and fresh.last_output.tolist() == [3.0, 4.0]
    assert fresh.rules[0].scale.tolist() == [0.1, 0.1]
    own = GuardState(
        np.zeros(2, np.float32), np.zeros(2, np.float32), (RuleState("g", np.array([0.7, 0.2])),)
    )
    assert state_of_checkpoint(ckpt(own), rules, 2, 2).rules[0].scale.tolist() == [0.7, 0.2]
    below_floor = GuardState(
        own.last_input, own.last_output, (RuleState("g", np.array([0.01, 1])),)
    )
    assert state_of_checkpoint(ckpt(below_floor), rules, 2, 2).rules[0].scale.tolist() == [0.1, 0.1]


@pytest.mark.parametrize(
    ("r", "dims", "words"),
    [
        (rule(GuardCheck.RANGE, GuardAction.IMPUTE, max=1.0), (4, 4), "IMPUTE replaces an input"),
        (pred_rule(side=GuardSide.OUTPUT), (4, 4), "set side to input"),
        (pred_rule(), (5, 3), "needs output_dim == input_dim"),
        (
            rule(GuardCheck.RANGE, GuardAction.IMPUTE, side=GuardSide.INPUT, max=1.0),
            (5, 3),
            "needs output_dim == input_dim",
        ),
        (pred_rule(tolerance=0.0), (4, 4), "tolerance > 0"),
        (pred_rule(tolerance=float("inf")), (4, 4), "finite numbers"),
        (pred_rule(decay=1.0), (4, 4), r"decay must be in \[0, 1\)"),
        (pred_rule(scale_floor=0.0), (4, 4), "scale_floor > 0"),
        (pred_rule(scale_floor=None), (4, 4), "scale_floor > 0"),
        (pred_rule(sustained=0), (4, 4), "sustained must be between 1"),
        (pred_rule(sustained=70000), (4, 4), "sustained must be between 1"),
        (pred_rule(dims=(4,)), (4, 4), "input dim 4 does not exist"),
        (pred_rule(max=1.0), (4, 4), "takes decay, scale_floor, tolerance, not max"),
        (rule(GuardCheck.RATE, GuardAction.REPORT, max_rate=-1.0), (4, 4), "max_rate > 0"),
        (rule(GuardCheck.RATE, GuardAction.REPORT), (4, 4), "max_rate > 0"),
        (rule(GuardCheck.RANGE, GuardAction.REPORT, max=1.0, max_rate=2.0), (4, 4), "not max_rate"),
        (
            rule(GuardCheck.RANGE, GuardAction.CLAMP, side=GuardSide.INPUT, max=1.0),
            (4, 4),
            "CLAMP clips an output",
        ),
        (
            rule(GuardCheck.FINITE, GuardAction.REPORT, side=GuardSide.INPUT),
            (4, 4),
            "inputs are always finite",
        ),
        (
            rule(GuardCheck.RATE, GuardAction.REPORT, side=GuardSide.INPUT, max_rate=1.0),
            (0, 9),
            "takes token ids",
        ),
    ],
)
def test_malformed_stateful_rules(r, dims, words):
    input_dim, output_dim = dims
    with pytest.raises(GuardRuleError, match=words):
        r.validate(output_dim, input_dim)
