"""SessionEvent: what happened to a session besides its steps, kept in the store.

Rollbacks (asked by a monitor, or by a ROLLBACK guard) and guard events (a rule that
reported, clamped, rejected or rolled back a step's output) are appended to the session's
event list in Redis (``store_layout``: ``P:{sid}:events``, the newest 1,024) by its owner,
fenced like every write, in the same batch that answers the step. ``GetHistory`` returns
them with the inputs and outputs, so ``ssmserve plot`` can mark them.

Recording is best effort: a write that fails is logged and the step is answered anyway
(the event list is a record for people, not part of the session's state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from ssmserve.server.errors import SsmserveError
from ssmserve.server.sessions.guards import GuardAction, GuardEvent
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store import Store

log = logging.getLogger(__name__)

KINDS = ("rollback", "guard")


@dataclass(frozen=True)
class SessionEvent:
    kind: str  # "rollback" or "guard"
    step: int  # the step it is about: a guard's step; a rollback's step before it
    at: float  # unix seconds
    to_step: int = -1  # a rollback: the step the session returned to
    cause: str = ""  # a rollback: "monitor" (the Rollback RPC) or "guard"
    guard: str = ""  # a guard event: the rule's name
    action: str = ""  # a guard event: report, clamp, impute, reject or rollback
    detail: str = ""

    def encode(self) -> bytes:
        return msgpack.packb(self.__dict__)  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, raw: bytes) -> SessionEvent | None:
        """An entry as the store holds it; None if it is not one (never raises)."""
        try:
            fields = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            event = cls(**fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError, msgpack.UnpackException):
            return None
        if event is None or event.kind not in KINDS or not isinstance(event.step, int):
            return None
        return event

    @classmethod
    def rollback(cls, step: int, to_step: int, cause: str, detail: str = "") -> SessionEvent:
        return cls("rollback", step, time.time(), to_step=to_step, cause=cause, detail=detail)

    @classmethod
    def of_guard(cls, event: GuardEvent) -> SessionEvent:
        return cls(
            "guard", event.step, time.time(), guard=event.guard[:64],
            action=GuardAction(event.action).name.lower(), detail=event.detail[:256],
        )  # fmt: skip


async def record(store: Store, lease: SessionLease, events: Sequence[SessionEvent]) -> None:
    """Append ``events`` for the lease's session; a failure is logged, never raised."""
    if not events:
        return
    try:
        await store.record_events(lease, [e.encode() for e in events])
    except SsmserveError as exc:
        log.warning("session %s: %d events not recorded: %s", lease.session_id, len(events), exc)
