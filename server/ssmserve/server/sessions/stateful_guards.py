"""Guards that carry state from step to step: input checks, RATE and sustained rules.

A session whose rules include any of these (``GuardRule.stateful``) keeps a
:class:`~ssmserve.server.state.checkpoint.GuardState` beside its model state: the input
applied at its step, that step's output as answered, and per rule its running scales and
sustained counts. It is a value (never changed in place), part of every snapshot, and
advanced only by applied steps, so a replay from a snapshot re-takes every decision:
the input log records the inputs as the client sent them, and replay judges each again
(:func:`judge_input` then :func:`judge_step`), imputing where the step was imputed.

One step ``t`` with input ``x`` (as sent), from the state after step ``t - 1``:

1. :func:`judge_input`, before the model runs: the input rules. A ``RANGE`` breaks
   outside its bounds; a ``RATE`` where ``|x_d - a_d| > max_rate`` (``a`` the input
   applied at ``t - 1``; never at the first step); a ``PREDICTION_ERROR`` where the
   previous output ``p = y_(t-1)`` is finite and ``|x_d - p_d| > tolerance * scale_d``.
   ``sustained`` counts consecutive broken steps per dim (capped at ``sustained``) and
   fires at ``sustained``. IMPUTE puts ``p_d`` in place of ``x_d`` on the dims that fired
   (no finite ``p_d``: the rule rejects the step instead). REJECT or ROLLBACK: the step
   does not run, and the state stays as it was (counts and scales included).
2. The model steps with the input so made (``applied``).
3. :func:`judge_step`: the output rules (``guards.judge_outputs``; a RATE compares with
   ``y_(t-1)``), the strongest action of both phases decides, and the state after the
   step, if it is applied: ``a = applied``, ``y_t`` as answered (after CLAMP), the
   counts of both phases, and each prediction-error rule's scale per dim

       scale_d <- max(scale_floor, decay * scale_d + (1 - decay) * |x_d - p_d|)

   only where its check could judge (a finite ``p_d``) and passed, and the input was not
   imputed: a spike, a stuck sensor or an imputed value never teaches the scale that the
   fault is normal. A scale starts at ``scale_floor``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ssmserve.server.sessions.guards import (
    GuardAction,
    GuardCheck,
    GuardEvent,
    GuardRule,
    GuardSide,
    held,
    judge_outputs,
    range_broken,
    stronger,
    sustain,
)
from ssmserve.server.state.checkpoint import Checkpoint, GuardState, RuleState


def is_stateful(rules: Sequence[GuardRule]) -> bool:
    """Whether a session with these rules keeps a guard state."""
    return any(rule.stateful for rule in rules)


def _keeps(rules: Sequence[GuardRule]) -> tuple[bool, bool]:
    """Whether the state needs the last input, and the last output."""
    inputs = any(r.side == GuardSide.INPUT for r in rules)
    outputs = inputs or any(r.check == GuardCheck.RATE for r in rules)
    return inputs, outputs


def _width(rule: GuardRule, input_dim: int, output_dim: int) -> int:
    if rule.dims:
        return len(rule.dims)
    return input_dim if rule.side == GuardSide.INPUT else output_dim


def initial_state(
    rules: Sequence[GuardRule],
    input_dim: int,
    output_dim: int,
    last_input: np.ndarray | None = None,
    last_output: np.ndarray | None = None,
) -> GuardState | None:
    """The state of a session whose guards have seen nothing yet (None: no stateful
    rules): scales at their floors, counts at 0, and the last input and output if known."""
    if not is_stateful(rules):
        return None
    keeps_input, keeps_output = _keeps(rules)
    states = []
    for rule in rules:
        width = _width(rule, input_dim, output_dim)
        scale = None
        if rule.check == GuardCheck.PREDICTION_ERROR:
            scale = np.full(width, rule.scale_floor, np.float64)
        count = np.zeros(width, np.int64) if rule.sustained > 1 else None
        states.append(RuleState(rule.name, scale, count))
    return GuardState(
        _own(last_input, np.float32) if keeps_input else None,
        _own(last_output, np.float32) if keeps_output else None,
        tuple(states),
    )


def state_of_checkpoint(
    ckpt: Checkpoint, rules: Sequence[GuardRule], input_dim: int, output_dim: int
) -> GuardState | None:
    """The guard state a session with ``rules`` has at ``ckpt``'s step: the checkpoint's
    own where it fits them (a session's own snapshots always do), else one rebuilt from
    what the checkpoint holds (the last input of its history, its output) with fresh
    scales and counts: a checkpoint from before these rules (an import) starts them."""
    if not is_stateful(rules):
        return None
    history = ckpt.history.inputs
    last_input = history[-1] if len(history) and history.ndim == 2 else None
    fresh = initial_state(rules, input_dim, output_dim, last_input, ckpt.output)
    assert fresh is not None
    g = ckpt.guards
    if g is None:
        return fresh
    keeps_input, keeps_output = _keeps(rules)
    if (keeps_input and g.last_input is None) or (keeps_output and g.last_output is None):
        return fresh
    kept = {r.name: r for r in g.rules}
    states = []
    for rule, new in zip(rules, fresh.rules, strict=True):
        old = kept.get(rule.name)
        states.append(old if old is not None and _fits(rule, old, new) else new)
    return GuardState(
        _own(g.last_input, np.float32) if keeps_input else None,
        _own(g.last_output, np.float32) if keeps_output else None,
        tuple(
            RuleState(s.name, _own(s.scale, np.float64), _own(s.count, np.int64)) for s in states
        ),
    )


def _fits(rule: GuardRule, old: RuleState, new: RuleState) -> bool:
    """Whether a checkpoint's state of a rule of that name can be this rule's."""
    for got, want in ((old.scale, new.scale), (old.count, new.count)):
        if (got is None) != (want is None) or (got is not None and got.shape != want.shape):  # type: ignore[union-attr]
            return False
    if old.scale is not None and (old.scale < rule.scale_floor).any():
        return False
    return old.count is None or bool((old.count <= rule.sustained).all())


def _own(arr: np.ndarray | None, dtype: type) -> np.ndarray | None:
    """A copy of its own (a checkpoint's arrays are views into its blob)."""
    return None if arr is None else np.array(arr, dtype)


@dataclass(frozen=True, slots=True)
class InputVerdict:
    """What the input rules made of one step's input (:func:`judge_input`)."""

    sent: np.ndarray  # (i,) or () as the client sent it
    applied: np.ndarray  # what the model is fed: ``sent``, or with imputed dims
    events: tuple[GuardEvent, ...]
    action: GuardAction | None  # the strongest that fired
    imputed: np.ndarray | None  # (i,) bool: the dims imputed; None: none
    counts: tuple[np.ndarray | None, ...]  # per rule, after this step (input rules)
    broken: tuple[np.ndarray | None, ...]  # per prediction-error rule: its raw breaks

    @property
    def applies_step(self) -> bool:
        return self.action is None or self.action.applies_step


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """One step judged by both phases (:func:`judge_step`)."""

    output: np.ndarray  # (o,) what to answer
    events: tuple[GuardEvent, ...]
    action: GuardAction | None
    applied: np.ndarray  # the input the model was fed
    state: GuardState  # after the step if it is applied; else the state before it

    @property
    def applies_step(self) -> bool:
        return self.action is None or self.action.applies_step


def judge_input(
    rules: Sequence[GuardRule], g: GuardState, step: int, sent: np.ndarray
) -> InputVerdict:
    """Phase 1 of step ``step`` (the module's docstring): the input rules on ``sent``."""
    counts: list[np.ndarray | None] = [None] * len(rules)
    broken_of: list[np.ndarray | None] = [None] * len(rules)
    events: list[GuardEvent] = []
    strongest: GuardAction | None = None
    imputed: np.ndarray | None = None
    forecast = g.last_output
    for j, rule in enumerate(rules):
        if rule.side != GuardSide.INPUT:
            continue
        dims = rule.watched(sent.shape[0])
        values = sent[dims]
        broken, words, shown = _input_broken(rule, g, j, dims, values)
        if rule.check == GuardCheck.PREDICTION_ERROR:
            broken_of[j] = broken
        counts[j], fired = sustain(rule, g.rules[j].count, broken)
        if not fired.any():
            continue
        hit = dims[fired]
        action, put = rule.action, ()
        detail = f"{words}: {shown(fired)}{held(rule)}"
        if action == GuardAction.IMPUTE:
            if forecast is not None and np.isfinite(forecast[hit]).all():
                imputed = np.zeros(sent.shape[0], np.bool_) if imputed is None else imputed
                imputed[hit] = True
                put = tuple(float(forecast[d]) for d in hit)
                shown_put = list(zip(hit, put, strict=True))[:4]
                detail += "; imputed " + ", ".join(f"{d}={v:.6g}" for d, v in shown_put)
            else:
                action = GuardAction.REJECT
                detail += "; no finite forecast to impute, so the step is rejected"
        events.append(
            GuardEvent(rule.name, action, step, tuple(int(d) for d in hit), detail, imputed=put)
        )
        strongest = stronger(strongest, action)
    applied = sent
    if imputed is not None:
        assert forecast is not None
        applied = np.where(imputed, forecast, sent).astype(np.float32)
    return InputVerdict(
        sent, applied, tuple(events), strongest, imputed, tuple(counts), tuple(broken_of)
    )


def _input_broken(
    rule: GuardRule, g: GuardState, j: int, dims: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, str, Callable[[np.ndarray], str]]:
    """Which of ``values`` (an input's ``dims``) break ``rule``; the event's words; and
    a function of the fired mask that shows the values."""

    def show(fired: np.ndarray) -> str:
        return ", ".join(
            f"{d}={v:.6g}" for d, v in list(zip(dims[fired], values[fired], strict=True))[:4]
        )

    none = np.zeros(values.shape, np.bool_)
    if rule.check == GuardCheck.RANGE:
        broken, words = range_broken(rule, values)
        return broken, f"input {words}", show
    if rule.check == GuardCheck.RATE:
        words = f"input changed by more than {rule.max_rate:.6g} in one step"
        if g.last_input is None:
            return none, words, show
        change = np.abs(values.astype(np.float64) - g.last_input[dims].astype(np.float64))
        return change > rule.max_rate, words, show
    # PREDICTION_ERROR
    words = f"input departs from the prediction by more than {rule.tolerance:.6g} x scale"
    if g.last_output is None:
        return none, words, show
    predicted = g.last_output[dims].astype(np.float64)
    scale = g.rules[j].scale
    assert scale is not None and rule.tolerance is not None
    with np.errstate(invalid="ignore"):
        error = np.abs(values.astype(np.float64) - predicted)
        broken = np.isfinite(predicted) & (error > rule.tolerance * scale)

    def show_error(fired: np.ndarray) -> str:
        picked = list(zip(dims[fired], values[fired], predicted[fired], scale[fired], strict=True))[
            :4
        ]
        return ", ".join(f"{d}={v:.6g} (predicted {p:.6g}, scale {s:.3g})" for d, v, p, s in picked)

    return broken, words, show_error


def judge_step(
    rules: Sequence[GuardRule],
    g: GuardState,
    step: int,
    before: InputVerdict,
    output: np.ndarray,
    logged: bool = False,
) -> StepVerdict:
    """Phase 3 of step ``step``: the output rules on ``output`` (the model's, fed
    ``before.applied``), both phases' strongest action, and the state after the step.
    ``logged``: a replayed step, which the log says was applied, so its state advances
    whatever the verdict (a replay re-takes the live decisions, so it never differs)."""
    verdict, out_counts = judge_outputs(
        rules, step, output, g.last_output, [r.count for r in g.rules]
    )
    action = stronger(before.action, verdict.action)
    events = before.events + verdict.events
    if not (logged or action is None or action.applies_step):
        return StepVerdict(verdict.output, events, action, before.applied, g)
    states = []
    for j, (rule, old) in enumerate(zip(rules, g.rules, strict=True)):
        count = before.counts[j] if rule.side == GuardSide.INPUT else out_counts[j]
        scale = old.scale
        if rule.check == GuardCheck.PREDICTION_ERROR and g.last_output is not None:
            scale = _next_scale(rule, old, rule.watched(before.sent.shape[0]), before, g, j)
        states.append(RuleState(rule.name, scale, count))
    inputs, outputs = _keeps(rules)
    # Copies: the input may be a view of a queued run, the output a row of a batch.
    after = GuardState(
        np.array(before.applied, np.float32) if inputs else None,
        np.array(verdict.output, np.float32) if outputs else None,
        tuple(states),
    )
    return StepVerdict(verdict.output, events, action, before.applied, after)


def _next_scale(
    rule: GuardRule,
    old: RuleState,
    dims: np.ndarray,
    before: InputVerdict,
    g: GuardState,
    j: int,
) -> np.ndarray:
    """A prediction-error rule's scales after an applied step (the module's docstring)."""
    assert old.scale is not None and g.last_output is not None
    assert rule.decay is not None and rule.scale_floor is not None
    predicted = g.last_output[dims].astype(np.float64)
    with np.errstate(invalid="ignore"):
        error = np.abs(before.sent[dims].astype(np.float64) - predicted)
    learns = np.isfinite(predicted)
    broken = before.broken[j]
    if broken is not None:
        learns &= ~broken
    if before.imputed is not None:
        learns &= ~before.imputed[dims]
    if not learns.any():
        return old.scale
    moved = np.maximum(rule.scale_floor, rule.decay * old.scale + (1 - rule.decay) * error)
    return np.where(learns, moved, old.scale)
