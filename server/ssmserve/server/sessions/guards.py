"""Guards: rules a session's steps are checked against, and what each broken rule does.

A rule looks at some dims (or all) of one side of a step and checks:

- ``FINITE`` (outputs): no NaN or Inf;
- ``RANGE``: inside ``[min, max]`` (either bound optional; a NaN is never inside), on the
  outputs or on the inputs;
- ``RATE``: ``|v_t - v_(t-1)| <= max_rate`` per dim, on the outputs (as answered) or on
  the inputs (as applied); dims where either value is not finite are FINITE's business;
- ``PREDICTION_ERROR`` (inputs, models with ``output_dim == input_dim``): the input
  ``x_t`` departs from the previous step's output ``y_(t-1)`` (a one-step-ahead model's
  prediction of ``x_t``) by at most ``tolerance`` times a running scale per dim
  (``stateful_guards`` has the update rule).

``sustained = k`` makes a rule fire only on a dim broken for ``k`` consecutive applied
steps (1, the default: at once). When a rule fires its action decides the step:

- ``REPORT``: the step is answered as usual, with a :class:`GuardEvent`.
- ``CLAMP`` (outputs): the returned output is clipped into range (NaN becomes the lower
  bound, or the upper, or 0; a rate check clips to ``y_(t-1) ± max_rate``), and an event
  is reported. The session's state is the model's; only the answer changes.
- ``IMPUTE`` (inputs, ``output_dim == input_dim``): the broken dims of the input are
  replaced by the model's forecast for the step (the previous step's output as answered)
  and the step is applied with that input; the event carries the values put in. With no
  finite forecast to put in (the session's first step) the rule rejects the step instead.
- ``REJECT``: the step is not applied; the client gets an error and may send another input.
- ``ROLLBACK``: the step is not applied and the session returns to its newest snapshot
  taken before the violation (the event says which step).

The strongest action among the rules that fire wins, in this order: ROLLBACK > REJECT >
IMPUTE > CLAMP > REPORT. IMPUTE sits above CLAMP because it changes what the model is
fed (its state), where CLAMP changes only the answer, and below REJECT because the step
is still applied. Input rules are judged before the step runs (a step they reject never
reaches the model), output rules after.

Rules of FINITE and RANGE on outputs without ``sustained`` are pure functions of one
output row (:func:`check_output`). The others carry state from step to step (previous
input and output, scales, counts: ``stateful_guards``), which is part of every snapshot,
so a replay takes the same decisions.
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
MAX_SUSTAINED = 1 << 16  # consecutive steps a rule may wait for
DEFAULT_DECAY = 0.9  # a prediction-error rule's scale: weight kept on its past


class GuardCheck(enum.IntEnum):
    FINITE = 1
    RANGE = 2
    RATE = 3
    PREDICTION_ERROR = 4


class GuardSide(enum.IntEnum):
    """What a rule looks at: the step's output, or the input it was sent."""

    OUTPUT = 1
    INPUT = 2


class GuardAction(enum.IntEnum):
    """The values are the wire's (and the stored configs'); :attr:`strength` orders them."""

    REPORT = 1
    CLAMP = 2
    REJECT = 3
    ROLLBACK = 4
    IMPUTE = 5

    @property
    def strength(self) -> int:
        """The order in which the strongest broken rule decides (higher wins)."""
        return _STRENGTH[self]

    @property
    def applies_step(self) -> bool:
        """Whether a step whose strongest broken rule has this action is applied."""
        return self.strength <= _STRENGTH[GuardAction.IMPUTE]


_STRENGTH = {
    GuardAction.REPORT: 0,
    GuardAction.CLAMP: 1,
    GuardAction.IMPUTE: 2,
    GuardAction.REJECT: 3,
    GuardAction.ROLLBACK: 4,
}


