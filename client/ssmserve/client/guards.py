"""Guard rules by name, for ``create_session(..., guards=[...])`` and the CLI's ``--guard``.

    from ssmserve.client.guards import guard_rule

    guards = [
        # a spike: the input departs from the model's one-step prediction; put the
        # prediction in its place and go on
        guard_rule("spike", "prediction_error", "impute", tolerance=6, scale_floor=0.05),
        # a stuck sensor: far from the prediction for 5 steps in a row; roll back
        guard_rule("stuck", "prediction_error", "rollback", tolerance=3, scale_floor=0.05,
                   sustained=5),
        guard_rule("bounds", "range", "clamp", min=-3, max=3),
    ]

Each argument is a field of ``ssmserve.v1.GuardRule`` (docs/api.md#guards); fields left
out take the worker's defaults. A name that is no check, action or side raises ValueError
here; the worker checks the rest (INVALID_ARGUMENT, saying what is wrong).
"""

from __future__ import annotations

from collections.abc import Iterable

from ssmserve.v1 import ssmserve_pb2 as pb

CHECKS = {
    "finite": pb.GuardRule.CHECK_FINITE,
    "range": pb.GuardRule.CHECK_RANGE,
    "rate": pb.GuardRule.CHECK_RATE,
    "prediction_error": pb.GuardRule.CHECK_PREDICTION_ERROR,
}
ACTIONS = {
    "report": pb.GuardRule.ACTION_REPORT,
    "clamp": pb.GuardRule.ACTION_CLAMP,
    "impute": pb.GuardRule.ACTION_IMPUTE,
    "reject": pb.GuardRule.ACTION_REJECT,
    "rollback": pb.GuardRule.ACTION_ROLLBACK,
}
SIDES = {"output": pb.GuardRule.SIDE_OUTPUT, "input": pb.GuardRule.SIDE_INPUT}


def _named(kind: str, table: dict[str, int], name: str) -> int:
    key = name.strip().lower().replace("-", "_")
    if key not in table:
        raise ValueError(f"{kind} must be one of {', '.join(table)}, not {name!r}")
    return table[key]


def guard_rule(
    name: str,
    check: str,
    action: str = "report",
    *,
    side: str | None = None,
    dims: Iterable[int] = (),
    min: float | None = None,  # named as the message's fields, builtins shadowed here
    max: float | None = None,
    max_rate: float | None = None,
    tolerance: float | None = None,
    decay: float | None = None,
    scale_floor: float | None = None,
    sustained: int | None = None,
) -> pb.GuardRule:
    """A ``GuardRule``: ``check`` finite | range | rate | prediction_error, ``action``
    report | clamp | impute | reject | rollback, ``side`` input | output (default: input
    for prediction_error, output for the others), ``dims`` of that side (default: all),
    and the check's own fields (range: ``min``/``max``; rate: ``max_rate``;
    prediction_error: ``tolerance``, ``decay``, ``scale_floor``); ``sustained`` k fires
    only after k consecutive broken steps."""
    rule = pb.GuardRule(
        name=name,
        check=_named("check", CHECKS, check),  # type: ignore[arg-type]
        action=_named("action", ACTIONS, action),  # type: ignore[arg-type]
        dims=[int(d) for d in dims],
    )
    if side is not None:
        rule.side = _named("side", SIDES, side)  # type: ignore[assignment]
    fields = {
        "min": min,
        "max": max,
        "max_rate": max_rate,
        "tolerance": tolerance,
        "decay": decay,
        "scale_floor": scale_floor,
    }
    for field, value in fields.items():
        if value is not None:
            setattr(rule, field, float(value))
    if sustained is not None:
        rule.sustained = int(sustained)
    return rule
