"""The session manager: the hot sessions of one worker, their snapshots, rollback and replay.

Everything that changes a session goes through here, and every change is all-or-nothing:
a request that fails leaves the session exactly as it was. The pieces:

- **create / import / fork** write the session's metadata, lease and first snapshot (step
  0, or the imported or forked step) in one script, so every step from there on can be
  rebuilt and a session never exists without its base.
- **snapshots** are checkpoints (``server/checkpoint.py``) committed through the store.
- **rollback to t**: restore the newest snapshot at or before t, replay the logged inputs
  up to t (batch invariance makes this bit-exact), then cut history after t in Redis.
- **load**: a session that is not in memory (evicted, or its worker restarted) is restored
  the same way, up to its durable step.
- **idle eviction**: an idle session is snapshotted and dropped from memory.
- **ownership**: a session is resident on at most one worker, the holder of its lease
  (``server/lease.py``, renewed by ``server/ownership.py``). Creating or loading a
  session acquires the lease, and every write carries its fencing token; a write refused
  as stale means another worker took the session over, and it is dropped from memory at
  once. Nothing is answered for a session while this worker's clock says its lease may
  have run out (``revalidate``). A write whose outcome is unknown drops the session too:
  the next request reloads it from Redis. Loading a session that another live worker
  holds raises :class:`SessionMovedError` with that worker's address; one computed with
  other numerics is sent to a worker that has them, or refused.
- **hand-off** (migration): between two steps, snapshot, reserve the session for the
  target, let the target acquire and load it, then drop it here; the steps queued
  meanwhile are answered with a redirect to the target.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ssmserve.server.cluster.ownership import Ownership
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import (
    CheckpointError,
    ErrorKind,
    SessionMovedError,
    SsmserveError,
    clip,
)
from ssmserve.server.sessions.config import SessionConfig, SessionDefaults
from ssmserve.server.sessions.forecaster import (
    BadHorizonError,
    Forecaster,
    ForecastJob,
    ForecastLimitError,
    ForecastSettings,
    ForecastUnsupportedError,
    feedback,
)
from ssmserve.server.sessions.guards import check_output
from ssmserve.server.sessions.session import (
    Session,
    SessionGoneError,
    SnapshotEvent,
    StepJob,
    StepOutcome,
)
from ssmserve.server.sessions.stepper import Stepper, StepperSettings
from ssmserve.server.state.checkpoint import Checkpoint, CheckpointMeta, InputHistory
from ssmserve.server.state.input_log import RecentSteps
from ssmserve.server.state.lease import SessionLease, new_incarnation
from ssmserve.server.state.store import (
    BadSessionIdError,
    LabelTakenError,
    LogDivergedError,
    SessionClosedError,
    SessionMeta,
    SessionMissingError,
    SnapshotRecord,
    StaleEpochError,
    Store,
    StoreDataError,
    StoreOutcomeUnknownError,
    WorkerRecord,
    check_session_id,
)
from ssmserve.server.state.store_layout import MAX_STEP

T = TypeVar("T")

# Checkpoints of at least this many state bytes are encoded (sha256) on a thread, which
# keeps the event loop answering meanwhile; smaller ones cost less than the hop.
_ENCODE_IN_THREAD_BYTES = 1 << 20

log = logging.getLogger(__name__)


class UnknownModelError(SsmserveError):
    kind = ErrorKind.NOT_FOUND


class BadStepInputError(SsmserveError):
    pass


class SnapshotMissingError(SsmserveError):
    kind = ErrorKind.NOT_FOUND


class RollbackRangeError(SsmserveError):
    """A rollback target outside the steps the session can still reach."""

    kind = ErrorKind.FAILED_PRECONDITION


class ModelMismatchError(SsmserveError):
    """A stored session or checkpoint belongs to another model than the one loaded."""

    kind = ErrorKind.FAILED_PRECONDITION


class CapacityError(SsmserveError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class WorkerDrainingError(SsmserveError):
    """This worker is draining and no other live worker can take the request."""

    kind = ErrorKind.UNAVAILABLE


class BadLabelError(SsmserveError):
    pass


class BadPageTokenError(SsmserveError):
    pass


class StepRangeError(SsmserveError):
    """A step number beyond what the store can represent exactly (``MAX_STEP``)."""


class NumericsMismatchError(SsmserveError):
    """The session's history was computed with other numerics than this worker's."""

    kind = ErrorKind.FAILED_PRECONDITION


class ReloadingError(SsmserveError):
    """The session left memory to be reloaded from the store (an unknown write outcome,
    or memory and store diverged); retrying the request reloads it."""

    kind = ErrorKind.UNAVAILABLE


class HandOffError(SsmserveError):
    """A migration's target did not take the session; the source keeps serving it."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class ManagerSettings:
    """Limits of one worker's session manager (documented defaults)."""

    defaults: SessionDefaults = field(default_factory=SessionDefaults)
    stepper: StepperSettings = field(default_factory=StepperSettings)
    forecast: ForecastSettings = field(default_factory=ForecastSettings)
    max_sessions: int = 10_000  # resident sessions; creating or loading more is refused
    max_queued_steps: int = 4096  # per session, waiting for the stepper
    output_window: int = 64  # outputs kept per session to answer resent steps from memory
    idle_check_s: float = 1.0  # how often idle sessions are looked for
    # Background snapshot writes running at once on this worker (all sessions). Sessions
    # that step in lockstep come due together; a bound spreads their writes over the
    # following steps instead of stalling one tick behind dozens of Redis round trips.
    snapshot_writes_in_flight: int = 2
    list_page_size: int = 100
    max_list_page_size: int = 1000


@dataclass(frozen=True)
class SessionView:
    """What GetSession answers: a session resident here or only in the store."""

    session_id: str
    model: str
    fingerprint: str
    step: int
    config: SessionConfig
    created_at: float
    updated_at: float
    snapshot_count: int
    oldest_rollback_step: int
    owner: str
    resident: bool
    input_dim: int
    output_dim: int
    token_input: bool
    closed: bool


