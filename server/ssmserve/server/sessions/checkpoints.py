"""Snapshots of resident sessions: checkpoints encoded and committed through the store.

A checkpoint (``state.checkpoint``) is written after the inputs up to its step are in
the log, so every step between two snapshots can be replayed. Periodic snapshots are
taken between two steps (the state is copied) and written in the background
(``snapshot_writer``): the stepper answers at once, at most one write per session is in
flight, and ``snapshot_writes_in_flight`` bounds them per worker (``SnapshotWrites``).
Everything that reads snapshots first waits for the writes already due
(:meth:`Checkpoints.settled`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import numpy as np

from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import SsmserveError
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import Session, SnapshotEvent
from ssmserve.server.sessions.snapshot_commits import SnapshotCommits
from ssmserve.server.sessions.snapshot_writer import SnapshotWrites
from ssmserve.server.state.checkpoint import (
    Checkpoint,
    CheckpointMeta,
    GuardState,
    InputHistory,
)
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_records import SnapshotCommit, SnapshotRecord

# Checkpoints of at least this many state bytes are encoded (sha256) on a thread, which
# keeps the event loop answering meanwhile; smaller ones cost less than the hop.
_ENCODE_IN_THREAD_BYTES = 1 << 20

log = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, store: Store, residents: ResidentSessions, writes_in_flight: int) -> None:
        self.store = store
        self.residents = residents
        self.writes = SnapshotWrites(writes_in_flight)  # background writes in flight
        self.commits = SnapshotCommits(store)  # commits due together, written together
        self.committed = 0  # snapshots committed by this worker

    def close(self) -> None:
        """The worker stops: writes and commits not yet started are not started."""
        self.writes.close()
        self.commits.close()

    async def settled(self, session_id: str) -> None:
        """Read your writes: snapshots already due here are committed before we answer."""
        s = self.residents.by_id.get(session_id)
        if s is not None:
            await s.snapshots.settled()

    async def newest(self, s: Session, at_most: int) -> SnapshotRecord | None:
        """The newest snapshot of ``s`` at or before step ``at_most``."""
        # A guard rollback asks while a periodic snapshot it should return to may still be
        # on its way to Redis: wait for the writes already due (read your writes), ahead
        # of other sessions' (the rollback holds a stepper batch while it waits).
        await s.snapshots.settled(hurry=True)
        return await self.store.snapshot_at_or_before(s.id, at_most)

    async def write(
        self, s: Session, step: int, state: SessionState, reason: str, label: str = ""
    ) -> SnapshotRecord:
        """Flush the inputs up to ``step``, then commit a checkpoint of ``state`` at ``step``.

        The caller holds the session (a stepper batch or :meth:`Session.exclusive`).
        """
        return await self.commit(s, self.checkpoint(s, step, state, reason, label))

    def schedule(
        self, s: Session, step: int, state: SessionState, guards: GuardState | None = None
    ) -> None:
        """A periodic snapshot is due: copy what it needs now, write it in the background
        (``guards``: the session's guard state at ``step``).

        Called by the stepper while it holds the session; the write itself runs after the
        steps are answered (see ``snapshot_writer``).
        """
        if s.gone is not None:  # left memory meanwhile (a lost lease): nothing to write
            return
        due = DueSnapshot(self, s, step, state.packed(), recent_history(s, step), guards)
        if s.snapshots.schedule(due, self.writes):
            self.store.metrics.snapshots_dropped.inc()

    async def commit(self, s: Session, ckpt: Checkpoint) -> SnapshotRecord:
        """Flush the inputs up to ``ckpt.step``, encode ``ckpt`` and commit it."""
        step = ckpt.step
        started = time.perf_counter()
        await self.residents.flush_unflushed(s, step)
        blob, record = await self.encode(ckpt)
        await self.residents.write(
            s,
            lambda lease: self.commits.commit(
                SnapshotCommit(lease, record, blob, s.config.max_snapshots)
            ),
            settle=True,
        )
        s.snapshotted(step)
        self.committed += 1
        m = self.store.metrics
        m.snapshots.labels(record.reason).inc()
        m.snapshot_bytes.inc(record.size)
        m.snapshot_seconds.observe(time.perf_counter() - started)
        return record

    async def encode(self, ckpt: Checkpoint) -> tuple[bytes, SnapshotRecord]:
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

    @staticmethod
    def checkpoint(
        s: Session, step: int, state: SessionState, reason: str, label: str = ""
    ) -> Checkpoint:
        """A checkpoint of ``s`` at ``step`` (its current step) with ``state``; its
        history window, output and guard state come from what the session holds."""
        history, output = recent_history(s, step), s.recent.output_at(step)
        return checkpoint_of(s, step, state, history, output, reason, label, guards=s.guard_state)


class DueSnapshot:
    """A periodic snapshot waiting for its write (a ``SnapshotJob``): the session's state
    at ``step`` packed into one buffer, its history window and output, copied when it came
    due. Lockstep sessions come due together, so thousands of these wait at once: each is a
    few objects, not a ``Checkpoint`` with per-layer arrays (a session's memory in the
    served process: ``bench/bench_served_memory.py``); the checkpoint is made when the
    write starts."""

    __slots__ = (
        "checkpoints",
        "created_at",
        "guards",
        "history",
        "output",
        "session",
        "state",
        "step",
    )

    def __init__(
        self,
        checkpoints: Checkpoints,
        s: Session,
        step: int,
        state: np.ndarray,
        history: InputHistory,
        guards: GuardState | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.guards = guards  # a value: the session replaces it as it steps
        self.session = s
        self.step = step
        self.state = state  # SessionState.packed
        self.history = history
        self.output = s.recent.output_at(step)
        self.created_at = time.time()  # when it came due, not when its write starts

    async def __call__(self) -> None:
        s, c = self.session, self.session.model.config
        state = SessionState.unpacked(
            self.state, c.num_hidden_layers, c.conv_state_shape, c.ssm_state_shape
        )
        ckpt = checkpoint_of(
            s, self.step, state, self.history, self.output, "periodic",
            created_at=self.created_at, guards=self.guards,
        )  # fmt: skip
        try:
            record = await self.checkpoints.commit(s, ckpt)
        except SsmserveError as exc:  # the log still holds every input: only speed is lost
            log.warning("session %s: periodic snapshot at %d failed: %s", s.id, self.step, exc)
            return
        s.announce(SnapshotEvent(record.snapshot_id, record.step, "periodic"))


def checkpoint_of(
    s: Session,
    step: int,
    state: SessionState,
    history: InputHistory,
    output: np.ndarray | None,
    reason: str,
    label: str = "",
    created_at: float | None = None,
    guards: GuardState | None = None,
) -> Checkpoint:
    """A checkpoint of ``s`` at ``step`` from the parts given (``created_at``: now)."""
    meta = CheckpointMeta(
        created_at=time.time() if created_at is None else created_at,
        reason=reason,
        label=label or None,
    )
    return Checkpoint(
        session_id=s.id,
        step=step,
        model_id=s.model_name,
        fingerprint=s.model.fingerprint,
        state=state,
        history=history,
        meta=meta,
        output=output,
        guards=guards,
    )


def recent_history(s: Session, step: int) -> InputHistory:
    """The history window ending at ``step``, from the inputs the session holds."""
    first, rows = s.recent.history(step, s.config.history_window)
    return InputHistory(first, s.codec.empty() if rows is None else s.codec.decode_rows(rows))
