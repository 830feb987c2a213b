"""Protobuf messages <-> the server's own types, both ways: session configs and infos,
models, snapshots, events, forecasts, step results, and the inputs of Stream steps
(decoded at once for a message of packed vectors: :class:`PackedInputs`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ssmserve.client.step_values import vector_array
from ssmserve.server.api import status
from ssmserve.server.api.imports import RequestError
from ssmserve.server.api.tenancy import TenantScope, tenant_of
from ssmserve.server.errors import clip
from ssmserve.server.sessions.config import Durability, SessionConfig
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.forecaster import ForecastStep
from ssmserve.server.sessions.guards import (
    DEFAULT_DECAY,
    GuardAction,
    GuardCheck,
    GuardEvent,
    GuardRule,
    GuardRuleError,
    GuardSide,
)
from ssmserve.server.sessions.models import ServedModels, split_key
from ssmserve.server.sessions.records import SessionView
from ssmserve.server.sessions.session import SnapshotEvent, StepOutcome, StepRun
from ssmserve.server.state.store_records import SnapshotRecord
from ssmserve.v1 import ssmserve_pb2 as pb

#: Room left in a message for what is not results (framing, the continued flag).
RESPONSE_MARGIN = 64 << 10

_ALL = TenantScope()  # ids as stored (no tenant to take out)


class PackedInputs:
    """The inputs of a message whose steps all carry packed vectors, decoded at once: one
    float32 array, every value checked finite (:meth:`of`). Step ``i``'s vector is
    ``flat[starts[i]:starts[i + 1]]``.

    Why: high-rate streams send hundreds of packed steps per message, and decoding and
    checking each alone cost ~5 us of the server's CPU per step; this is ~0.5. A run of
    steps is a view of ``flat`` too (:meth:`rows`), with no copy per step.
    """

    __slots__ = ("flat", "starts")

    def __init__(self, flat: np.ndarray, starts: list[int]) -> None:
        self.flat = flat  # (sum of widths,) float32, owned
        self.starts = starts  # len(steps) + 1 offsets into flat

    @classmethod
    def of(cls, steps: Sequence[pb.StepInput]) -> PackedInputs | None:
        """None when any step carries something else (a token, ``values``, nothing) or a
        vector that is malformed or not finite: such a message is decoded step by step,
        which names the step at fault."""
        blobs = []
        starts = [0]
        end = 0
        for step in steps:
            vector = step.vector
            blob = vector.packed
            if not blob or len(blob) % 4 or vector.values:
                return None
            blobs.append(blob)
            end += len(blob) >> 2
            starts.append(end)
        flat = np.frombuffer(b"".join(blobs), "<f4").astype(np.float32)  # one owned copy
        return cls(flat, starts) if np.isfinite(flat).all() else None

    def value(self, i: int) -> np.ndarray:
        """Step ``i``'s vector (a view)."""
        return self.flat[self.starts[i] : self.starts[i + 1]]

    def rows(self, lo: int, hi: int) -> np.ndarray | None:
        """Steps ``lo:hi`` as one (T, i) view when their vectors have one width, else None."""
        starts = self.starts
        width = starts[lo + 1] - starts[lo]
        for j in range(lo + 1, hi):
            if starts[j + 1] - starts[j] != width:
                return None
        return self.flat[starts[lo] : starts[hi]].reshape(hi - lo, width)


def step_value(step: pb.StepInput) -> int | np.ndarray:
    which = step.WhichOneof("value")
    if which == "token":
        return int(step.token)
    if which == "vector":
        return vector_value(step.vector, f"step {step.step} of session {step.session_id!r}")
    raise RequestError(f"step {step.step} of session {step.session_id!r} carries no input")


_ACTIONS = {
    pb.GuardRule.ACTION_UNSPECIFIED: GuardAction.REPORT,
    pb.GuardRule.ACTION_REPORT: GuardAction.REPORT,
    pb.GuardRule.ACTION_CLAMP: GuardAction.CLAMP,
    pb.GuardRule.ACTION_REJECT: GuardAction.REJECT,
    pb.GuardRule.ACTION_ROLLBACK: GuardAction.ROLLBACK,
    pb.GuardRule.ACTION_IMPUTE: GuardAction.IMPUTE,
}
_CHECKS = {
    pb.GuardRule.CHECK_FINITE: GuardCheck.FINITE,
    pb.GuardRule.CHECK_RANGE: GuardCheck.RANGE,
    pb.GuardRule.CHECK_RATE: GuardCheck.RATE,
    pb.GuardRule.CHECK_PREDICTION_ERROR: GuardCheck.PREDICTION_ERROR,
}
_SIDES = {pb.GuardRule.SIDE_OUTPUT: GuardSide.OUTPUT, pb.GuardRule.SIDE_INPUT: GuardSide.INPUT}
_DURABILITY = {
    pb.DURABILITY_UNSPECIFIED: Durability.LOG,
    pb.DURABILITY_LOG: Durability.LOG,
    pb.DURABILITY_SNAPSHOT: Durability.SNAPSHOT,
    pb.DURABILITY_NONE: Durability.NONE,
}


