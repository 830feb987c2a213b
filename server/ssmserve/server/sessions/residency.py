"""The sessions resident on this worker, and whether each is still ours to answer for.

A session is resident on at most one worker: the holder of its lease
(``state.lease.SessionLease``, renewed by ``cluster.ownership``). Every store write of a
session carries its lease's fencing token (:meth:`ResidentSessions.write`); a write
refused as stale means another worker took the session over, and it leaves memory at
once. Nothing is answered for a session while this worker's clock says its lease may
have run out (:meth:`ResidentSessions.hold` revalidates first).

A write whose outcome is unknown, or a log that does not continue what Redis holds:
- if the write only adds to what Redis holds (a log append or flush, a snapshot commit),
  memory is kept, *unsettled*: nothing is answered for the session until its lease is
  proven again and the store says what it holds (:meth:`ResidentSessions.settle`);
  memory then goes on if it holds everything the store lacks, else it is dropped;
- any other write drops the session: the next request reloads it from Redis.
Only a session taken over by another worker, or a store that holds more than memory,
lets a session's memory go; a stalled Redis costs answers, never answered steps.

The inputs a session holds unlogged (``snapshot`` and ``none`` durability) are written
here too (:meth:`ResidentSessions.flush_unflushed`): a flush is such an adding write, and
settling reads where the store's log ends, so the two take turns per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from ssmserve.server.cluster.ownership import Ownership
from ssmserve.server.cluster.store_guard import StoreGuard
from ssmserve.server.errors import SessionMovedError, SsmserveError
from ssmserve.server.sessions.config import Durability
from ssmserve.server.sessions.errors import ReloadingError
from ssmserve.server.sessions.locks_while_used import LocksWhileUsed
from ssmserve.server.sessions.memory import WorkerMemory
from ssmserve.server.sessions.session import Session
from ssmserve.server.sessions.store_resets import StoreResets
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_errors import (
    LogDivergedError,
    SessionClosedError,
    SessionMissingError,
    SessionVanishedError,
    StaleEpochError,
    StoreOutcomeUnknownError,
    StoreUnavailableError,
)

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Errors that mean a session is not this worker's any more.
_NOT_OURS = (SessionMovedError, SessionMissingError, SessionClosedError)


class ResidentSessions:
    """The table of resident sessions (``by_id``) and the fencing of their writes.

    ``memory``: the worker's budget, told what resident sessions may hold; ``guard``:
    the store's identity checks, followed by ``resets`` (None: nothing is checked)."""

    def __init__(
        self,
        store: Store,
        ownership: Ownership,
        memory: WorkerMemory,
        guard: StoreGuard | None = None,
    ) -> None:
        self.store = store
        self.ownership = ownership
        self.memory = memory
        self.by_id: dict[str, Session] = {}
        self._footprints: dict[str, int] = {}  # session id -> bytes it may hold
        # The same by the part of the id before '~' (the tenant, in ``api.tenancy``'s
        # scheme; '' for ids without one), for per-tenant budgets.
        self._footprint_by_group: Counter[str] = Counter()
        self._background: set[asyncio.Task[None]] = set()  # re-acquisitions under way
        self._lease_checks = LocksWhileUsed()
        self._flushes = LocksWhileUsed()  # one log flush or settling of a session at a time
        self.resets = StoreResets(self, guard)  # what a wiped store took (``store_resets``)

    def get(self, session_id: str) -> Session | None:
        """The resident session ``session_id`` unless it is gone (being dropped)."""
        s = self.by_id.get(session_id)
        return s if s is not None and s.gone is None else None

    def add(self, s: Session, footprint: int = 0, lease: SessionLease | None = None) -> None:
        """``s`` is resident from now on (held under ``lease``, when it comes with a new
        one); it may hold up to ``footprint`` bytes."""
        if lease is not None:
            s.lease = lease
        self.remove(s.id)
        self.by_id[s.id] = s
        self.resets.resident(s.id)
        self._footprints[s.id] = footprint
        self.memory.resident_bytes += footprint
        self._footprint_by_group[_group(s.id)] += footprint

    def remove(self, session_id: str) -> None:
        """``session_id`` is not resident any more (closed, unloaded, dropped)."""
        self.by_id.pop(session_id, None)
        footprint = self._footprints.pop(session_id, 0)
        self.memory.resident_bytes -= footprint
        self._footprint_by_group[_group(session_id)] -= footprint

    def footprint_of(self, prefix: str) -> int:
        """Bytes resident sessions whose id starts with ``prefix`` ('tenant~') may hold."""
        return self._footprint_by_group[prefix.removesuffix("~")]

    def clear(self) -> None:
        self.by_id.clear()
        self._footprints.clear()
        self._footprint_by_group.clear()
        self.memory.resident_bytes = 0

    def held(self) -> list[SessionLease]:
        """The lease of every resident session not known to have run out (renewed by
        ``Ownership``; one known to have run out is acquired again on its next use)."""
        return [s.lease for s in self.by_id.values() if s.gone is None and s.lease.valid_until]

    def drop(self, s: Session, error: SsmserveError) -> None:
        """Forget ``s`` at once; what is queued for it is answered with ``error``."""
        log.info(
            "session %s dropped from memory: %s", s.id, error,
            extra={"session_id": s.id, "step": s.step, "token": s.lease.token,
                   "event": "fenced" if isinstance(error, _NOT_OURS) else "dropped"},
        )  # fmt: skip
        s.fail_queued(error)
        # Answers made from this memory and not yet sent stay unsent (``answer_fence``):
        # whoever holds the session next may answer later steps first.
        s.lease.expire()
        if self.by_id.get(s.id) is s:
            self.remove(s.id)
            self.resets.left(s, error)

    def lost(
        self, s: Session, lease: SessionLease, error: SsmserveError, settle: bool = False
    ) -> None:
        """A write or lease renewal with ``lease`` failed with ``error``: if it means the
        session is not ours any more, drop ``s`` from memory (the next request is sent to
        its new owner). If memory and Redis may differ (an unknown outcome, a log that does
        not continue), drop it too: the next request loads it again from Redis, the
        source of truth.

        ``settle``: the write only adds to what Redis holds (a log append or flush, a
        snapshot commit), so memory still holds everything Redis may lack. Then memory
        is kept and answers nothing until the store says which outcome it was
        (:meth:`settle`): for ``snapshot`` and ``none`` durability memory holds the only
        copy of the steps since the last flush, and dropping it would lose steps that
        were answered. This holds even if the lease may have run out meanwhile: settling
        first proves the lease (renewed, or acquired again with the same token, which
        only works if nobody else acquired it since), so memory goes on only if it is
        provably still the session's.

        A lease that is no longer the session's (it was acquired again since) proves
        nothing about the session as it is now, so it is left alone."""
        if s.lease is not lease or self.by_id.get(s.id) is not s:
            return
        if isinstance(error, _NOT_OURS):
            self.drop(s, error)
        elif isinstance(error, StoreOutcomeUnknownError | LogDivergedError):
            if settle:
                if s.unsettled is None:
                    log.warning(
                        "session %s: a write's outcome is unknown (%s); it answers nothing "
                        "until the store says which it was", s.id, error,
                        extra={"session_id": s.id, "step": s.step, "event": "unsettled"},
                    )  # fmt: skip
                s.unsettled = error
                return
            self.drop(
                s,
                ReloadingError(
                    f"session {s.id!r} is being reloaded from the store ({error}); retry"
                ),
            )

    def lost_lease(self, lease: SessionLease, error: SsmserveError) -> None:
        """``Ownership`` found ``lease`` someone else's."""
        s = self.by_id.get(lease.session_id)
        if s is not None:
            self.lost(s, lease, error)

    def expired_lease(self, lease: SessionLease) -> None:
        """``Ownership`` found ``lease`` ran out unrenewed: acquire it again, between steps."""
        s = self.by_id.get(lease.session_id)
        if s is None or s.lease is not lease or s.gone is not None:
            return

        async def reacquire() -> None:
            with contextlib.suppress(SsmserveError):
                async with self.hold(s, read_only=True):
                    pass  # holding it revalidates the lease

        task = asyncio.create_task(reacquire(), name=f"reacquire[{s.id}]")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def revalidate(self, sessions: list[Session]) -> dict[str, SsmserveError]:
        """Make sure this worker still owns each of ``sessions`` before it answers for them.

        A lease still valid by this worker's clock needs nothing. The others are renewed
        (one round trip), or, if they ran out while nobody took the session, acquired
        again (a new token; memory is still exact, since no one else wrote meanwhile).
        Returns the errors of the sessions that could not be revalidated; those that are
        not ours any more have been dropped. The others (Redis unreachable) stay in
        memory, unanswered, until a renewal succeeds: a renewal changes no session data,
        so even an unknown outcome leaves memory and store in agreement. The caller holds
        the sessions.
        """
        stale = [s for s in sessions if s.gone is None and not s.lease.valid()]
        errors: dict[str, SsmserveError] = {}
        if stale:
            leases = [s.lease for s in stale]
            for s, lease, result in zip(
                stale, leases, await self.ownership.revalidate(leases), strict=True
            ):
                if isinstance(result, SessionLease):
                    if s.lease is lease:
                        s.lease = result
                    continue
                errors[s.id] = result
                if isinstance(result, _NOT_OURS):
                    self.lost(s, lease, result)
        for s in sessions:
            if s.gone is None and s.unsettled is not None and s.id not in errors:
                error = await self.settle(s)
                if error is not None:
                    errors[s.id] = error
        return errors

    async def settle(self, s: Session) -> SsmserveError | None:
        """Learn what the store holds of ``s`` after a write with an unknown outcome, and
        go on from memory if memory holds it all (:meth:`_store_agrees`). None: ``s``
        answers again. Otherwise the error: the store unreachable (``s`` stays,
        unanswered), or memory cannot follow the store (``s`` left memory and reloads).

        First ``s`` is acquired again (a new token): a write of it still in flight under
        the old token (the one whose outcome is unknown, held in the network) is then
        refused when it lands, instead of landing after what is read here."""
        fenced = await self.ownership.reacquire(s.lease)
        if isinstance(fenced, SessionLease):
            s.lease = fenced
            error = await self._store_agrees(s)
        else:
            error = fenced
        if error is None:
            if s.unsettled is not None:
                log.info(
                    "session %s: the store agrees with memory at step %d; answering again",
                    s.id, s.step, extra={"session_id": s.id, "step": s.step, "event": "settled"},
                )  # fmt: skip
            s.unsettled = None
            return None
        if isinstance(error, StoreUnavailableError):
            # Not yet: ask again on the next request. Memory stays even if the lease ran
            # out meanwhile: its revalidation acquires it again only if nobody else did
            # (the same token), which proves memory is still the session's.
            return error
        if isinstance(error, _NOT_OURS):
            self.drop(s, error)
        else:
            self.drop(
                s,
                ReloadingError(
                    f"session {s.id!r} is being reloaded from the store ({error}); retry"
                ),
            )
        return s.gone or error

    async def _store_agrees(self, s: Session) -> SsmserveError | None:
        """After a write of ``s`` whose outcome is unknown: read what the store holds and
        make memory's bookkeeping match it, if memory holds everything the store lacks.

        The store's durable step ``D`` must be where memory's log stands: the step before
        its oldest unflushed input (those up to ``D`` landed: they are flushed now), or,
        with nothing unflushed, memory's own step. The newest snapshot at or before
        memory's step is the one memory knows of (a commit that landed unanswered counts).
        Returns None when settled; a StoreUnavailableError when the store did not answer
        (ask again later); the reason memory cannot go on otherwise (the session is not
        ours, or the store holds steps memory gave back: it reloads)."""
        async with self._flushes.hold(s):  # no flush of it runs meanwhile
            try:
                meta = await self.store.get_meta(s.id)
                newest = await self.store.snapshot_at_or_before(s.id, s.step)
            except StoreUnavailableError as exc:
                return exc
            if meta is None:  # a later owner closed it, or the store was wiped: checked
                return SessionVanishedError(
                    f"session {s.id!r} is gone from the store while this worker held it; retry"
                )
            if meta.closed:
                return SessionMissingError(f"session {s.id!r} is gone from the store")
            if meta.token != s.lease.token:
                return StaleEpochError(
                    f"session {s.id!r} was taken over (its token is now {meta.token})",
                    owner=meta.owner_addr,
                )
            unflushed = s.recent.unflushed
            if unflushed and unflushed.first <= meta.step:
                unflushed.drop(min(len(unflushed), meta.step - unflushed.first + 1))
            logged = unflushed.first - 1 if unflushed else s.step
            if meta.step < logged and s.config.durability == Durability.LOG:
                # Each of these steps was answered after the store took it: the store
                # lost them (a failover to a replica that missed them, a restart that
                # lost its last writes). The session reloads; its client resends them.
                log.warning(
                    "session %s: the store lost acknowledged steps %d..%d (its log ends "
                    "at step %d); the session reloads from the store and its client is "
                    "told it was rewound", s.id, meta.step + 1, logged, meta.step,
                    extra={"session_id": s.id, "step": logged, "event": "store_lost_steps"},
                )  # fmt: skip
            if meta.step != logged:
                return LogDivergedError(
                    f"the store's log of session {s.id!r} ends at step {meta.step}, memory's "
                    f"at step {logged}"
                )
            if newest is not None:
                s.last_snapshot_step = newest.step
        return None

    async def flush_unflushed(self, s: Session, upto: int) -> None:
        """Write the session's unflushed inputs with step <= ``upto`` to the log."""
        async with self._flushes.hold(s):  # the stepper and a background snapshot may both flush
            block = s.recent.unflushed.block(upto)
            if block is None:
                return
            lease = s.lease
            task = asyncio.ensure_future(self.store.append_logs([(lease, block)], time.time()))
            try:
                (error,) = await asyncio.shield(task)
            except SsmserveError as exc:
                error = exc
            except asyncio.CancelledError:
                # The request went away (a Snapshot, Close or Migrate): the append runs to
                # its end, and memory follows how it ended, so no input is sent twice or
                # lost (for snapshot and none durability memory holds the only copy).
                ended = await write_outcome(task)
                if ended is None:
                    (ended,) = task.result()
                if ended is None:
                    s.recent.unflushed.drop(block.count)
                else:
                    self.lost(s, lease, ended, settle=True)
                raise
            if error is not None:
                self.lost(s, lease, error, settle=True)
                raise error
            # Steps recorded meanwhile were appended behind these: drop just the written.
            s.recent.unflushed.drop(block.count)

    async def ensure_lease(self, s: Session) -> None:
        """:meth:`revalidate` for one session; raises what stands in the way."""
        if s.answerable():
            return
        async with self._lease_checks.hold(s):  # one revalidation of a lease at a time
            error = (await self.revalidate([s])).get(s.id)
        if error is not None:
            if isinstance(error, StaleEpochError | SessionMissingError | SessionClosedError):
                raise await self.redirect(s.id, error)
            raise error
        if s.gone is not None:
            raise s.gone

    async def redirect(self, session_id: str, error: SsmserveError) -> SsmserveError:
        """Where a caller should go for a session this worker just lost (best effort)."""
        with contextlib.suppress(SsmserveError):
            holder = await self.store.lease_holder(session_id)
            if holder is not None and holder.owner_addr:
                return self.ownership.not_to_self(session_id, holder.redirect(session_id))
        return self.ownership.not_to_self(session_id, error)

    @contextlib.asynccontextmanager
    async def hold(self, s: Session, read_only: bool = False) -> AsyncIterator[None]:
        """Hold ``s`` between two steps (``Session.exclusive``), its lease revalidated."""
        async with s.exclusive(read_only=read_only):
            await self.ensure_lease(s)
            yield

    async def write(
        self, s: Session, write: Callable[[SessionLease], Awaitable[T]], settle: bool = False
    ) -> T:
        """Run a store write of ``s`` with its lease; on an error that means the session
        is not ours any more, or that its outcome is unknown, drop ``s`` and re-raise.

        The write runs to its end even if the request that made it goes away (a client's
        deadline on a rollback or a migration): then how it ended is learnt, not guessed
        (:func:`write_outcome`). A write that landed while its caller will not change
        memory to match drops ``s`` (with ``settle``: leaves it unsettled, see
        :meth:`lost`); one that did not land changes nothing."""
        lease = s.lease
        task = asyncio.ensure_future(write(lease))
        try:
            return await asyncio.shield(task)
        except SsmserveError as exc:
            self.lost(s, lease, exc, settle)
            raise
        except asyncio.CancelledError:
            error = await write_outcome(task)
            unknown = error or StoreOutcomeUnknownError("a write landed unanswered")
            self.lost(s, lease, unknown, settle)
            raise


async def write_outcome(task: asyncio.Future[object]) -> SsmserveError | None:
    """How a store write shielded from its cancelled caller ended: None if it landed, its
    error if not. Waits for it (every store call has a deadline of its own); cancelled
    again meanwhile, the outcome is unknown."""
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        return StoreOutcomeUnknownError("a write was cancelled twice under way")
    if task.cancelled():
        return StoreOutcomeUnknownError("a write was cancelled under way")
    error = task.exception()
    if error is None:
        return None
    if isinstance(error, SsmserveError):
        return error
    return StoreOutcomeUnknownError(f"a write failed under way: {type(error).__name__}")


def _group(session_id: str) -> str:
    group, sep, _ = session_id.partition("~")
    return group if sep else ""
