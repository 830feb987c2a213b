"""Snapshot commits that come due together go to Redis together.

Why. Lockstep sessions (a stream of many sessions, a step of each per message) come due
for their periodic snapshots in the same stepper batch. Written one by one, each snapshot
costs three round trips of its own (stage, read retention, commit) and redis-py's Python
for each command: with 64 demo sessions that was ~0.5 ms of event loop per snapshot, and
the steps of the next messages waited behind it (``bench/bench_service.py``, "step latency
while snapshots are written").

How. :meth:`SnapshotCommits.commit` queues a commit and waits for it. The first commit
queued while no batch is being written starts one; it runs on the next turn of the event
loop, after every writer woken by the same stepper batch has queued its commit, and takes
them all in one :meth:`Store.commit_snapshots` (three round trips for all). Commits queued
while a batch is in flight go together in the next one (group commit). A batch is cut at
``max_batch`` commits or ``max_bytes`` of blobs.

Each waiter gets its own outcome: None, its own error (fenced, pieces gone), or the error
that hit the whole batch (Redis unreachable, a lost answer). A waiter that is cancelled
stops waiting; its commit may still be written (as a cancelled single write may have been):
its lease's token fences it if the session has moved on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from ssmserve.server.state.store import Store
from ssmserve.server.state.store_records import SnapshotCommit

#: Commits per batch: bounds one pipeline's size and the Lua work of one round.
MAX_BATCH = 64
#: Blob bytes per batch (a batch always takes at least one commit, however large).
MAX_BYTES = 64 << 20


class SnapshotCommits:
    def __init__(
        self, store: Store, max_batch: int = MAX_BATCH, max_bytes: int = MAX_BYTES
    ) -> None:
        self.store = store
        self.max_batch = max_batch
        self.max_bytes = max_bytes
        self._pending: deque[tuple[SnapshotCommit, asyncio.Future[None]]] = deque()
        self._writer: asyncio.Task[None] | None = None
        self.batches = 0  # written, for tests and benchmarks

    async def commit(self, commit: SnapshotCommit) -> None:
        """Commit ``commit`` with whatever else comes due now; raises its error."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((commit, done))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write(), name="snapshot-commits")
        await done

    async def _write(self) -> None:
        try:
            while self._pending:
                batch = self._take()
                try:
                    errors: Sequence[BaseException | None] = await self.store.commit_snapshots(
                        [c for c, _ in batch]
                    )
                except asyncio.CancelledError:  # close(): nobody gets an answer
                    for _, done in batch:
                        done.cancel()
                    raise
                except Exception as exc:  # the whole batch: each waiter raises it
                    errors = [exc] * len(batch)
                for (_, done), error in zip(batch, errors, strict=True):
                    if done.done():  # its waiter was cancelled
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
                self.batches += 1
        finally:
            self._writer = None

    def _take(self) -> list[tuple[SnapshotCommit, asyncio.Future[None]]]:
        batch = [self._pending.popleft()]
        size = len(batch[0][0].blob)
        while self._pending and len(batch) < self.max_batch:
            size += len(self._pending[0][0].blob)
            if size > self.max_bytes:
                break
            batch.append(self._pending.popleft())
        return batch

    def close(self) -> None:
        """Stop: the batch in flight is cancelled, queued commits are cancelled unwritten."""
        while self._pending:
            _, done = self._pending.popleft()
            done.cancel()
        if self._writer is not None:
            self._writer.cancel()