def config_from_pb(config: pb.SessionConfig) -> SessionConfig:
    guards = [guard_from_pb(rule) for rule in config.guards]
    if config.durability not in _DURABILITY:
        raise RequestError(f"unknown durability mode {config.durability}")
    return SessionConfig(
        snapshot_every=config.snapshot_every,
        max_snapshots=config.max_snapshots,
        history_window=config.history_window,
        guards=tuple(guards),
        durability=_DURABILITY[config.durability],
        idle_ttl_s=config.idle_ttl_s,
        labels=dict(config.labels),
        snapshot_phase=config.snapshot_phase if config.HasField("snapshot_phase") else None,
    )


def guard_from_pb(rule: pb.GuardRule) -> GuardRule:
    """A rule as the wire has it; unset fields take their defaults (the side a check
    looks at by default, decay 0.9, sustained 1), so the stored rule says every value."""
    where = f"guard {clip(rule.name)}"
    if rule.check not in _CHECKS:
        raise GuardRuleError(
            f"{where}: check must be CHECK_FINITE, CHECK_RANGE, CHECK_RATE or "
            f"CHECK_PREDICTION_ERROR"
        )
    if rule.action not in _ACTIONS:
        raise GuardRuleError(f"{where}: unknown action {rule.action}")
    if rule.side not in _SIDES and rule.side != pb.GuardRule.SIDE_UNSPECIFIED:
        raise GuardRuleError(f"{where}: unknown side {rule.side}")
    check = _CHECKS[rule.check]
    default = GuardSide.INPUT if check == GuardCheck.PREDICTION_ERROR else GuardSide.OUTPUT
    decay = rule.decay if rule.HasField("decay") else None
    if decay is None and check == GuardCheck.PREDICTION_ERROR:
        decay = DEFAULT_DECAY

    def given(name: str) -> float | None:
        return getattr(rule, name) if rule.HasField(name) else None

    return GuardRule(
        name=rule.name,
        check=check,
        action=_ACTIONS[rule.action],
        min=given("min"),
        max=given("max"),
        dims=tuple(rule.dims),
        side=_SIDES.get(rule.side, default),
        max_rate=given("max_rate"),
        tolerance=given("tolerance"),
        decay=decay,
        scale_floor=given("scale_floor"),
        sustained=rule.sustained if rule.HasField("sustained") else 1,
    )


def guard_to_pb(g: GuardRule) -> pb.GuardRule:
    out = pb.GuardRule(
        name=g.name,
        check=int(g.check),
        action=int(g.action),
        min=g.min,
        max=g.max,
        dims=list(g.dims),
        side=int(g.side),
        max_rate=g.max_rate,
        tolerance=g.tolerance,
        decay=g.decay,
        scale_floor=g.scale_floor,
    )
    if g.sustained != 1:
        out.sustained = g.sustained
    return out


def config_to_pb(config: SessionConfig) -> pb.SessionConfig:
    out = pb.SessionConfig(
        snapshot_every=config.snapshot_every,
        max_snapshots=config.max_snapshots,
        history_window=config.history_window,
        guards=[guard_to_pb(g) for g in config.guards],
        durability=int(config.durability),
        idle_ttl_s=config.idle_ttl_s,
        labels=dict(config.labels),
    )
    if config.snapshot_phase is not None:
        out.snapshot_phase = config.snapshot_phase
    return out


def info_to_pb(view: SessionView, scope: TenantScope = _ALL) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=scope.shown(view.session_id),
        tenant=tenant_of(view.session_id),
        model=view.model,
        model_fingerprint=view.fingerprint,
        step=view.step,
        config=config_to_pb(view.config),
        created_at=view.created_at,
        updated_at=view.updated_at,
        snapshot_count=view.snapshot_count,
        oldest_rollback_step=view.oldest_rollback_step,
        owner=view.owner,
        resident=view.resident,
        input_dim=view.input_dim,
        output_dim=view.output_dim,
        token_input=view.token_input,
        closed=view.closed,
    )


def model_to_pb(key: str, models: ServedModels, resident: int) -> pb.ModelInfo:
    model = models[key]
    c = model.config
    name, version = split_key(key)
    tokenizer = models.tokenizer(key)
    return pb.ModelInfo(
        key=key,
        name=name,
        version=version,
        fingerprint=model.fingerprint,
        input_dim=0 if c.is_token_model else c.input_dim,
        output_dim=c.output_dim,
        token_input=c.is_token_model,
        resident_sessions=resident,
        newest=models.newest(key),
        tokenizer_fingerprint="" if tokenizer is None else tokenizer.fingerprint,
        eos_token_ids=models.eos_ids(key),
        has_tokenizer=tokenizer is not None,
    )


