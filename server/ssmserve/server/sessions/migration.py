"""Moving sessions between workers: Migrate one, or Drain a whole worker.

A migration is a hand-off, driven start to finish by one owner (``handoff.HandOff``):
the owner stops the session between two steps, snapshots it, reserves its lease for the
target, and asks the target (``Peers.adopt``) to acquire it (a new fencing token) and
load it from that snapshot (:meth:`Migrator.adopt`, there: ``SessionLoader.session``). If
the target fails, the reservation is taken back and the session goes on here as if
nothing happened; if it took the session, the session leaves memory here and the steps
queued meanwhile are answered with a redirect to the target. Streams that were talking
to the source resume on the target; nothing is lost or applied twice, because every step
carries its number and a resend of an applied step is answered, not re-run.

A drain marks the worker as draining (no new sessions, no loads; the registry shows it),
then hands every resident session to the least loaded other live worker that serves its
model, or, with none left, snapshots and releases it so any worker can pick it up later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ssmserve.server.cluster.ownership import Ownership, least_loaded
from ssmserve.server.cluster.peers import Peers
from ssmserve.server.errors import ErrorKind, SsmserveError, clip
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.handoff import HandOff, HandOffParts
from ssmserve.server.sessions.lifecycle import Lifecycle
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.state.store import Store, WorkerRecord
from ssmserve.server.state.store_errors import SessionMissingError

log = logging.getLogger(__name__)


class UnknownWorkerError(SsmserveError):
    kind = ErrorKind.NOT_FOUND


class BadTargetError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class MigrationSettings:
    drain_parallel: int = 8  # sessions handed off at once during a drain
    drain_rounds: int = 3  # passes over resident sessions (loads racing a drain)
    # A Drain stream's heartbeat while no session finished moving (one large session may
    # take long): clients bound each wait for the next message by a multiple of this.
    drain_heartbeat_s: float = 5.0


@dataclass(frozen=True)
class MigrationResult:
    session_id: str
    source: str
    target: str
    step: int
    snapshot_id: str
    elapsed_ms: float


@dataclass(frozen=True)
class DrainProgress:
    session_id: str
    target: str  # '' when parked in Redis
    done: int
    total: int
    error: str = ""


class Migrator:
    """Hand-offs of this worker's sessions (source side), their adoption (target side),
    Migrate, Drain and the placing of forks. ``on_drain`` and ``on_undrain`` are the
    worker's own word (its readiness) before a drain and an undrain."""

    def __init__(
        self,
        store: Store,
        ownership: Ownership,
        peers: Peers,
        residents: ResidentSessions,
        loader: SessionLoader,
        checkpoints: Checkpoints,
        lifecycle: Lifecycle,
        settings: MigrationSettings,
        on_drain: Callable[[], Awaitable[None]],
        on_undrain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.ownership = ownership
        self.peers = peers
        self.residents = residents
        self.loader = loader
        self.checkpoints = checkpoints
        self.lifecycle = lifecycle
        self.settings = settings
        self._on_drain = on_drain
        self._on_undrain = on_undrain
        self.parts = HandOffParts(
            store, residents, checkpoints, peers, ownership.address, ownership.lease_ms
        )

    @property
    def address(self) -> str:
        return self.ownership.address

    async def adopt(self, session_id: str) -> tuple[int, int]:
        """Target side of a hand-off: acquire the reserved session and load it."""
        s = await self.loader.session(session_id)
        return s.step, s.lease.epoch

    async def migrate(self, session_id: str, target_address: str) -> MigrationResult:
        """Move ``session_id`` to the worker at ``target_address``. It runs as a task of
        its own, named for the session, which this call awaits (cancelled, it is
        cancelled too and settles as a hand-off cut short does): the hand-off's waits
        return to it, not through the RPC's frames, and a task dump names it."""
        return await asyncio.get_running_loop().create_task(
            self._migrate(session_id, target_address), name=f"migrate-{session_id}"
        )

    async def _migrate(self, session_id: str, target_address: str) -> MigrationResult:
        started = time.perf_counter()
        if session_id in self.residents.by_id:
            if target_address == self.address:
                s = await self.loader.session(session_id)
                return MigrationResult(session_id, self.address, self.address, s.step, "", 0.0)
            s = await self.loader.session(session_id)
            target = await self._target(target_address, s.model_name, self.ownership.numerics)
            return await self.hand_off(session_id, target, started)
        meta = await self.store.get_meta(session_id)
        if meta is None:
            raise SessionMissingError(f"session {session_id!r} does not exist")
        lease = await self.store.lease_holder(session_id)
        if lease is not None and lease.owner_addr and lease.owner_addr != self.address:
            raise lease.redirect(session_id)
        # Nobody holds it (evicted, parked, or its worker died): the target just loads it.
        if target_address == self.address:
            step, _epoch = await self.adopt(session_id)
        else:
            target = await self._target(target_address, meta.model, meta.numerics)
            step = (await self.peers.adopt(target.address, session_id)).step
        elapsed = (time.perf_counter() - started) * 1000
        return MigrationResult(session_id, "", target_address, step, "", elapsed)

    async def hand_off(
        self, session_id: str, target: WorkerRecord, started: float | None = None
    ) -> MigrationResult:
        """Hand a resident session to ``target`` (checked by the caller: live, serving the
        model, same numerics; ``HandOff`` drives it), counted and logged as a migration."""
        started = time.perf_counter() if started is None else started
        held = time.perf_counter()
        metrics = self.store.metrics
        try:
            step, snapshot_id = await HandOff(self.parts, session_id, target).run()
        except BaseException:
            metrics.migrations.labels("failed").inc()
            raise
        done = time.perf_counter()
        metrics.migrations.labels("ok").inc()
        metrics.migration_downtime.observe(done - held)
        elapsed = (done - started) * 1000
        log.info(
            "session %s migrated to %s in %.1f ms", session_id, target.address, elapsed,
            extra={"session_id": session_id, "step": step, "event": "migrated",
                   "target": target.address},
        )  # fmt: skip
        return MigrationResult(session_id, self.address, target.address, step, snapshot_id, elapsed)

    async def place(self, session_id: str, target_address: str) -> bool:
        """Move a session just made here (a fork) to ``target_address``; returns whether it
        tried (a target was named, or this worker drains): then the session may be
        elsewhere now.

        An empty target means any other live worker, for a draining worker (with none
        left, the session stays and is parked with the others); a worker that does not
        drain keeps it. If the session cannot move it is deleted again, so the request
        that made it fails as a whole.
        """
        if not target_address and not self.ownership.draining:
            return False
        try:
            if not target_address:
                s = await self.loader.session(session_id)
                targets = await self.ownership.targets(s.model_name, self.ownership.numerics)
                if not targets:
                    return True
                target_address = targets[0].address
            await self.migrate(session_id, target_address)
        except BaseException:
            try:
                await self.lifecycle.close(session_id, final_snapshot=False)
            except SsmserveError as exc:
                log.warning("session %s could not be placed nor deleted: %s", session_id, exc)
            raise
        return True

    async def _target(self, address: str, model: str, numerics: str) -> WorkerRecord:
        target = await self.store.worker_at(address)  # a Migrate's one look at the registry
        if target is None:
            raise UnknownWorkerError(f"no live worker is registered at {clip(address)}")
        if target.draining:
            raise BadTargetError(f"worker {address} is draining; pick another target")
        if model not in target.models:
            raise BadTargetError(
                f"worker {address} does not serve model {model!r} "
                f"(it serves {', '.join(target.models) or 'nothing'})"
            )
        if numerics and target.numerics != numerics:
            raise BadTargetError(
                f"worker {address} computes with other numerics ({target.numerics or 'unknown'}"
                f"; the session's are {numerics}: CPU, BLAS build and threads, engine code), "
                f"so it could not replay the session's history exactly; pick a worker with "
                f"the same numerics"
            )
        return target

    # ------------------------------------------------------------------ drain

    async def drain(self) -> AsyncIterator[DrainProgress]:
        """Move every resident session away; yields one progress entry per session.

        Closed early (the caller went away), it starts no more moves and returns once
        the moves under way have finished: a hand-off cut short could leave its outcome
        unknown, and each is bounded by its own deadlines."""
        await self._on_drain()
        await self.ownership.set_draining()
        done = 0
        for _round in range(self.settings.drain_rounds):
            ids = list(self.residents.by_id)
            if not ids:
                break
            planned: dict[str, int] = {}  # target address -> sessions sent there by us
            gate = asyncio.Semaphore(self.settings.drain_parallel)
            given_up = asyncio.Event()
            total = done + len(ids)
            moves = [
                asyncio.ensure_future(self._drain_one(i, planned, gate, given_up)) for i in ids
            ]
            try:
                for next_done in asyncio.as_completed(moves):
                    moved = await next_done
                    assert moved is not None  # only after given_up, which ends this loop
                    session_id, target, error = moved
                    done += 1
                    yield DrainProgress(session_id, target, done, total, error)
            finally:
                given_up.set()
                # wait, not gather: cancelled again meanwhile, gather would cut them short
                await asyncio.wait(moves)
                for move in moves:  # their errors were this drain's to report, if any
                    if not move.cancelled():
                        move.exception()
        log.info("drained: %d sessions moved or parked", done)

    async def undrain(self) -> None:
        """Serve again after a drain: take sessions and new ones (the worker's own word
        first, ``on_undrain``, which refuses while the worker is stopping)."""
        if self._on_undrain is not None:
            await self._on_undrain()
        await self.ownership.set_draining(False)
        log.info("undrained: serving again")

    async def _drain_one(
        self,
        session_id: str,
        planned: dict[str, int],
        gate: asyncio.Semaphore,
        given_up: asyncio.Event,
    ) -> tuple[str, str, str] | None:
        async with gate:
            if given_up.is_set():  # the drain was closed early: no new move
                return None
            return await self._move_or_park(session_id, planned)

    async def _move_or_park(self, session_id: str, planned: dict[str, int]) -> tuple[str, str, str]:
        error = ""
        try:
            s = await self.loader.session(session_id)
            targets = await self.ownership.targets(s.model_name, self.ownership.numerics)
            if targets:
                target = least_loaded(targets, planned)
                planned[target.address] = planned.get(target.address, 0) + 1
                await self.hand_off(session_id, target)
                return session_id, target.address, ""
        except SsmserveError as exc:
            error = str(exc)
            log.warning("drain: session %s not moved: %s", session_id, exc)
        try:
            await self.loader.park(session_id, "drain")
        except SsmserveError as exc:
            error = f"{error}; parking failed too: {exc}" if error else str(exc)
        return session_id, "", error
