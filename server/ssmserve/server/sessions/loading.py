"""Sessions coming into memory and leaving it: load, unload, park, idle eviction.

A session that is not resident (evicted, parked by a drain, or its worker died and the
lease ran out) is loaded by the worker that receives a request for it: acquire its
lease (a new fencing token), then rebuild it up to its durable step (``replay``). A
session another live worker holds is redirected there; one computed with other numerics
is sent to a worker that has them, or refused. Unloading snapshots what moved since the
last snapshot and releases the lease, so any worker can load it again (a hand-off to
another worker, which also leaves memory that way, is ``migration``'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping

from ssmserve.server.engine.allocator import return_freed_memory
from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import SessionMovedError, SsmserveError
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.config import Durability, SessionConfig
from ssmserve.server.sessions.errors import (
    CapacityError,
    ModelMismatchError,
    NumericsMismatchError,
    UnknownModelError,
    WorkerDrainingError,
)
from ssmserve.server.sessions.memory import WorkerMemory
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import Session, SessionGoneError
from ssmserve.server.state.checkpoint import InputHistory
from ssmserve.server.state.input_log import RecentSteps
from ssmserve.server.state.lease import SessionLease, lease_clock
from ssmserve.server.state.store_errors import (
    LeaseHeldError,
    SessionClosedError,
    StoreDataError,
)
from ssmserve.server.state.store_records import AcquiredLoad, SessionMeta

log = logging.getLogger(__name__)


class SessionLoader:
    def __init__(
        self,
        models: Mapping[str, Engine],
        residents: ResidentSessions,
        checkpoints: Checkpoints,
        replay: Replay,
        notifiers: Mapping[str, Callable[[], None]],
        max_sessions: int,
        output_window: int,
        memory: WorkerMemory,
        max_unflushed: int = 1 << 16,
    ) -> None:
        self.models = models
        self.residents = residents
        self.store = residents.store
        self.ownership = residents.ownership
        self.checkpoints = checkpoints
        self.replay = replay
        self.notifiers = notifiers  # per model: wakes its stepper when a step is queued
        self.max_sessions = max_sessions
        self.output_window = output_window
        self.memory = memory  # the worker's one memory budget
        self.max_unflushed = max_unflushed  # inputs a non-log session holds before a flush
        self._loading: dict[str, asyncio.Task[Session]] = {}  # loads under way, by session
        self.lease_ms = self.ownership.lease_ms  # fixed for the worker's life
        self.lease_valid_s = self.ownership.settings.lease_valid_s  # fixed too

    async def session(self, session_id: str) -> Session:
        """The resident session, loading it from the store if it is not in memory.

        A load runs as a task of its own, which every request for the session waits on:
        a request that goes away (its stream was cancelled) must not cancel the load under
        the others. They would see a CancelledError that is not theirs, and a gRPC handler
        that raises one never sends a status: its client would wait for good.
        """
        s = self.residents.get(session_id)
        if s is not None:
            return s
        load = self._loading.get(session_id)
        if load is None or load.done():
            load = asyncio.get_running_loop().create_task(
                self._load(session_id), name=f"load-session-{session_id}"
            )
            self._loading[session_id] = load
            load.add_done_callback(functools.partial(self._loaded, session_id))
        return _still_resident(await asyncio.shield(load))

    def _loaded(self, session_id: str, load: asyncio.Task[Session]) -> None:
        if self._loading.get(session_id) is load:
            del self._loading[session_id]
        if not load.cancelled():
            load.exception()  # retrieved: its waiters have it, if any are left

    async def close(self) -> None:
        """Cancel the loads still running (the worker is stopping)."""
        loads = list(self._loading.values())
        for load in loads:
            load.cancel()
        await asyncio.gather(*loads, return_exceptions=True)

    async def meta(self, session_id: str, allow_closed: bool = False) -> SessionMeta:
        return await self._present(session_id, await self.store.get_meta(session_id), allow_closed)

    async def _present(
        self, session_id: str, meta: SessionMeta | None, allow_closed: bool = False
    ) -> SessionMeta:
        """``meta`` as read, if the session is there (and open, unless ``allow_closed``)."""
        if meta is None:  # NOT_FOUND, or DATA_LOSS when a wiped store took it
            raise await self.residents.resets.missing(session_id)
        if meta.closed and not allow_closed:
            raise SessionClosedError(
                f"session {session_id!r} is closed; its final snapshot can still be exported"
            )
        return meta

    def footprint(self, model: Engine, config: SessionConfig) -> int:
        """The most bytes a resident session of ``model`` may hold: its state, its input
        history and recorded outputs at their bounds, and (without ``log`` durability)
        the inputs it may hold before a flush."""
        c = model.config
        input_bytes = 8 if c.is_token_model else 4 * c.input_dim
        unflushed = 0 if config.durability == Durability.LOG else self.max_unflushed
        history = max(config.history_window, 1) + unflushed
        return c.state_bytes + history * input_bytes + self.output_window * 4 * c.output_dim

    def check_capacity(self, model: Engine, config: SessionConfig) -> int:
        """Room here for one more session like that: the session count and the memory.
        Returns its footprint (what ``ResidentSessions.add`` counts it for)."""
        count = len(self.residents.by_id)
        if count >= self.max_sessions:
            raise CapacityError(
                f"this worker already holds {count} sessions (max_sessions {self.max_sessions})"
            )
        footprint = self.footprint(model, config)
        self.memory.check(footprint, "one more session")
        return footprint

    async def elsewhere(self, model: str, what: str) -> SessionMovedError:
        """This worker is draining: point the caller at the least loaded other worker."""
        targets = await self.ownership.targets(model)
        if not targets:
            raise WorkerDrainingError(f"this worker is draining and no other worker can {what}")
        return SessionMovedError(
            f"this worker is draining; {targets[0].address} can {what}", owner=targets[0].address
        )

    def resident(
        self,
        session_id: str,
        model: Engine,
        model_name: str,
        config: SessionConfig,
        state: SessionState,
        step: int,
        created_at: float,
        lease: SessionLease,
        history: InputHistory | None = None,
    ) -> Session:
        """A new in-memory session (not yet in the table), with ``history`` remembered."""
        recent = RecentSteps(max(config.history_window, 1), self.output_window)
        s = Session(
            session_id, model, model_name, config, state, step, created_at, recent, lease,
            self.notifiers[model_name],
        )  # fmt: skip
        if history is not None:
            remember_history(s, history)
        return s

    async def _load(self, session_id: str) -> Session:
        stored, newest = await self.store.meta_to_load(session_id)
        meta = await self._present(session_id, stored)
        model = self.models.get(meta.model)
        if model is None:  # pinned to a model (version) served elsewhere, or nowhere
            for worker in await self.ownership.targets(meta.model):
                raise SessionMovedError(
                    f"session {session_id!r} runs model {meta.model!r}, which worker "
                    f"{worker.address} serves and this one does not",
                    owner=worker.address,
                )
            raise UnknownModelError(
                f"session {session_id!r} runs model {meta.model!r}, which no live worker "
                f"serves (this one serves {', '.join(sorted(self.models))}); serve it "
                f"(--model {meta.model}=DIR), or export the session and import it elsewhere"
            )
        if model.fingerprint != meta.fingerprint:
            raise ModelMismatchError(
                f"session {session_id!r} was made with other weights of model {meta.model!r} "
                f"(fingerprint {meta.fingerprint[:16]}, loaded {model.fingerprint[:16]}; "
                f"the weights' format is part of it: --quantize must match too)"
            )
        footprint = self.check_capacity(model, SessionConfig.from_bytes(meta.config))
        if self.ownership.draining:
            holder = await self.store.lease_holder(session_id)
            if holder is not None and holder.owner_addr:
                raise self.ownership.not_to_self(session_id, holder.redirect(session_id))
            raise await self.elsewhere(meta.model, f"serve session {session_id!r}")
        if meta.numerics and meta.numerics != self.ownership.numerics:
            raise await self._other_numerics(meta)
        taken = await self._acquire(meta, newest)
        lease = taken.lease
        if meta.owner and meta.owner != self.ownership.worker_id:
            # Its owner neither released it nor handed it here: it crashed or froze, and
            # this worker saw its lease unrenewed for a whole TTL (``cluster.takeover``).
            self.store.metrics.takeovers.inc()
            log.info(
                "session %s taken over from worker %s, token %s", session_id, meta.owner,
                lease.token,
                extra={"session_id": session_id, "step": meta.step, "token": lease.token,
                       "event": "taken_over", "previous_owner": meta.owner},
            )  # fmt: skip
        try:
            # A session its owner let go (released: drained, evicted, parked) was
            # snapshotted at its last step; one taken over, or reloaded here after a drop,
            # may come back behind steps that were answered (SESSION_REWOUND).
            return await self._restore(taken, model, footprint, may_be_behind=bool(meta.owner))
        except BaseException:
            with contextlib.suppress(SsmserveError):
                await self.store.release(lease)
            raise

    async def _acquire(self, meta: SessionMeta, expected_snapshot: str) -> AcquiredLoad:
        """Take the session's lease (a new token); with it, what the load restores from:
        the session's meta as the lease was taken, its newest snapshot's id and, when that
        is ``expected_snapshot`` (the newest when ``meta`` was read), the snapshot itself
        (``Store.acquire_to_load``, one round trip). An owner that never let it go is
        waited out: its lease watched for a whole TTL on this worker's clock
        (``cluster.takeover``), unless it is a predecessor of this worker known dead
        (``advertise_lock``): then the beat it left proves at once that nobody renews
        it. A lease held under this worker's own address is never a redirect here."""
        takeovers = self.ownership.takeovers
        sent_at = lease_clock()
        proof = takeovers.proof(meta.session_id, sent_at)
        for attempt in (1, 2):
            if attempt == 2:
                sent_at = lease_clock()
            try:
                taken = await self.store.acquire_to_load(
                    meta.session_id, self.ownership.worker_id, self.ownership.address,
                    self.lease_ms, numerics=self.ownership.numerics, proof=proof,
                    valid_until=sent_at + self.lease_valid_s,
                    expected_snapshot=expected_snapshot,
                )  # fmt: skip
            except LeaseHeldError as refused:
                dead = refused.owner_id in self.ownership.predecessors
                if attempt == 1 and dead and refused.beat and refused.beat != proof:
                    proof = refused.beat  # the store checks it is still the beat, atomically
                    continue
                seen = takeovers.saw(meta.session_id, refused)
                raise self.ownership.not_to_self(meta.session_id, seen) from None
            takeovers.forget(meta.session_id)  # a sighting of it held by another: void now
            return taken
        raise AssertionError("unreachable: the second attempt returns or raises")

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
        self, taken: AcquiredLoad, model: Engine, footprint: int, may_be_behind: bool = False
    ) -> Session:
        """Rebuild an acquired session from its newest snapshot and its log; its meta as
        read when its lease was taken (the last owner is done)."""
        meta, snapshot_id, lease, read = taken.meta, taken.snapshot_id, taken.lease, taken.snapshot
        session_id, model_name = meta.session_id, meta.model
        config = SessionConfig.from_bytes(meta.config)
        if read is None and snapshot_id:
            read = await self.store.snapshot_and_blob(session_id, snapshot_id)
        if read is None:
            raise StoreDataError(f"session {session_id!r} has no snapshot to restore from")
        record, blob = read
        ckpt = self.replay.decode(session_id, record, model, blob)
        s = self.resident(
            session_id, model, model_name, config, ckpt.state, record.step, meta.created_at,
            lease,
        )  # fmt: skip
        # The outputs the session keeps to answer resends: a client resends what it was
        # not answered when its stream is cut (a failover) and gets them from memory.
        rebuilt = await self.replay.rebuild(s, meta.step, record, self.output_window, ckpt)
        replayed = meta.step - record.step
        s.recent.restored(
            s.codec, ckpt.history.first_step, ckpt.history.inputs, record.step,
            ckpt.output if replayed <= self.output_window else None,
            rebuilt.inputs, meta.step - len(rebuilt.outputs) + 1, rebuilt.outputs,
        )  # fmt: skip
        s.rebuilt_at(rebuilt.state, meta.step, record.step, may_be_behind, rebuilt.guards)
        self.residents.add(s, footprint)
        log.info(
            "session %s restored at step %d, token %s (snapshot %d + %d replayed)",
            session_id, meta.step, lease.token, record.step, replayed,
        )  # fmt: skip
        return s

    async def unload(self, s: Session, reason: str) -> None:
        """Snapshot ``s`` if it moved since its last snapshot, release it, drop it from memory.

        Any worker may load it again from there.
        """
        async with self.residents.hold(s):
            if s.step != s.last_snapshot_step or s.recent.unflushed:
                await self.checkpoints.write(s, s.step, s.state, reason)
            await self.residents.write(s, self.store.release)
            s.lease.expire()  # released: any worker may load it now (``answer_fence``)
            s.fail_queued(SessionGoneError(f"session {s.id!r} left memory ({reason}); retry"))
            self.residents.remove(s.id)

    async def park(self, session_id: str, reason: str) -> None:
        """Snapshot and release a resident session (a drain with nowhere to send it)."""
        s = self.residents.by_id.get(session_id)
        if s is not None:
            await self.unload(s, reason)

    async def evict_idle(self, check_every_s: float) -> None:
        """Forever: unload sessions idle past their ``idle_ttl_s``; give idle sessions
        state arrays of their own, and freed heap back to the system."""
        owed = False  # snapshot writes freed heap since the last time it was given back
        while True:
            await asyncio.sleep(check_every_s)
            now = time.monotonic()
            copied = 0
            writing = False  # a background snapshot write is under way
            stepping = False  # a session was busy or active since the last check
            for s in list(self.residents.by_id.values()):
                writing = writing or s.snapshots.busy
                stepping = stepping or s.busy or now - s.last_active <= check_every_s
                if not s.busy and s.state.is_view and now - s.last_active > 1.0:
                    s.own_state()
                    copied += 1
                ttl = s.config.idle_ttl_s
                if ttl and not s.queue and not s.busy and now - s.last_active > ttl:
                    try:
                        await self.unload(s, "idle")
                        log.info(
                            "session %s evicted after %.0f s idle at step %d", s.id, ttl,
                            s.step,
                            extra={"session_id": s.id, "step": s.step, "event": "evicted"},
                        )  # fmt: skip
                    except SsmserveError as exc:
                        log.warning("session %s: idle eviction failed: %s", s.id, exc)
            owed = owed or writing
            if copied or (owed and not writing and not stepping):
                # The batch arrays those rows kept alive are free now, or the buffers of
                # the snapshot writes that were under way (a checkpoint's encoding, its
                # pieces: ~2x its state each, thousands at once when lockstep sessions
                # come due); glibc keeps freed heap for itself unless asked, so a
                # worker's RSS would stay at its peak (+19 KiB per demo session after
                # one snapshot each: bench/bench_served_memory.py). Not while sessions
                # step: the next
                # steps' arrays reuse that heap (``allocator``).
                return_freed_memory()
                owed = writing


def remember_history(s: Session, history: InputHistory) -> None:
    """Put a checkpoint's input history window into the session's memory of recent steps."""
    s.recent.remember_inputs(
        history.first_step, [s.codec.encode(value) for value in history.inputs]
    )


def _still_resident(s: Session) -> Session:
    """``s``, unless it left memory before the request that waited for its load went on
    (a write of another request had an unknown outcome, say): work queued on it then
    would never be answered, so the request fails with what dropped it (UNAVAILABLE:
    the retry loads the session again)."""
    if s.gone is not None:
        raise s.gone
    return s