def snapshot_to_pb(session_id: str, record: SnapshotRecord) -> pb.SnapshotInfo:
    return pb.SnapshotInfo(
        snapshot_id=record.snapshot_id,
        session_id=session_id,
        step=record.step,
        label=record.label,
        reason=record.reason,
        created_at=record.created_at,
        size_bytes=record.size,
    )


def event_to_pb(event: SessionEvent) -> pb.SessionEvent:
    message = pb.SessionEvent(
        kind=event.kind, step=event.step, at=event.at, cause=event.cause, guard=event.guard,
        action=event.action, detail=event.detail,
    )  # fmt: skip
    if event.to_step >= 0:
        message.to_step = event.to_step
    return message


def guard_event_to_pb(event: GuardEvent) -> pb.GuardEvent:
    return pb.GuardEvent(
        guard=event.guard,
        action=int(event.action),
        step=event.step,
        dims=list(event.dims),
        detail=event.detail,
        rolled_back_to=event.rolled_back_to or 0,
        imputed=list(event.imputed),
    )


def _snapshot_event_to_pb(event: SnapshotEvent) -> pb.SnapshotEvent:
    return pb.SnapshotEvent(snapshot_id=event.snapshot_id, step=event.step, reason=event.reason)


def forecast_step_to_pb(item: ForecastStep, packed: bool = False) -> pb.ForecastStep:
    out = pb.ForecastStep(
        step=item.step, guard_events=[guard_event_to_pb(e) for e in item.guard_events]
    )
    if item.output is not None:
        _set_vector(out.output, item.output, packed)
    if item.token is not None:
        out.token = item.token
    return out


def result_to_pb(
    outcome: StepOutcome, scope: TenantScope = _ALL, packed: bool = False
) -> pb.StepResult:
    result = pb.StepResult()
    fill_result(result, outcome, scope, packed)
    return result


def fill_result(
    result: pb.StepResult,
    outcome: StepOutcome,
    scope: TenantScope,
    packed: bool,
    with_output: bool = True,
) -> None:
    """``result`` (empty) := ``outcome`` as the client sees it; without its output unless
    ``with_output`` (``StreamRequest.last_outputs_only``: a step not last in its run)."""
    result.session_id = scope.shown(outcome.session_id)
    result.step = outcome.step
    if outcome.replayed:
        result.replayed = True
    if outcome.guard_events:
        result.guard_events.extend(guard_event_to_pb(e) for e in outcome.guard_events)
    if outcome.snapshot_events:
        result.snapshot_events.extend(_snapshot_event_to_pb(e) for e in outcome.snapshot_events)
    if outcome.output is not None and with_output:
        _set_vector(result.output, outcome.output, packed)
    if outcome.error is not None:
        result.error.CopyFrom(status.step_error(outcome.error, scope.clean))


def fill_run_results(
    add: Callable[[], pb.StepResult], run: StepRun, scope: TenantScope, packed: bool
) -> None:
    """A result per step of ``run`` (``add`` makes each): from its row of ``run.outputs``
    while it has nothing else to say, else from its own outcome. (A lone step's run is
    answered with its StepOutcome instead: :func:`fill_result`.) Of a ``last_only`` run,
    only the last step's result carries an output."""
    sid = scope.shown(run.session_id)
    outputs = run.outputs  # (T, o)
    assert outputs is not None, "a lone step's run is answered with its StepOutcome"
    last = run.count - 1
    every = not run.last_only  # else only row ``last`` is set (the others never written)
    if packed:
        shown = outputs if every else outputs[last:]
        blob = shown.astype("<f4", copy=False).tobytes()
        width, base = len(blob) // len(shown), 0 if every else last
    for t, outcome in enumerate(run.outcomes):
        result = add()
        if outcome is not None:
            fill_result(result, outcome, scope, packed, every or t == last)
            continue
        result.session_id = sid
        result.step = run.first + t
        if not every and t != last:
            continue
        if packed:
            k = t - base  # its row of ``shown``
            result.output.packed = blob[k * width : (k + 1) * width]
        else:
            result.output.values.extend(outputs[t].tolist())


def _set_vector(vector: pb.Vector, values: np.ndarray, packed: bool) -> None:
    """``values`` (float32) into ``vector``: as little-endian bytes when ``packed``."""
    if packed:
        vector.packed = values.astype("<f4", copy=False).tobytes()
    else:
        vector.values.extend(values.tolist())


def vector_value(vector: pb.Vector, what: str) -> np.ndarray:
    """A Vector's floats as float32 (either form, decoded as the client decodes them); a
    malformed one is a RequestError."""
    if vector.packed and len(vector.values):
        raise RequestError(f"{what}: a vector sets values or packed, not both")
    if len(vector.packed) % 4:
        raise RequestError(
            f"{what}: packed vector has {len(vector.packed)} bytes, not a multiple of 4 "
            "(little-endian float32)"
        )
    return vector_array(vector)
