"""Generate's constraint and text monitor: the proto's messages as ``OutputRules``, and a
retraction into a response (``sessions.guided_output``)."""

from __future__ import annotations

from ssmserve.server.sessions.constraints import Constraint
from ssmserve.server.sessions.guided_output import OutputRules, Retraction
from ssmserve.server.sessions.text_monitor import DEFAULT_MAX_RETRIES, TextMonitor
from ssmserve.v1 import ssmserve_pb2 as pb


def rules_from_pb(request: pb.GenerateRequest) -> OutputRules | None:
    """The request's constraint, monitor and monitor_retries (None: none of them)."""
    constraint = None
    if request.HasField("constraint"):
        constraint = _constraint(request.constraint, request.constraint.WhichOneof("kind"))
    monitor = None
    if request.HasField("monitor"):
        m = request.monitor
        monitor = TextMonitor(
            _constraint(m, m.WhichOneof("check")),
            rollback_tokens=m.rollback_tokens or 1,
            max_retries=m.max_retries if m.HasField("max_retries") else DEFAULT_MAX_RETRIES,
        )
    if constraint is None and monitor is None and not request.monitor_retries:
        return None
    generated = tuple(request.generated_ids)
    return OutputRules(constraint, monitor, request.monitor_retries, generated)


def _constraint(message: pb.Constraint | pb.TextMonitor, kind: str | None) -> Constraint:
    """The constraint of a oneof (an empty one: an empty regex, refused as such)."""
    if kind is None:
        return Constraint("regex", "")
    if kind == "json_object":
        return Constraint("json_object")
    return Constraint(kind, getattr(message, kind))  # type: ignore[arg-type]


def add_retraction(response: pb.GenerateResponse, retraction: Retraction) -> None:
    """``response`` withdraws the tokens after ``retraction.step``: those it holds are
    dropped, and the client drops those it received before it."""
    kept = [t for t in response.tokens if t.step <= retraction.step]
    del response.tokens[:]
    response.tokens.extend(kept)
    if not response.HasField("retracted_after_step") or (
        retraction.step < response.retracted_after_step
    ):
        response.retracted_after_step = retraction.step
    response.monitor_retries = retraction.retries
    response.session_step = retraction.step
