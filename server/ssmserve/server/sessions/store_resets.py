"""Sessions a wiped or replaced store took with it (``cluster.store_guard``).

The worker remembers which sessions it expects the store to hold: the resident ones, and
those that left memory only to be reloaded (an unknown write outcome, a Redis restart)
with the step each was at. When the store's identity changes, every one of them is lost:
resident sessions leave memory (nothing is served from memory as if nothing had
happened), and every later request about one answers DATA_LOSS
(:class:`~ssmserve.server.state.store_errors.StoreResetError`, "the store was wiped or
replaced; session X at step N is lost") where the store says the session does not exist,
until a client creates or imports the id again or the worker restarts. Both memories are
bounded (:data:`REMEMBERED`, the oldest forgotten first).

A session this worker expects the store to hold whose metadata is found missing (a
fenced write refused as ``SessionVanishedError``, a load that finds nothing) makes the
worker check the store's identity before it answers NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

from ssmserve.server.errors import SessionMovedError, SsmserveError
from ssmserve.server.state.store_errors import (
    SessionClosedError,
    SessionMissingError,
    SessionVanishedError,
    StoreResetError,
)
from ssmserve.server.state.store_facts import StoreIdentity

if TYPE_CHECKING:
    from ssmserve.server.cluster.store_guard import StoreGuard
    from ssmserve.server.sessions.session import Session

log = logging.getLogger(__name__)

#: Sessions remembered, each of the two kinds (lost; left memory to be reloaded): about
#: 100 bytes each, so at most ~10 MB each.
REMEMBERED = 100_000

#: Errors a session leaves memory with that mean it is not this worker's to reload.
_NOT_RELOADED = (SessionMovedError, SessionMissingError, SessionClosedError, StoreResetError)


class ResidentTable(Protocol):
    """What a reset needs of the table of resident sessions
    (``residency.ResidentSessions``): it reads which sessions are resident and drops
    them. Named here so that this module stays below ``residency``, which owns one."""

    by_id: dict[str, Session]

    def drop(self, s: Session, error: SsmserveError) -> None: ...


class StoreResets:
    """What this worker remembers of sessions it expects the store to hold, and of those
    the store lost. ``residents`` is the table they are resident in; ``guard``'s identity
    checks are followed (None: nothing is checked, in unit tests)."""

    def __init__(
        self,
        residents: ResidentTable,
        guard: StoreGuard | None = None,
        remembered: int = REMEMBERED,
    ) -> None:
        self.residents = residents
        self.remembered = remembered
        self.guard = guard
        if guard is not None:
            guard.on_reset = self.reset
        self._lost: OrderedDict[str, int] = OrderedDict()  # session id -> its step
        self._reloading: OrderedDict[str, int] = OrderedDict()  # left memory to reload
        self._checks: set[asyncio.Task[bool]] = set()

    def resident(self, session_id: str) -> None:
        """``session_id`` is resident (created, imported, loaded): nothing is lost of it."""
        self._lost.pop(session_id, None)
        self._reloading.pop(session_id, None)

    def left(self, s: Session, error: SsmserveError) -> None:
        """``s`` left memory with ``error``: remember it if the store should still hold
        it (the next request reloads it); a session that vanished under a write makes the
        worker check the store's identity now."""
        if isinstance(error, _NOT_RELOADED) and not isinstance(error, SessionVanishedError):
            return
        _remember(self._reloading, s.id, s.step, self.remembered)
        # One check at a time: thousands of sessions vanish at once when a store is wiped.
        guard = self.guard
        if isinstance(error, SessionVanishedError) and guard is not None and not self._checks:
            check = asyncio.ensure_future(guard.check_identity())
            self._checks.add(check)
            check.add_done_callback(_checked)
            check.add_done_callback(self._checks.discard)

    def lost(self, session_id: str) -> StoreResetError | None:
        """The error for a session the store lost, or None."""
        step = self._lost.get(session_id)
        return None if step is None else StoreResetError(session_id, step)

    async def missing(self, session_id: str) -> SsmserveError:
        """The error for a session whose metadata the store does not have: DATA_LOSS if
        the store lost it, else NOT_FOUND. For a session this worker expects the store to
        hold, the store's identity is read first (a read that fails raises: retry)."""
        if (
            session_id not in self._lost
            and self.guard is not None
            and (session_id in self._reloading or session_id in self.residents.by_id)
        ):
            await self.guard.check_identity()
        return self.lost(session_id) or SessionMissingError(
            f"session {session_id!r} does not exist"
        )

    def reset(self, was: StoreIdentity | None) -> int:
        """The store was wiped or replaced: every session this worker expects it to hold
        is lost; resident ones leave memory. Returns how many."""
        lost = {s.id: s.step for s in self.residents.by_id.values() if s.gone is None}
        lost = dict(self._reloading) | lost
        self._reloading.clear()
        for session_id, step in lost.items():
            _remember(self._lost, session_id, step, self.remembered)
        for s in list(self.residents.by_id.values()):
            if s.gone is None:
                self.residents.drop(s, StoreResetError(s.id, lost[s.id]))
        if lost:
            shown = ", ".join(f"{i} at step {step}" for i, step in list(lost.items())[:20])
            more = f" and {len(lost) - 20} more" if len(lost) > 20 else ""
            log.error("sessions lost with the store: %s%s", shown, more)
        return len(lost)


def _remember(memory: OrderedDict[str, int], session_id: str, step: int, limit: int) -> None:
    memory.pop(session_id, None)
    memory[session_id] = step
    while len(memory) > limit:
        memory.popitem(last=False)


def _checked(check: asyncio.Future[bool]) -> None:
    if check.cancelled():
        return
    error = check.exception()
    if error is not None and not isinstance(error, SsmserveError):
        log.error("store identity check failed", exc_info=error)
