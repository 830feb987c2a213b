"""Guards: a built-in constraint monitor that checks every output of a session.

A rule looks at some output dims (or all) and checks that they are finite, or inside
``[min, max]`` (either bound optional; a NaN is never inside a range). When it is broken
the rule's action decides what happens to the step:

- ``REPORT``: the step is answered as usual, with a :class:`GuardEvent`.
- ``CLAMP``: the returned output is clipped into range (NaN becomes the lower bound, or
  the upper, or 0), and an event is reported. The session's state is the model's; only
  the answer changes.
- ``REJECT``: the step is not applied; the client gets an error and may send another input.
- ``ROLLBACK``: the step is not applied and the session returns to its newest snapshot
  taken before the violation (the event says which step).

Rules are checked in order; the strongest action among the broken rules wins
(ROLLBACK > REJECT > CLAMP > REPORT). Checking is pure and deterministic, so replaying a
step yields the same verdict and the same clamped output.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ssmserve.server.errors import SsmserveError, clip

MAX_RULES = 32
MAX_DIMS = 4096  # per rule: keeps a session's settings far below a message's size


class GuardCheck(enum.IntEnum):
    FINITE = 1
    RANGE = 2


class GuardAction(enum.IntEnum):
    """Ordered by strength: the strongest broken rule decides."""

    REPORT = 1
    CLAMP = 2
    REJECT = 3
    ROLLBACK = 4


class GuardRuleError(SsmserveError):
    """A guard rule is malformed (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class GuardRule:
    name: str
    check: GuardCheck
    action: GuardAction
    min: float | None = None
    max: float | None = None
    dims: tuple[int, ...] = ()  # empty: every output dim

    def validate(self, output_dim: int) -> None:
        where = f"guard {clip(self.name)}"
        if not self.name or len(self.name) > 64:
            raise GuardRuleError(f"{where}: a name of 1 to 64 characters is required")
        if self.check == GuardCheck.RANGE:
            if self.min is None and self.max is None:
                raise GuardRuleError(f"{where}: a range check needs min, max or both")
            for bound in (self.min, self.max):
                if bound is not None and not math.isfinite(bound):
                    raise GuardRuleError(f"{where}: bounds must be finite numbers")
            if self.min is not None and self.max is not None and self.min > self.max:
                raise GuardRuleError(f"{where}: min {self.min} is above max {self.max}")
        elif self.min is not None or self.max is not None:
            raise GuardRuleError(f"{where}: a finite check takes no bounds")
        if len(self.dims) > MAX_DIMS:
            raise GuardRuleError(
                f"{where}: at most {MAX_DIMS} dims per rule (got {len(self.dims)}); leave "
                f"dims empty to check every output dim"
            )
        bad = [d for d in self.dims if not 0 <= d < output_dim]
        if bad:
            raise GuardRuleError(
                f"{where}: output dim {bad[0]} does not exist (the model has {output_dim})"
            )
        if len(set(self.dims)) != len(self.dims):
            raise GuardRuleError(f"{where}: dims are listed twice")

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "check": int(self.check),
            "action": int(self.action),
            "min": self.min,
            "max": self.max,
            "dims": list(self.dims),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> GuardRule:
        return cls(
            name=str(raw["name"]),
            check=GuardCheck(raw["check"]),
            action=GuardAction(raw["action"]),
            min=None if raw["min"] is None else float(raw["min"]),  # type: ignore[arg-type]
            max=None if raw["max"] is None else float(raw["max"]),  # type: ignore[arg-type]
            dims=tuple(int(d) for d in raw["dims"]),  # type: ignore[attr-defined]
        )


@dataclass(frozen=True)
class GuardEvent:
    guard: str
    action: GuardAction
    step: int
    dims: tuple[int, ...]
    detail: str
    rolled_back_to: int | None = None


@dataclass(frozen=True)
class GuardVerdict:
    output: np.ndarray  # (o,) what to answer: the model's output, or the clamped one
    events: tuple[GuardEvent, ...] = ()
    action: GuardAction | None = None  # the strongest action among broken rules

    @property
    def applies_step(self) -> bool:
        return self.action is None or self.action <= GuardAction.CLAMP


def check_output(rules: Sequence[GuardRule], step: int, output: np.ndarray) -> GuardVerdict:
    """Check one output row ``(o,)`` against ``rules``; never modifies ``output``."""
    if not rules:
        return GuardVerdict(output)
    events: list[GuardEvent] = []
    strongest: GuardAction | None = None
    clamped: np.ndarray | None = None
    for rule in rules:
        dims = np.asarray(rule.dims, np.intp) if rule.dims else np.arange(output.shape[0])
        values = output[dims]  # (|dims|,)
        if rule.check == GuardCheck.FINITE:
            bad = ~np.isfinite(values)
            detail = "not finite"
        else:
            lo = -np.inf if rule.min is None else np.float32(rule.min)
            hi = np.inf if rule.max is None else np.float32(rule.max)
            bad = ~((values >= lo) & (values <= hi))  # NaN compares false: it is outside
            lo_text = "-inf" if rule.min is None else f"{lo:.6g}"
            hi_text = "+inf" if rule.max is None else f"{hi:.6g}"
            detail = f"outside [{lo_text}, {hi_text}]"
        if not bad.any():
            continue
        broken = tuple(int(d) for d in dims[bad])
        shown = ", ".join(f"{d}={output[d]:.6g}" for d in broken[:4])
        events.append(GuardEvent(rule.name, rule.action, step, broken, f"{detail}: {shown}"))
        if strongest is None or rule.action > strongest:
            strongest = rule.action
        if rule.action == GuardAction.CLAMP:
            clamped = output.copy() if clamped is None else clamped
            _clamp(clamped, np.asarray(broken, np.intp), rule)
    if strongest is None:
        return GuardVerdict(output)
    answer = clamped if strongest == GuardAction.CLAMP and clamped is not None else output
    return GuardVerdict(answer, tuple(events), strongest)


def _clamp(out: np.ndarray, dims: np.ndarray, rule: GuardRule) -> None:
    values = out[dims]
    lo = np.float32(rule.min) if rule.min is not None else None
    hi = np.float32(rule.max) if rule.max is not None else None
    nan_to = lo if lo is not None else hi if hi is not None else np.float32(0)
    values = np.where(np.isnan(values), nan_to, values)
    if rule.check == GuardCheck.FINITE:
        big = np.finfo(np.float32).max
        values = np.clip(values, -big, big)
    else:
        values = np.clip(values, lo, hi)
    out[dims] = values.astype(np.float32)
