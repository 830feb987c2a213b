"""Guard checks on their own: which dims break, clamping, NaN, the strongest action wins."""

from __future__ import annotations

import numpy as np
import pytest

from ssmserve.server.sessions.guards import (
    GuardAction,
    GuardCheck,
    GuardRule,
    GuardRuleError,
    check_output,
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
