"""Background snapshot writes: a few waiting per session, a few in flight per worker.

Why. Encoding a checkpoint (sha256 over the state) and writing it to Redis takes
milliseconds for a large model; done inside a stepper batch it delays every session of
that batch. The stepper therefore copies the due state and hands a write to the session's
:class:`SnapshotWriter`, and answers the steps at once.

Rules:
* at most one write per session is in flight; writes that come due meanwhile wait in
  order, at most ``MAX_WAITING`` of them: past that the oldest waiting one is dropped
  (superseded: a newer snapshot covers its log flush too, and replay reaches its step);
* at most ``limit`` writes per worker are in flight (:class:`SnapshotWrites`); sessions
  with writes waiting take turns in the order they came due, except that a session a
  guard rollback waits for (``SnapshotWriter.settled(hurry=True)``) goes first: that
  wait is inside a stepper batch, so every session of the model waits with it, and
  behind a burst of thousands of due writes that was seconds;
* every operation that holds the session exclusively (rollback, manual snapshot, export,
  close, migrate, unload at shutdown) first waits for :meth:`SnapshotWriter.settled`, so no
  write lands after a rollback cut or a hand-off;
* a failed write is logged and dropped: the log still holds every input, only restore
  speed is lost.

A write is a task only while it is in flight. Lockstep sessions come due together: as
tasks, 3,000 of them would hold 3,000 coroutines, futures and contexts (~2 KiB of small
objects each) waiting for a slot, and the allocator's pools those leave behind stay in the
process after the burst (``bench/bench_served_memory.py`` measures a session's memory in
the served process). A waiting write is one entry
in its session's list, and a session with writes waiting one entry in the worker's queue.
In-flight writes wait only for Redis (each store call has a deadline) and, briefly, for a
log flush under way, never for a stepper batch: a batch that waits for a session's writes
to settle (a guard rollback) cannot block the writes ahead of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

SnapshotJob = Callable[[], Awaitable[None]]

#: Writes that may wait behind the one in flight (each holds a copy of the state).
MAX_WAITING = 4


class SnapshotWrites:
    """A worker's background snapshot writes: at most ``limit`` in flight at once."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"snapshot writes in flight must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.closed = False  # the worker stops: nothing more starts
        self._ready: deque[SnapshotWriter] = deque()  # sessions with a write waiting, in turn

    def close(self) -> None:
        """The worker stops without writing: no waiting write starts from now on (the ones
        in flight end as their sessions are dropped)."""
        self.closed = True
        for writer in self._ready:
            writer._queued = False
            writer._waiting = ()
            writer._wake_if_settled()
        self._ready.clear()

    def _enqueue(self, writer: SnapshotWriter) -> None:
        self._ready.append(writer)
        self._start()

    def _start(self) -> None:
        while self.in_flight < self.limit and self._ready and not self.closed:
            writer = self._ready.popleft()
            writer._queued = False
            if writer._waiting:  # (cancelled while it waited: nothing to run)
                writer._launch(self)
                self.in_flight += 1

    def _finished(self, writer: SnapshotWriter) -> None:
        self.in_flight -= 1
        if self.closed:
            writer._waiting = ()
        elif writer._waiting and not writer._queued:
            writer._queued = True
            if writer._hurried:  # a guard rollback waits for it: its next write is next
                self._ready.appendleft(writer)
            else:  # its next write takes its turn behind the others
                self._ready.append(writer)
        self._start()

    def _hurry(self, writer: SnapshotWriter) -> None:
        """A guard rollback waits for ``writer``'s writes: its turn is the next free slot."""
        if writer._queued and not self.closed and self._ready[0] is not writer:
            self._ready.remove(writer)  # O(sessions waiting), once per wait
            self._ready.appendleft(writer)


class SnapshotWriter:
    """One session's background snapshot writes (see the module's doc)."""

    __slots__ = (
        "_hurried",
        "_queued",
        "_settled",
        "_task",
        "_waiting",
        "_writes",
        "session_id",
        "superseded",
        "written",
    )

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._task: asyncio.Task[None] | None = None  # the write in flight
        # A tuple, replaced when it changes: at most MAX_WAITING entries, and most of
        # thousands of sessions have none (the empty tuple is one shared object, where an
        # empty list costs each session 56 bytes and an empty deque 600).
        self._waiting: tuple[SnapshotJob, ...] = ()
        self._queued = False  # in the worker's queue, waiting for a slot
        self._settled: asyncio.Future[None] | None = None  # made when someone waits
        self._hurried = 0  # waiters in settled(hurry=True)
        self._writes: SnapshotWrites | None = None  # the worker's, once a write was due
        self.written = 0
        self.superseded = 0

    @property
    def busy(self) -> bool:
        """A write is in flight or waiting."""
        return self._task is not None or bool(self._waiting)

    def schedule(self, job: SnapshotJob, writes: SnapshotWrites) -> bool:
        """Run ``job`` after this session's writes before it, in a slot of ``writes``; drop
        the oldest waiting one if full (then True)."""
        if writes.closed:
            return False
        self._writes = writes
        dropped = len(self._waiting) == MAX_WAITING
        if dropped:
            self._waiting = self._waiting[1:]
            self.superseded += 1
        self._waiting = (*self._waiting, job)
        if self._task is None and not self._queued:
            self._queued = True
            writes._enqueue(self)
        return dropped

    def _launch(self, writes: SnapshotWrites) -> None:
        job = self._waiting[0]
        task = asyncio.create_task(self._run(job), name=f"snapshot-writer[{self.session_id}]")
        self._waiting = self._waiting[1:]  # taken only once its task exists (create_task may raise)
        self._task = task
        task.add_done_callback(lambda _: self._done(writes))

    async def _run(self, job: SnapshotJob) -> None:
        try:
            await job()
            self.written += 1
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one write must not stop later ones
            log.exception("session %s: background snapshot failed", self.session_id)

    def _done(self, writes: SnapshotWrites) -> None:
        self._task = None
        writes._finished(self)
        self._wake_if_settled()

    def _wake_if_settled(self) -> None:
        if not self.busy and self._settled is not None:
            if not self._settled.done():
                self._settled.set_result(None)
            self._settled = None

    async def settled(self, hurry: bool = False) -> None:
        """Wait until nothing is in flight or waiting (cancelling the caller leaves the
        writes and the other waiters be).

        ``hurry``: this session's writes go before the others waiting for a slot while we
        wait. For a guard rollback, which waits inside a stepper batch: every session of
        that model waits with it. Not for control operations and reads, which hold only
        their own session (a client polling one session would otherwise keep it first).
        """
        if hurry:
            self._hurried += 1
        try:
            while self.busy:
                if self._settled is None:
                    self._settled = asyncio.get_running_loop().create_future()
                if hurry and self._writes is not None:
                    self._writes._hurry(self)
                await asyncio.wait({self._settled})
        finally:
            if hurry:
                self._hurried -= 1

    def cancel(self) -> None:
        """The session left this worker: drop the waiting writes and stop the one in flight
        (its slot is given back when it has stopped)."""
        self._waiting = ()
        if self._task is not None:
            self._task.cancel()
        else:
            self._wake_if_settled()