@dataclass(frozen=True)
class RollbackTarget:
    """Exactly one of these is set."""

    snapshot_id: str | None = None
    label: str | None = None
    step: int | None = None
    steps_back: int | None = None


@dataclass(frozen=True)
class RollbackResult:
    step: int
    from_snapshot_id: str
    replayed_steps: int


@dataclass(frozen=True)
class StatePoint:
    """A session as it was at one step, rebuilt without changing it (forecast, fork)."""

    step: int
    state: SessionState
    output: np.ndarray | None  # the (guarded) output of ``step``; None when unknown
    history: InputHistory  # the inputs up to ``step`` (the session's history window)
    from_snapshot_id: str  # "" when the session was at ``step`` (its live state)
    replayed_steps: int


@dataclass(frozen=True)
class ForkResult:
    view: SessionView  # the fork
    source_session_id: str
    step: int
    from_snapshot_id: str
    replayed_steps: int


class SessionManager:
    def __init__(
        self,
        models: Mapping[str, MambaModel],
        store: Store,
        ownership: Ownership,
        settings: ManagerSettings,
    ) -> None:
        self.models = dict(models)
        self.store = store
        self.ownership = ownership
        self.settings = settings
        self._sessions: dict[str, Session] = {}
        self._loading: dict[str, asyncio.Future[Session]] = {}
        self.steppers = {
            name: Stepper(model, store, self, settings.stepper) for name, model in models.items()
        }
        self.forecasters = {
            name: Forecaster(model, self.steppers[name].engine, settings.forecast)
            for name, model in models.items()
        }
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # re-acquisitions under way
        self._snapshot_slots = asyncio.Semaphore(settings.snapshot_writes_in_flight)

    # ------------------------------------------------------------------ lifecycle

    async def warm_up(self) -> None:
        """Compile every model's kernels (off the event loop) before the worker serves."""
        for name, stepper in self.steppers.items():
            seconds = await asyncio.to_thread(stepper.engine.warm_up)
            log.info("model %s: kernels ready in %.2f s", name, seconds)

    def start(self) -> None:
        for stepper in self.steppers.values():
            stepper.start()
        for forecaster in self.forecasters.values():
            forecaster.start()
        self._reaper = asyncio.create_task(self._evict_idle(), name="idle-eviction")

    async def stop(self) -> None:
        """Snapshot every resident session that moved since its last snapshot, then stop."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await asyncio.gather(
            *(self._unload(s, "shutdown") for s in list(self._sessions.values())),
            return_exceptions=True,
        )
        for forecaster in self.forecasters.values():
            await forecaster.stop()
        for stepper in self.steppers.values():
            await stepper.stop()

    async def abandon(self) -> None:
        """Stop at once and write nothing: what a crash leaves behind in Redis."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for forecaster in self.forecasters.values():
            await forecaster.stop()
        for stepper in self.steppers.values():
            await stepper.stop()
        for s in list(self._sessions.values()):
            s.fail_queued(SessionGoneError(f"session {s.id!r}: the worker stopped"))
        self._sessions.clear()

    @property
    def resident_count(self) -> int:
        return len(self._sessions)

    def resident_ids(self) -> list[str]:
        return list(self._sessions)

    # ------------------------------------------------------------------ ownership

    def held(self) -> list[SessionLease]:
        """The lease of every resident session not known to have run out (renewed by
        ``Ownership``; one known to have run out is acquired again on its next use)."""
        return [s.lease for s in self._sessions.values() if s.gone is None and s.lease.valid_until]

    def lost(self, s: Session, lease: SessionLease, error: SsmserveError) -> None:
        """A write or lease renewal with ``lease`` failed with ``error``: if it means the
        session is not ours any more, or that memory and Redis may differ (an unknown
        outcome, a log that does not continue), drop ``s`` from memory. The next request
        loads it again from Redis, the source of truth, or is sent to its new owner.

        A lease that is no longer the session's (it was acquired again since) proves
        nothing about the session as it is now, so it is left alone."""
        if s.lease is not lease or self._sessions.get(s.id) is not s:
            return
        if isinstance(
            error,
            SessionMovedError | SessionMissingError | SessionClosedError,
        ):
            self.drop(s, error)
        elif isinstance(error, StoreOutcomeUnknownError | LogDivergedError):
            self.drop(
                s,
                ReloadingError(
                    f"session {s.id!r} is being reloaded from the store ({error}); retry"
                ),
            )

    def lost_lease(self, lease: SessionLease, error: SsmserveError) -> None:
        """``Ownership`` found ``lease`` someone else's."""
        s = self._sessions.get(lease.session_id)
        if s is not None:
            self.lost(s, lease, error)

    def expired_lease(self, lease: SessionLease) -> None:
        """``Ownership`` found ``lease`` ran out unrenewed: acquire it again, between steps."""
        s = self._sessions.get(lease.session_id)
        if s is None or s.lease is not lease or s.gone is not None:
            return

        async def reacquire() -> None:
            with contextlib.suppress(SsmserveError):
                async with self._hold(s, read_only=True):
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
        if not stale:
            return {}
        errors: dict[str, SsmserveError] = {}
        leases = [s.lease for s in stale]
        for s, lease, result in zip(
            stale, leases, await self.ownership.revalidate(leases), strict=True
        ):
            if isinstance(result, SessionLease):
                if s.lease is lease:
                    s.lease = result
                continue
            errors[s.id] = result
            if isinstance(result, SessionMovedError | SessionMissingError | SessionClosedError):
                self.lost(s, lease, result)
        return errors

    async def ensure_lease(self, s: Session) -> None:
        """:meth:`revalidate` for one session; raises what stands in the way."""
        if s.lease.valid():
            return
        async with s.lease_check:
            error = (await self.revalidate([s])).get(s.id)
        if error is not None:
            if isinstance(error, StaleEpochError | SessionMissingError | SessionClosedError):
                raise await self._redirect(s.id, error)
            raise error
        if s.gone is not None:
            raise s.gone

    async def _redirect(self, session_id: str, error: SsmserveError) -> SsmserveError:
        """Where a caller should go for a session this worker just lost (best effort)."""
        with contextlib.suppress(SsmserveError):
            holder = await self.store.lease_holder(session_id)
            if holder is not None and holder.owner_addr:
                return holder.redirect(session_id)
        return error

    @contextlib.asynccontextmanager
    async def _hold(self, s: Session, read_only: bool = False) -> AsyncIterator[None]:
        """Hold ``s`` between two steps (``Session.exclusive``), its lease revalidated."""
        async with s.exclusive(read_only=read_only):
            await self.ensure_lease(s)
            yield

    def drop(self, s: Session, error: SsmserveError) -> None:
        """Forget ``s`` at once; what is queued for it is answered with ``error``."""
        log.info("session %s dropped from memory: %s", s.id, error)
        s.fail_queued(error)
        if self._sessions.get(s.id) is s:
            del self._sessions[s.id]

    async def _write(self, s: Session, write: Callable[[SessionLease], Awaitable[T]]) -> T:
        """Run a store write of ``s`` with its lease; on an error that means the session
        is not ours any more, or that its outcome is unknown, drop ``s`` and re-raise."""
        lease = s.lease
        try:
            return await write(lease)
        except SsmserveError as exc:
            self.lost(s, lease, exc)
            raise

    async def _elsewhere(self, model: str, what: str) -> SessionMovedError:
        """This worker is draining: point the caller at the least loaded other worker."""
        targets = await self.ownership.targets(model)
        if not targets:
            raise WorkerDrainingError(f"this worker is draining and no other worker can {what}")
        return SessionMovedError(
            f"this worker is draining; {targets[0].address} can {what}", owner=targets[0].address
        )

    # ------------------------------------------------------------------ create / get / list

    async def create(self, model_name: str, session_id: str, config: SessionConfig) -> SessionView:
        model = self._model(model_name)
        session_id = self._new_id(session_id)
        config = config.resolve(self.settings.defaults, model.config.output_dim)
        self._check_capacity()
        if self.ownership.draining:
            raise await self._elsewhere(model_name, "create sessions")
        await self._create(session_id, model, model_name, config, model.new_state(), 0, "create")
        return await self.view(session_id)

    async def _create(
        self,
        session_id: str,
        model: MambaModel,
        model_name: str,
        config: SessionConfig,
        state: SessionState,
        step: int,
        reason: str,
        history: InputHistory | None = None,
        output: np.ndarray | None = None,
    ) -> Session:
        """A new session at ``step``, owned here: its metadata, lease and first snapshot
        (``state``, the ``history`` window, the ``output`` of ``step``) written at once.

        The fencing token starts a new incarnation, so nothing a worker did with an
        earlier session of the same id can touch this one.
        """
        now = time.time()
        lease = SessionLease(session_id, f"{new_incarnation()}.1", self.ownership.worker_id)
        s = self._resident(session_id, model, model_name, config, state, step, now, lease)
        if history is not None:
            self._remember_history(s, history)
        if output is not None:  # a resend of ``step`` is answered, as by the source
            s.recent.remember_output(step, output)
        blob, record = await self._encode(self._checkpoint(s, step, state, reason))
        meta = SessionMeta(
            session_id, model_name, model.fingerprint, step, step + 1, config.to_bytes(), now,
            now, False, epoch=1, owner=self.ownership.worker_id,
            owner_addr=self.ownership.address, token=lease.token,
            numerics=self.ownership.numerics,
        )  # fmt: skip
        sent_at = time.monotonic()
        await self.store.create_session(
            meta, self.ownership.lease_ms, record, blob, config.max_snapshots
        )
        s.lease = self.ownership.new_lease(session_id, lease.token, sent_at)
        s.last_snapshot_step = step
        self._sessions[session_id] = s
        return s

    async def view(self, session_id: str) -> SessionView:
        await self._settled(session_id)
        s = self._sessions.get(session_id)
        if s is not None and s.gone is None and not s.lease.valid():
            # What memory says counts only while the lease is surely ours.
            with contextlib.suppress(SessionMovedError, SessionGoneError, ReloadingError):
                async with self._hold(s, read_only=True):
                    pass
            s = self._sessions.get(session_id)
        if s is not None and s.gone is not None:
            s = None
        meta = await self.store.get_meta(session_id)
        if meta is None:
            raise SessionMissingError(f"session {session_id!r} does not exist")
        count, oldest = await self.store.snapshot_count_and_oldest(session_id)
        lease = None if s else await self.store.lease_holder(session_id)
        model = self.models.get(meta.model)
        config = s.config if s else SessionConfig.from_bytes(meta.config)
        step = s.step if s else meta.step
        return SessionView(
            session_id=session_id,
            model=meta.model,
            fingerprint=meta.fingerprint,
            step=step,
            config=config,
            created_at=meta.created_at,
            updated_at=s.updated_at if s else meta.updated_at,
            snapshot_count=count,
            oldest_rollback_step=step if oldest is None else oldest,
            owner=self.ownership.address if s else (lease.owner_addr if lease else ""),
            resident=s is not None or lease is not None,
            input_dim=0 if model is None or model.config.is_token_model else model.config.input_dim,
            output_dim=0 if model is None else model.config.output_dim,
            token_input=model is not None and model.config.is_token_model,
            closed=meta.closed,
        )

    async def list(
        self, page_size: int, page_token: str, model: str
    ) -> tuple[list[SessionView], str]:
        if len(page_token) > 128:
            raise BadPageTokenError("a page token is at most 128 characters (a session id)")
        size = min(page_size or self.settings.list_page_size, self.settings.max_list_page_size)
        ids = await self.store.list_session_ids(page_token, size)
        views = []
        for session_id in ids:
            try:
                v = await self.view(session_id)
            except SessionMissingError:  # closed meanwhile
                continue
            except (BadSessionIdError, StoreDataError) as exc:  # one bad entry, not the page
                log.warning("list: session %s skipped: %s", clip(session_id), exc)
                continue
            if not model or v.model == model:
                views.append(v)
        return views, (ids[-1] if len(ids) == size else "")

    # ------------------------------------------------------------------ steps

    async def submit(
        self, session_id: str, step: int, value: object
    ) -> asyncio.Future[StepOutcome]:
        """Queue one step; the future resolves when it is answered (errors in the outcome).

        Raises for problems found before queueing (unknown session, bad input); the session
        is untouched then.
        """
        if step > MAX_STEP:
            raise StepRangeError(
                f"step {step} is beyond the last step a session can take ({MAX_STEP})"
            )
        s = await self.session(session_id)
        arr = self._check_input(s, value)
        if len(s.queue) >= self.settings.max_queued_steps:
            raise CapacityError(
                f"session {session_id!r} already has {len(s.queue)} steps queued "
                f"(limit {self.settings.max_queued_steps}); wait for answers before sending more"
            )
        future: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()
        self.steppers[s.model_name].submit(s, StepJob(step, arr, s.codec.encode(arr), future))
        return future

    def _check_input(self, s: Session, value: object) -> np.ndarray:
        c = s.model.config
        if c.is_token_model:
            if not isinstance(value, int):
                raise BadStepInputError(
                    f"model {s.model_name!r} takes token ids, not a vector of floats"
                )
            if not 0 <= value < c.vocab_size:
                raise BadStepInputError(f"token id {value} is outside [0, {c.vocab_size})")
            return np.asarray(value, np.int64)
        if isinstance(value, int):
            raise BadStepInputError(f"model {s.model_name!r} takes float vectors, not token ids")
        arr = np.asarray(value, np.float32)
        if arr.shape != (c.input_dim,):
            raise BadStepInputError(
                f"model {s.model_name!r} takes vectors of {c.input_dim} values, got {arr.size}"
            )
        if not np.isfinite(arr).all():
            raise BadStepInputError("input vector contains NaN or Inf")
        return arr

    # ------------------------------------------------------------------ snapshots

    async def snapshot(self, session_id: str, label: str) -> SnapshotRecord:
        if len(label) > 128:
            raise BadLabelError("snapshot labels are at most 128 characters")
        s = await self.session(session_id)
        async with self._hold(s):
            if label and await self.store.snapshot_by_label(s.id, label) is not None:
                raise LabelTakenError(f"label {clip(label)} already names a snapshot of {s.id!r}")
            if not label and s.last_snapshot_step == s.step:
                newest = await self.store.snapshot_at_or_before(s.id, s.step)
                if newest is not None and newest.step == s.step:
                    return newest  # nothing moved since: the same snapshot, not a copy
            # retention never drops the snapshot it commits, so this record is current
            return await self.write_snapshot(s, s.step, s.state, "manual", label)

    async def list_snapshots(self, session_id: str) -> list[SnapshotRecord]:
        await self._meta(session_id)
        await self._settled(session_id)
        return await self.store.list_snapshots(session_id)

    async def _settled(self, session_id: str) -> None:
        """Read your writes: snapshots already due here are committed before we answer."""
        s = self._sessions.get(session_id)
        if s is not None:
            await s.snapshots.settled()

    async def write_snapshot(
        self, s: Session, step: int, state: SessionState, reason: str, label: str = ""
    ) -> SnapshotRecord:
        """Flush the inputs up to ``step``, then commit a checkpoint of ``state`` at ``step``.

        The caller holds the session (a stepper batch or :meth:`Session.exclusive`).
        """
        return await self._commit_checkpoint(s, self._checkpoint(s, step, state, reason, label))

    def schedule_snapshot(self, s: Session, step: int, state: SessionState) -> None:
        """A periodic snapshot is due: copy what it needs now, write it in the background.

        Called by the stepper while it holds the session; the write itself runs after the
        steps are answered (see ``snapshot_writer.py``).
        """
        ckpt = self._checkpoint(s, step, state.copy(), "periodic")  # own the arrays

        async def write() -> None:
            try:
                async with self._snapshot_slots:
                    record = await self._commit_checkpoint(s, ckpt)
            except SsmserveError as exc:  # the log still holds every input: only speed is lost
                log.warning("session %s: periodic snapshot at %d failed: %s", s.id, step, exc)
                return
            s.snapshot_events.append(SnapshotEvent(record.snapshot_id, record.step, "periodic"))

        s.snapshots.schedule(write)

    async def _commit_checkpoint(self, s: Session, ckpt: Checkpoint) -> SnapshotRecord:
        step = ckpt.step
        await self.flush_unflushed(s, step)
        blob, record = await self._encode(ckpt)
        await self._write(
            s, lambda lease: self.store.commit_snapshot(lease, record, blob, s.config.max_snapshots)
        )
        s.last_snapshot_step = max(s.last_snapshot_step, step)
        return record

    async def _encode(self, ckpt: Checkpoint) -> tuple[bytes, SnapshotRecord]:
        """A checkpoint's bytes and the record that indexes them under a new snapshot id."""
        if ckpt.state.nbytes >= _ENCODE_IN_THREAD_BYTES:  # sha256 releases the GIL
            blob = await asyncio.to_thread(ckpt.encode)
        else:
            blob = ckpt.encode()
        piece = self.store.settings.piece_bytes
        step = ckpt.step
        record = SnapshotRecord(
            # The writer picks the id (a retried commit is then harmless). Ids sort by step,
            # then by time: retention drops the oldest of equal steps first.
            snapshot_id=f"{step:012d}-{time.time_ns() // 1000:014x}-{secrets.token_hex(2)}",
            step=step,
            label=ckpt.meta.label or "",
            reason=ckpt.meta.reason,
            created_at=time.time(),
            size=len(blob),
            pieces=max(1, -(-len(blob) // piece)),
        )
        return blob, record

    def _checkpoint(
        self, s: Session, step: int, state: SessionState, reason: str, label: str = ""
    ) -> Checkpoint:
        return Checkpoint(
            session_id=s.id,
            step=step,
            model_id=s.model_name,
            fingerprint=s.model.fingerprint,
            state=state,
            history=self._recent_history(s, step),
            meta=CheckpointMeta(reason=reason, label=label or None),
            output=s.recent.output_at(step),
        )

    @staticmethod
    def _recent_history(s: Session, step: int) -> InputHistory:
        """The history window ending at ``step``, from the inputs the session holds."""
        first, raw = s.recent.history(step, s.config.history_window)
        return InputHistory(first, s.codec.decode_many(raw) if raw else s.codec.empty())

    async def flush_unflushed(self, s: Session, upto: int) -> None:
        """Write the session's unflushed inputs with step <= ``upto`` to the log."""
        async with s.flush_lock:  # the stepper and a background snapshot may both flush
            entries = [(step, raw) for step, raw in s.recent.unflushed if step <= upto]
            if not entries:
                return
            lease = s.lease
            try:
                (error,) = await self.store.append_logs(
                    [(lease, entries[0][0], [raw for _, raw in entries])], time.time()
                )
            except SsmserveError as exc:
                error = exc
            if error is not None:
                self.lost(s, lease, error)
                raise error
            # Steps recorded meanwhile were appended behind these: drop just the written.
            s.recent.unflushed = s.recent.unflushed[len(entries) :]

    # ------------------------------------------------------------------ rollback and replay

    async def rollback(self, session_id: str, target: RollbackTarget) -> RollbackResult:
        s = await self.session(session_id)
        async with self._hold(s):
            t, record = await self._resolve(s, target, "roll back")
            step, snapshot_id, replayed = await self.restore_to(s, t, record)
            return RollbackResult(step, snapshot_id, replayed)

    async def _resolve(
        self, s: Session, target: RollbackTarget, what: str
    ) -> tuple[int, SnapshotRecord | None]:
        """The step a target names, and its snapshot if it names one. The caller holds ``s``."""
        record: SnapshotRecord | None = None
        if target.snapshot_id is not None:
            record = await self.store.snapshot_by_id(s.id, target.snapshot_id)
            if record is None:
                raise SnapshotMissingError(
                    f"session {s.id!r} has no snapshot {clip(target.snapshot_id)}"
                )
            t = record.step
        elif target.label is not None:
            record = await self.store.snapshot_by_label(s.id, target.label)
            if record is None:
                raise SnapshotMissingError(
                    f"session {s.id!r} has no snapshot labelled {clip(target.label)}"
                )
            t = record.step
        elif target.steps_back is not None:
            if target.steps_back > s.step:
                raise RollbackRangeError(
                    f"cannot go {target.steps_back} steps back: session {s.id!r} is at "
                    f"step {s.step}"
                )
            t = s.step - target.steps_back
        elif target.step is not None:
            t = target.step
        else:
            raise BadStepInputError(f"{what} needs a snapshot id, a label, a step or steps back")
        if t > s.step:
            raise RollbackRangeError(
                f"cannot {what} session {s.id!r} at step {t}: it is at step {s.step}"
                if what != "roll back"
                else f"cannot roll session {s.id!r} forward to step {t}: it is at step {s.step}"
            )
        return t, record

    async def newest_snapshot(self, session: Session, at_most: int) -> SnapshotRecord | None:
        # A guard rollback asks while a periodic snapshot it should return to may still be
        # on its way to Redis: wait for the writes already due (read your writes).
        await session.snapshots.settled()
        return await self.store.snapshot_at_or_before(session.id, at_most)

    async def restore_to(
        self, s: Session, target: int, record: SnapshotRecord | None = None
    ) -> tuple[int, str, int]:
        """Put ``s`` exactly at step ``target``; returns (step, snapshot used, replayed).

        Computes everything first and changes Redis (the history cut) last, so a failure
        anywhere leaves the session as it was. The caller holds the session.
        """
        await s.snapshots.settled()  # a guard rollback holds a batch, not the gate
        if record is None and target == s.step:
            return target, "", 0  # already there; nothing after the current step to cut
        if record is None:
            record = await self.store.snapshot_at_or_before(s.id, target)
            if record is None:
                raise await self._out_of_range(s, target)
        _ckpt, state, outputs, inputs = await self._rebuild(s, record, target)
        await self._write(
            s, lambda lease: self.store.cut_history(lease, target, s.step, time.time())
        )
        s.state, s.step = state, target
        s.recent.cut_after(target)
        if s.recent.input_at(target) is None:  # memory had none of it: keep what replay made
            s.recent.remember(record.step + 1, inputs, outputs)
        s.last_snapshot_step = record.step
        return target, record.snapshot_id, target - record.step

    async def _out_of_range(self, s: Session, step: int) -> RollbackRangeError:
        _count, oldest = await self.store.snapshot_count_and_oldest(s.id)
        return RollbackRangeError(
            f"session {s.id!r} cannot reach step {step}: its oldest kept snapshot is at step "
            f"{oldest} (retention keeps {s.config.max_snapshots})"
        )

    async def _rebuild(
        self, s: Session, record: SnapshotRecord, target: int
    ) -> tuple[Checkpoint, SessionState, list[np.ndarray], list[bytes]]:
        """The state at ``target``: snapshot ``record`` plus replay; with the outputs."""
        ckpt = await self._read_checkpoint(s.id, record, s.model)
        raw = await self._inputs(s, record.step + 1, target)
        if not raw:
            return ckpt, ckpt.state, [], []
        # A long replay (a 130m model replays ~20 steps/s) must not stall the event loop.
        engine = self.steppers[s.model_name].engine
        outputs, state = await engine.run(s.codec.decode_many(raw), ckpt.state)
        guarded = [
            check_output(s.config.guards, record.step + 1 + i, out).output
            for i, out in enumerate(outputs)
        ]
        return ckpt, state, guarded, raw

    async def _read_checkpoint(
        self, session_id: str, record: SnapshotRecord, model: MambaModel
    ) -> Checkpoint:
        blob = await self.store.read_blob(session_id, record)
        try:
            ckpt = Checkpoint.decode(blob)
            ckpt.check_model(model)
        except CheckpointError as exc:
            raise ModelMismatchError(
                f"snapshot {record.snapshot_id} of session {session_id!r} is unusable: {exc}"
            ) from None
        return ckpt

    async def _inputs(self, s: Session, first: int, last: int) -> list[bytes]:
        """Inputs of steps first..last: from memory when it has them, else the log."""
        if last < first:
            return []
        ring = [s.recent.input_at(step) for step in range(first, last + 1)]
        if all(raw is not None for raw in ring):
            return ring  # type: ignore[return-value]
        split = s.recent.unflushed[0][0] if s.recent.unflushed else last + 1
        stored = await self.store.read_log(s.id, first, min(last, split - 1))
        memory = [raw for step, raw in s.recent.unflushed if first <= step <= last]
        return stored + memory

    async def output_at(self, session: Session, step: int) -> np.ndarray:
        """The (guarded) output of an applied step that is no longer in memory: replay it."""
        record = await self.store.snapshot_at_or_before(session.id, step - 1)
        if record is None:
            raise RollbackRangeError(
                f"step {step} of session {session.id!r} is older than its kept history, so "
                f"its output cannot be sent again"
            )
        *_, outputs, _raw = await self._rebuild(session, record, step)
        return outputs[-1]

    # ------------------------------------------------------------------ forecast and fork

    async def forecast(
        self, session_id: str, horizon: int, at_step: int | None = None
    ) -> ForecastJob:
        """Start a forecast of ``horizon`` steps from the session's current step (or
        ``at_step``); read its steps with :meth:`ForecastJob.batches`. The session is not
        changed: its state is read between two steps and the forecast runs on a copy.
        """
        limits = self.settings.forecast
        if horizon < 1:
            raise BadHorizonError("a forecast needs a horizon of at least 1 step")
        if horizon > limits.max_horizon:
            raise ForecastLimitError(
                f"a horizon of {horizon} steps is over this server's limit of "
                f"{limits.max_horizon}; ask for fewer steps, or continue from a fork"
            )
        s = await self.session(session_id)
        c = s.model.config
        if not c.is_token_model and c.output_dim != c.input_dim:
            raise ForecastUnsupportedError(
                f"model {s.model_name!r} maps {c.input_dim} input values to {c.output_dim} "
                f"output values, so its outputs cannot be fed back as its inputs; forecasts "
                f"need output_dim == input_dim (or a token model)"
            )
        size = horizon * c.output_dim * 4
        if size > limits.max_output_bytes:
            raise ForecastLimitError(
                f"a forecast of {horizon} steps of model {s.model_name!r} would hold "
                f"{size / 2**20:.1f} MiB of outputs (limit {limits.max_output_bytes / 2**20:.0f} "
                f"MiB); ask for at most {limits.max_output_bytes // (c.output_dim * 4)} steps"
            )
        forecaster = self.forecasters[s.model_name]
        forecaster.check_room()  # before the (maybe long) replay, not after
        point = await self._point(s, RollbackTarget(step=at_step), "forecast", need_output=True)
        if point.output is None:
            raise RollbackRangeError(
                f"session {s.id!r} is at step 0 and has no output yet to feed back; send it "
                f"one input first"
                if point.step == 0
                else f"the output of step {point.step} of session {s.id!r} is not known (it is "
                f"older than the kept history, or the session came from a checkpoint without "
                f"it), so a forecast cannot start there; forecast from a later step"
            )
        job = ForecastJob(
            session_id=s.id,
            guards=s.config.guards,
            from_step=point.step,
            horizon=horizon,
            state=point.state,
            next_input=feedback(s.model, point.step, point.output),
        )
        forecaster.submit(job)
        return job

    async def fork(
        self, session_id: str, target: RollbackTarget, new_session_id: str = ""
    ) -> ForkResult:
        """A new session at the source's state at ``target`` (default: its current step).

        The fork gets a first snapshot of its own at the fork point, carrying the source's
        input history window up to there; nothing else is shared with the source, so the
        two never touch each other's keys (see the proto's ForkRequest).
        """
        new_id = self._new_id(new_session_id)
        s = await self.session(session_id)
        self._check_capacity()
        point = await self._point(s, target, "fork", need_output=False)
        await self._create(
            new_id, s.model, s.model_name, s.config, point.state, point.step, "fork",
            point.history, point.output,
        )  # fmt: skip
        log.info(
            "session %s forked from %s at step %d (snapshot %s + %d replayed)",
            new_id, s.id, point.step, point.from_snapshot_id or "-", point.replayed_steps,
        )  # fmt: skip
        return ForkResult(
            await self.view(new_id), s.id, point.step, point.from_snapshot_id, point.replayed_steps
        )

    async def _point(
        self, s: Session, target: RollbackTarget, what: str, need_output: bool
    ) -> StatePoint:
        """The session at ``target`` as rollback would reach it, without changing it.

        A target of ``step=None`` is the current step. Holds the session only while it
        reads: between two steps, with no background write in flight.
        """
        async with self._hold(s, read_only=True):
            if target == RollbackTarget(step=None):
                t, record = s.step, None
            else:
                t, record = await self._resolve(s, target, what)
            if record is None and t == s.step:
                history = self._recent_history(s, t)
                state, output, snapshot_id, replayed = s.state, s.recent.output_at(t), "", 0
            else:
                if record is None:
                    record = await self.store.snapshot_at_or_before(s.id, t)
                    if record is None:
                        raise await self._out_of_range(s, t)
                ckpt, state, outputs, raw = await self._rebuild(s, record, t)
                history = self._history_at(s, ckpt.history, raw, t)
                output = outputs[-1] if outputs else s.recent.output_at(t)
                if output is None:
                    output = ckpt.output
                snapshot_id, replayed = record.snapshot_id, t - record.step
            if output is None and need_output and t > 0:
                with contextlib.suppress(RollbackRangeError):  # the caller says what is missing
                    output = await self.output_at(s, t)
            return StatePoint(t, state, output, history, snapshot_id, replayed)

    @staticmethod
    def _history_at(s: Session, base: InputHistory, raw: list[bytes], t: int) -> InputHistory:
        """The history window ending at ``t``: a checkpoint's history plus replayed inputs."""
        inputs = np.concatenate([base.inputs, s.codec.decode_many(raw)]) if raw else base.inputs
        window = s.config.history_window
        kept = inputs[len(inputs) - window :] if window else inputs[:0]
        return InputHistory(t - len(kept) + 1, kept)

    # ------------------------------------------------------------------ close, export, import

    async def close(self, session_id: str, final_snapshot: bool) -> tuple[int, str]:
        s = await self.session(session_id)
        async with self._hold(s):
            snapshot_id = ""
            if final_snapshot:
                record = await self.write_snapshot(s, s.step, s.state, "close")
                snapshot_id = record.snapshot_id
            await self._write(s, lambda lease: self.store.close_session(lease, snapshot_id))
            s.fail_queued(SessionClosedError(f"session {s.id!r} was closed"))
            self._sessions.pop(s.id, None)
            return s.step, snapshot_id

    async def export(self, session_id: str, snapshot_id: str) -> bytes:
        meta = await self._meta(session_id, allow_closed=True)
        if snapshot_id or meta.closed:
            record = (
                await self.store.snapshot_by_id(session_id, snapshot_id)
                if snapshot_id
                else await self.store.snapshot_at_or_before(session_id, meta.step)
            )
            if record is None:
                raise SnapshotMissingError(
                    f"session {session_id!r} has no snapshot {clip(snapshot_id)}"
                )
            return await self.store.read_blob(session_id, record)
        s = await self.session(session_id)
        async with self._hold(s):
            return self._checkpoint(s, s.step, s.state, "export").encode()

    async def import_checkpoint(
        self,
        blob: bytes,
        session_id: str,
        model_name: str,
        config: SessionConfig,
        replace: bool,
    ) -> SessionView:
        ckpt = Checkpoint.decode(blob)
        if model_name:
            model = self._model(model_name)
        else:
            found = [n for n, m in self.models.items() if m.fingerprint == ckpt.fingerprint]
            if not found:
                raise ModelMismatchError(
                    f"no model on this worker has the checkpoint's fingerprint "
                    f"{ckpt.fingerprint[:16]} (model {ckpt.model_id!r}); loaded: "
                    f"{', '.join(sorted(self.models))}"
                )
            model_name, model = found[0], self.models[found[0]]
        ckpt.check_model(model)
        if ckpt.step > MAX_STEP:
            raise StepRangeError(
                f"the checkpoint is at step {ckpt.step}, beyond the last step a session can "
                f"take ({MAX_STEP})"
            )
        session_id = self._new_id(session_id or ckpt.session_id)
        config = config.resolve(self.settings.defaults, model.config.output_dim)
        self._check_capacity()
        if replace:
            await self._drop_for_replace(session_id)
        if self.ownership.draining:
            raise await self._elsewhere(model_name, "import sessions")
        await self._create(
            session_id, model, model_name, config, ckpt.state, ckpt.step, "import",
            ckpt.history, ckpt.output,
        )  # fmt: skip
        return await self.view(session_id)

    async def _drop_for_replace(self, session_id: str) -> None:
        meta = await self.store.get_meta(session_id)
        if meta is None:
            return
        if meta.closed:  # nobody owns a closed session: its last token still fences
            await self.store.close_session(SessionLease(session_id, meta.token, ""))
            return
        s = await self.session(session_id)  # take it over (or be redirected to its owner)
        async with self._hold(s):
            await self._write(s, lambda lease: self.store.close_session(lease))
            s.fail_queued(SessionGoneError(f"session {session_id!r} was replaced by an import"))
            self._sessions.pop(session_id, None)

    # ------------------------------------------------------------------ residency

    async def session(self, session_id: str) -> Session:
        """The resident session, loading it from the store if it is not in memory."""
        s = self._sessions.get(session_id)
        if s is not None and s.gone is None:
            return s
        pending = self._loading.get(session_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
        self._loading[session_id] = future
        try:
            s = await self._load(session_id)
            future.set_result(s)
            return s
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters get it via shield
            raise
        finally:
            del self._loading[session_id]

    async def _load(self, session_id: str) -> Session:
        meta = await self._meta(session_id)
        model = self.models.get(meta.model)
        if model is None:
            raise UnknownModelError(
                f"session {session_id!r} runs model {meta.model!r}, which this worker does not "
                f"serve (it serves {', '.join(sorted(self.models))})"
            )
        if model.fingerprint != meta.fingerprint:
            raise ModelMismatchError(
                f"session {session_id!r} was made with other weights of model {meta.model!r} "
                f"(fingerprint {meta.fingerprint[:16]}, loaded {model.fingerprint[:16]})"
            )
        self._check_capacity()
        if self.ownership.draining:
            holder = await self.store.lease_holder(session_id)
            if holder is not None and holder.owner_addr:
                raise holder.redirect(session_id)
            raise await self._elsewhere(meta.model, f"serve session {session_id!r}")
        if meta.numerics and meta.numerics != self.ownership.numerics:
            raise await self._other_numerics(meta)
        sent_at = time.monotonic()
        token = await self.store.acquire(
            session_id, self.ownership.worker_id, self.ownership.address,
            self.ownership.lease_ms, numerics=self.ownership.numerics,
        )  # fmt: skip
        lease = self.ownership.new_lease(session_id, token, sent_at)
        try:
            return await self._restore(session_id, model, meta.model, lease)
        except BaseException:
            with contextlib.suppress(SsmserveError):
                await self.store.release(lease)
            raise

    async def _other_numerics(self, meta: SessionMeta) -> SsmserveError:
        """A session whose history was computed with numerics this worker does not have:
        replaying it here might not reproduce what was answered. Send the caller to a
        worker with the same numerics, or say why nobody can serve it."""
        for worker in await self.ownership.targets(meta.model, numerics=meta.numerics):
            return SessionMovedError(
                f"session {meta.session_id!r} was computed with numerics {meta.numerics}, "
                f"which worker {worker.address} has and this one ({self.ownership.numerics}) "
                f"has not",
                owner=worker.address,
            )
        return NumericsMismatchError(
            f"session {meta.session_id!r} was computed with numerics {meta.numerics} (CPU, "
            f"BLAS build and threads, engine code), and no live worker has them; this worker "
            f"has {self.ownership.numerics}, so replaying its history here might not give "
            f"the bits that were answered. Serve it from a worker with the same numerics, or "
            f"export it and import the checkpoint here (its history then starts there)"
        )

    async def _restore(
        self, session_id: str, model: MambaModel, model_name: str, lease: SessionLease
    ) -> Session:
        """Rebuild an acquired session from its newest snapshot and its log."""
        meta = await self._meta(session_id)  # read after acquiring: the last owner is done
        config = SessionConfig.from_bytes(meta.config)
        record = await self.store.snapshot_at_or_before(session_id, meta.step)
        if record is None:
            raise StoreDataError(f"session {session_id!r} has no snapshot to restore from")
        s = self._resident(
            session_id, model, model_name, config, model.new_state(), record.step,
            meta.created_at, lease,
        )  # fmt: skip
        ckpt, state, outputs, raw = await self._rebuild(s, record, meta.step)
        self._remember_history(s, ckpt.history)
        if ckpt.output is not None:
            s.recent.remember_output(record.step, ckpt.output)
        s.recent.remember(record.step + 1, raw, outputs)
        s.state, s.step, s.last_snapshot_step = state, meta.step, record.step
        self._sessions[session_id] = s
        log.info(
            "session %s restored at step %d, token %s (snapshot %d + %d replayed)",
            session_id, meta.step, lease.token, record.step, len(outputs),
        )  # fmt: skip
        return s

    def _resident(
        self,
        session_id: str,
        model: MambaModel,
        model_name: str,
        config: SessionConfig,
        state: SessionState,
        step: int,
        created_at: float,
        lease: SessionLease,
    ) -> Session:
        stepper = self.steppers[model_name]
        recent = RecentSteps(max(config.history_window, 1), self.settings.output_window)
        return Session(
            session_id, model, model_name, config, state, step, created_at, recent, lease,
            stepper.notify,
        )  # fmt: skip

    @staticmethod
    def _remember_history(s: Session, history: InputHistory) -> None:
        for i in range(len(history.inputs)):
            s.recent.inputs.append((history.first_step + i, s.codec.encode(history.inputs[i])))

    async def _unload(self, s: Session, reason: str) -> None:
        """Snapshot ``s`` if it moved since its last snapshot, release it, drop it from memory.

        Any worker may load it again from there.
        """
        async with self._hold(s):
            if s.step != s.last_snapshot_step or s.recent.unflushed:
                await self.write_snapshot(s, s.step, s.state, reason)
            await self._write(s, self.store.release)
            s.fail_queued(SessionGoneError(f"session {s.id!r} left memory ({reason}); retry"))
            self._sessions.pop(s.id, None)

    async def park(self, session_id: str, reason: str) -> None:
        """Snapshot and release a resident session (a drain with nowhere to send it)."""
        s = self._sessions.get(session_id)
        if s is not None:
            await self._unload(s, reason)

    async def hand_off(
        self,
        session_id: str,
        target: WorkerRecord,
        adopt: Callable[[str], Awaitable[object]],
    ) -> tuple[int, str]:
        """Move a resident session to ``target``; returns (step, snapshot id it moved at).

        Between two steps: snapshot (which flushes the log), reserve the lease for the
        target, and let it acquire and load the session (``adopt``). If the target fails,
        the reservation is taken back and the session goes on here as if nothing happened.
        """
        s = self._sessions.get(session_id)
        if s is None or s.gone is not None:
            raise SessionGoneError(f"session {session_id!r} is not resident on this worker")
        async with self._hold(s):
            if s.step != s.last_snapshot_step or s.recent.unflushed:
                record = await self.write_snapshot(s, s.step, s.state, "migrate")
            else:
                record = await self.store.snapshot_at_or_before(s.id, s.step)
            snapshot_id = record.snapshot_id if record else ""
            lease = s.lease
            await self._write(
                s, lambda lease: self.store.handoff(lease, target, self.ownership.lease_ms)
            )
            try:
                await adopt(session_id)
            except Exception as exc:
                try:
                    await self.store.cancel_handoff(
                        lease, self.ownership.address, target.worker_id, self.ownership.lease_ms
                    )
                except StaleEpochError:
                    pass  # the target did acquire it (only its answer was lost): moved
                except SsmserveError as cancel_error:  # unknown: reload before answering
                    self.lost(s, lease, cancel_error)
                    raise
                else:
                    raise HandOffError(
                        f"worker {target.address} did not take session {session_id!r} ({exc}); "
                        f"it stays on {self.ownership.address}"
                    ) from None
            self.drop(
                s,
                SessionMovedError(
                    f"session {session_id!r} moved to worker {target.address}",
                    owner=target.address,
                ),
            )
            return s.step, snapshot_id

    async def _evict_idle(self) -> None:
        while True:
            await asyncio.sleep(self.settings.idle_check_s)
            now = time.monotonic()
            for s in list(self._sessions.values()):
                if not s.busy and s.state.is_view and now - s.last_active > 1.0:
                    # A batch row keeps its whole batch array alive: a session that stopped
                    # stepping gets arrays of its own, so its memory is its state's size.
                    s.state = s.state.copy()
                ttl = s.config.idle_ttl_s
                if ttl and not s.queue and not s.busy and now - s.last_active > ttl:
                    try:
                        await self._unload(s, "idle")
                    except SsmserveError as exc:
                        log.warning("session %s: idle eviction failed: %s", s.id, exc)

    # ------------------------------------------------------------------ helpers

    def _model(self, name: str) -> MambaModel:
        model = self.models.get(name)
        if model is None:
            raise UnknownModelError(
                f"model {clip(name)} is not served here (models: {', '.join(sorted(self.models))})"
            )
        return model

    @staticmethod
    def _new_id(session_id: str) -> str:
        return check_session_id(session_id) if session_id else secrets.token_hex(8)

    def _check_capacity(self) -> None:
        if len(self._sessions) >= self.settings.max_sessions:
            raise CapacityError(
                f"this worker already holds {len(self._sessions)} sessions "
                f"(max_sessions {self.settings.max_sessions})"
            )

    async def _meta(self, session_id: str, allow_closed: bool = False) -> SessionMeta:
        meta = await self.store.get_meta(session_id)
        if meta is None:
            raise SessionMissingError(f"session {session_id!r} does not exist")
        if meta.closed and not allow_closed:
            raise SessionClosedError(
                f"session {session_id!r} is closed; its final snapshot can still be exported"
            )
        return meta
