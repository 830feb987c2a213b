"""Background snapshot writes for one session: one at a time, a few waiting, oldest dropped.

Why. Encoding a checkpoint (sha256 over the state) and writing it to Redis takes
milliseconds for a large model; done inside a stepper batch it delays every session of
that batch. The stepper therefore copies the due state and hands a write to the session's
:class:`SnapshotWriter`, and answers the steps at once.

Rules:
* at most one write per session is in flight; writes that come due meanwhile wait in
  order, at most ``MAX_WAITING`` of them: past that the oldest waiting one is dropped
  (superseded: a newer snapshot covers its log flush too, and replay reaches its step);
* every operation that holds the session exclusively (rollback, manual snapshot, export,
  close, migrate, unload at shutdown) first waits for :meth:`settled`, so no write lands
  after a rollback cut or a hand-off;
* a failed write is logged and dropped: the log still holds every input, only restore
  speed is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

SnapshotJob = Callable[[], Awaitable[None]]

#: Writes that may wait behind the one in flight (each holds a copy of the state).
MAX_WAITING = 4


class SnapshotWriter:
    __slots__ = ("_task", "_waiting", "session_id", "superseded", "written")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._task: asyncio.Task[None] | None = None
        # A list, not a deque: at most MAX_WAITING entries, and an empty deque holds a
        # 528-byte block in each of thousands of sessions.
        self._waiting: list[SnapshotJob] = []
        self.written = 0
        self.superseded = 0

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def schedule(self, job: SnapshotJob) -> bool:
        """Run ``job`` after the writes before it; drop the oldest waiting one if full
        (then True)."""
        dropped = len(self._waiting) == MAX_WAITING
        if dropped:
            del self._waiting[0]
            self.superseded += 1
        self._waiting.append(job)
        if not self.busy:
            self._task = asyncio.create_task(
                self._run(), name=f"snapshot-writer[{self.session_id}]"
            )
        return dropped

    async def _run(self) -> None:
        while self._waiting:
            job = self._waiting.pop(0)
            try:
                await job()
                self.written += 1
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one write must not stop later ones
                log.exception("session %s: background snapshot failed", self.session_id)

    async def settled(self) -> None:
        """Wait until nothing is in flight or waiting (cancelling the caller leaves it be)."""
        while self.busy:
            assert self._task is not None
            await asyncio.wait({self._task})

    def cancel(self) -> None:
        """The session left this worker: drop the waiting write and stop the one in flight."""
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()