def stronger(a: GuardAction | None, b: GuardAction | None) -> GuardAction | None:
    """The stronger of two actions (None: no rule fired)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if a.strength >= b.strength else b


class GuardRuleError(SsmserveError):
    """A guard rule is malformed (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class GuardRule:
    name: str
    check: GuardCheck
    action: GuardAction
    min: float | None = None
    max: float | None = None
    dims: tuple[int, ...] = ()  # empty: every dim of its side
    side: GuardSide = GuardSide.OUTPUT
    max_rate: float | None = None  # RATE: the largest change per step
    tolerance: float | None = None  # PREDICTION_ERROR: k, broken past k x scale
    decay: float | None = None  # PREDICTION_ERROR: the scale's weight on its past
    scale_floor: float | None = None  # PREDICTION_ERROR: the scale never goes below it
    sustained: int = 1  # consecutive broken steps before the rule fires

    @property
    def stateful(self) -> bool:
        """Whether judging it needs what earlier steps left (``stateful_guards``)."""
        return self.side == GuardSide.INPUT or self.check == GuardCheck.RATE or self.sustained > 1

    def watched(self, width: int) -> np.ndarray:
        """The dims it looks at, of a side ``width`` wide."""
        return np.asarray(self.dims, np.intp) if self.dims else np.arange(width)

    def validate(self, output_dim: int, input_dim: int | None = None) -> None:
        """Raise GuardRuleError unless the rule makes sense for a model with these
        widths (``input_dim`` 0: a token model; None: outputs only are known)."""
        where = f"guard {clip(self.name)}"
        if not self.name or len(self.name) > 64:
            raise GuardRuleError(f"{where}: a name of 1 to 64 characters is required")
        self._validate_fields(where)
        if not 1 <= self.sustained <= MAX_SUSTAINED:
            raise GuardRuleError(
                f"{where}: sustained must be between 1 (fire at once) and {MAX_SUSTAINED} "
                f"consecutive steps, got {self.sustained}"
            )
        self._validate_side(where, output_dim, input_dim)
        width = output_dim if self.side == GuardSide.OUTPUT else (input_dim or 0)
        if len(self.dims) > MAX_DIMS:
            raise GuardRuleError(
                f"{where}: at most {MAX_DIMS} dims per rule (got {len(self.dims)}); leave "
                f"dims empty to check every dim"
            )
        bad = [d for d in self.dims if not 0 <= d < width]
        if bad:
            side = "output" if self.side == GuardSide.OUTPUT else "input"
            raise GuardRuleError(
                f"{where}: {side} dim {bad[0]} does not exist (the model has {width})"
            )
        if len(set(self.dims)) != len(self.dims):
            raise GuardRuleError(f"{where}: dims are listed twice")

    def _validate_fields(self, where: str) -> None:
        """Each check takes its own fields, finite and in range, and no others."""
        given = {
            name
            for name in ("min", "max", "max_rate", "tolerance", "decay", "scale_floor")
            if getattr(self, name) is not None
        }
        takes = {
            GuardCheck.FINITE: set(),
            GuardCheck.RANGE: {"min", "max"},
            GuardCheck.RATE: {"max_rate"},
            GuardCheck.PREDICTION_ERROR: {"tolerance", "decay", "scale_floor"},
        }[self.check]
        extra = sorted(given - takes)
        if extra:
            what = ", ".join(sorted(takes)) or "no bounds"
            raise GuardRuleError(
                f"{where}: a {self.check.name.lower().replace('_', '-')} check takes {what}, "
                f"not {extra[0]}"
            )
        for name in sorted(given):
            if not math.isfinite(getattr(self, name)):
                raise GuardRuleError(
                    f"{where}: bounds and thresholds must be finite numbers ({name} is "
                    f"{getattr(self, name)})"
                )
        if self.check == GuardCheck.RANGE:
            if self.min is None and self.max is None:
                raise GuardRuleError(f"{where}: a range check needs min, max or both")
            if self.min is not None and self.max is not None and self.min > self.max:
                raise GuardRuleError(f"{where}: min {self.min} is above max {self.max}")
        elif self.check == GuardCheck.RATE:
            if self.max_rate is None or self.max_rate <= 0:
                raise GuardRuleError(
                    f"{where}: a rate check needs max_rate > 0, the largest change per step "
                    f"(got {self.max_rate})"
                )
        elif self.check == GuardCheck.PREDICTION_ERROR:
            if self.tolerance is None or self.tolerance <= 0:
                raise GuardRuleError(
                    f"{where}: a prediction-error check needs tolerance > 0 (it breaks when "
                    f"|input - prediction| > tolerance x scale; got {self.tolerance})"
                )
            if self.decay is None or not 0 <= self.decay < 1:
                raise GuardRuleError(
                    f"{where}: decay must be in [0, 1) (the scale's weight on its past; "
                    f"default {DEFAULT_DECAY}), got {self.decay}"
                )
            if self.scale_floor is None or self.scale_floor <= 0:
                raise GuardRuleError(
                    f"{where}: a prediction-error check needs scale_floor > 0, the smallest "
                    f"one-step error it expects in the input's units (got {self.scale_floor})"
                )

    def _validate_side(self, where: str, output_dim: int, input_dim: int | None) -> None:
        """What the rule looks at and what its action does fit the model."""
        predicts = input_dim is not None and input_dim == output_dim
        if self.side == GuardSide.OUTPUT:
            if self.check == GuardCheck.PREDICTION_ERROR:
                raise GuardRuleError(
                    f"{where}: a prediction-error check judges the input against the previous "
                    f"output; set side to input"
                )
            if self.action == GuardAction.IMPUTE:
                raise GuardRuleError(
                    f"{where}: IMPUTE replaces an input, and this rule checks outputs: use "
                    f"CLAMP, REJECT or ROLLBACK, or check the input side"
                )
            return
        if input_dim is not None and input_dim == 0:
            raise GuardRuleError(
                f"{where}: the model takes token ids, and input checks need a signal model; "
                f"check its outputs instead"
            )
        if self.check == GuardCheck.FINITE:
            raise GuardRuleError(
                f"{where}: inputs are always finite (a NaN input is refused as "
                f"INVALID_ARGUMENT); check outputs, or a range of the inputs"
            )
        if self.action == GuardAction.CLAMP:
            raise GuardRuleError(
                f"{where}: CLAMP clips an output; on an input check use IMPUTE (the model's "
                f"forecast in its place), REPORT, REJECT or ROLLBACK"
            )
        needs = self.check == GuardCheck.PREDICTION_ERROR or self.action == GuardAction.IMPUTE
        if needs and not predicts:
            what = "a prediction-error check" if self.action != GuardAction.IMPUTE else "IMPUTE"
            raise GuardRuleError(
                f"{where}: {what} uses the previous step's output as the prediction of the "
                f"input, so the model needs output_dim == input_dim (it has {input_dim} in, "
                f"{output_dim} out)"
            )

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name,
            "check": int(self.check),
            "action": int(self.action),
            "min": self.min,
            "max": self.max,
            "dims": list(self.dims),
        }
        # Only what differs from the defaults: a config of FINITE and RANGE rules is
        # stored as before, and workers that predate these fields still read it.
        if self.side != GuardSide.OUTPUT:
            out["side"] = int(self.side)
        for name in ("max_rate", "tolerance", "decay", "scale_floor"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.sustained != 1:
            out["sustained"] = self.sustained
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> GuardRule:
        def number(key: str) -> float | None:
            value = raw.get(key)
            return None if value is None else float(value)  # type: ignore[arg-type]

        return cls(
            name=str(raw["name"]),
            check=GuardCheck(raw["check"]),
            action=GuardAction(raw["action"]),
            min=number("min"),
            max=number("max"),
            dims=tuple(int(d) for d in raw["dims"]),  # type: ignore[attr-defined]
            side=GuardSide(raw.get("side", GuardSide.OUTPUT)),
            max_rate=number("max_rate"),
            tolerance=number("tolerance"),
            decay=number("decay"),
            scale_floor=number("scale_floor"),
            sustained=int(raw.get("sustained", 1)),  # type: ignore[call-overload]
        )


@dataclass(frozen=True)
class GuardEvent:
    guard: str
    action: GuardAction
    step: int
    dims: tuple[int, ...]
    detail: str
    rolled_back_to: int | None = None
    imputed: tuple[float, ...] = ()  # IMPUTE: the values put in at ``dims``, in order


@dataclass(frozen=True)
class GuardVerdict:
    output: np.ndarray  # (o,) what to answer: the model's output, or the clamped one
    events: tuple[GuardEvent, ...] = ()
    action: GuardAction | None = None  # the strongest action among broken rules

    @property
    def applies_step(self) -> bool:
        return self.action is None or self.action.applies_step


def check_output(rules: Sequence[GuardRule], step: int, output: np.ndarray) -> GuardVerdict:
    """Check one output row ``(o,)`` against ``rules`` that need no earlier step (FINITE
    and RANGE on outputs, not sustained); never modifies ``output``."""
    if not rules:
        return GuardVerdict(output)
    return judge_outputs(rules, step, output)[0]


def judge_outputs(
    rules: Sequence[GuardRule],
    step: int,
    output: np.ndarray,
    previous: np.ndarray | None = None,
    counts: Sequence[np.ndarray | None] = (),
) -> tuple[GuardVerdict, list[np.ndarray | None]]:
    """The output rules of ``rules`` on one output row ``(o,)``: the verdict, and per rule
    its sustained counts after this step (None: an input rule, or not sustained).
    ``previous``: the last step's output as answered (RATE; None: no step before);
    ``counts``: the counts before this step, per rule (empty: all zero)."""
    events: list[GuardEvent] = []
    strongest: GuardAction | None = None
    clamped: np.ndarray | None = None
    after: list[np.ndarray | None] = [None] * len(rules)
    for j, rule in enumerate(rules):
        if rule.side != GuardSide.OUTPUT:
            continue
        dims = rule.watched(output.shape[0])
        values = output[dims]  # (|dims|,)
        broken, detail = _output_broken(rule, values, None if previous is None else previous[dims])
        after[j], fired = sustain(rule, counts[j] if counts else None, broken)
        if not fired.any():
            continue
        hit = dims[fired]
        broken_dims = tuple(int(d) for d in hit)
        shown = ", ".join(f"{d}={output[d]:.6g}" for d in broken_dims[:4])
        events.append(
            GuardEvent(rule.name, rule.action, step, broken_dims, f"{detail}: {shown}{held(rule)}")
        )
        strongest = stronger(strongest, rule.action)
        if rule.action == GuardAction.CLAMP:
            clamped = output.copy() if clamped is None else clamped
            _clamp(clamped, hit, rule, previous)
    if strongest is None:
        return GuardVerdict(output), after
    answer = clamped if strongest == GuardAction.CLAMP and clamped is not None else output
    return GuardVerdict(answer, tuple(events), strongest), after


def sustain(
    rule: GuardRule, count: np.ndarray | None, broken: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray]:
    """A rule's counts of consecutive broken steps per dim after this step (capped at its
    ``sustained``; None when it fires at once), and which dims fire."""
    if rule.sustained == 1:
        return None, broken
    before = np.zeros(broken.shape, np.int64) if count is None else count
    now = np.where(broken, np.minimum(before + 1, rule.sustained), 0).astype(np.int64)
    return now, now >= rule.sustained


def held(rule: GuardRule) -> str:
    """What an event's detail adds for a sustained rule."""
    return f" ({rule.sustained} steps in a row)" if rule.sustained > 1 else ""


def _output_broken(
    rule: GuardRule, values: np.ndarray, previous: np.ndarray | None
) -> tuple[np.ndarray, str]:
    """Which of ``values`` break ``rule`` (an output rule), and the event's words."""
    if rule.check == GuardCheck.FINITE:
        return ~np.isfinite(values), "not finite"
    if rule.check == GuardCheck.RATE:
        words = f"changed by more than {rule.max_rate:.6g} in one step"
        if previous is None:
            return np.zeros(values.shape, np.bool_), words
        change = np.abs(values.astype(np.float64) - previous.astype(np.float64))
        return np.isfinite(change) & (change > rule.max_rate), words
    return range_broken(rule, values)


def range_broken(rule: GuardRule, values: np.ndarray) -> tuple[np.ndarray, str]:
    """Which of ``values`` lie outside a RANGE rule's bounds (NaN does), and the words."""
    lo = -np.inf if rule.min is None else np.float32(rule.min)
    hi = np.inf if rule.max is None else np.float32(rule.max)
    broken = ~((values >= lo) & (values <= hi))  # NaN compares false: it is outside
    lo_text = "-inf" if rule.min is None else f"{lo:.6g}"
    hi_text = "+inf" if rule.max is None else f"{hi:.6g}"
    return broken, f"outside [{lo_text}, {hi_text}]"


def _clamp(out: np.ndarray, dims: np.ndarray, rule: GuardRule, previous: np.ndarray | None) -> None:
    values = out[dims]
    if rule.check == GuardCheck.RATE:  # fired dims: both values finite
        assert previous is not None and rule.max_rate is not None
        last = previous[dims].astype(np.float64)
        step = np.clip(values.astype(np.float64) - last, -rule.max_rate, rule.max_rate)
        out[dims] = (last + step).astype(np.float32)
        return
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
