"""Snapshots in Redis: committed in two phases, read back, dropped by retention.

Writing a snapshot is two phases (DESIGN.md, "Redis over loopback"): plain ``SET``s put the
blob into staging keys in pieces of at most ``piece_bytes``; a small script then renames
the pieces into place and updates the index. Big payloads never pass through Lua, where
they would block Redis for the whole copy. The writer picks the snapshot id before the
first attempt, so a commit sent again finds its id already committed and does nothing.

A script that deletes snapshots (retention, close, a rollback's cut) declares every key
it drops: the caller reads which snapshots and how many pieces each has, and the script
refuses with ERR_RACE when they changed meanwhile (``_with_drops``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.commands.core import AsyncScript

from ssmserve.server.errors import SsmserveError
from ssmserve.server.observability.metrics import Metrics
from ssmserve.server.state import store_layout as layout
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store_calls import StoreCalls, StoreSettings
from ssmserve.server.state.store_errors import SnapshotsChangedError, StoreError
from ssmserve.server.state.store_layout import Keys
from ssmserve.server.state.store_records import SnapshotCommit, SnapshotRecord

RACE_ATTEMPTS = 4  # reads and tries again of a script that found the snapshots changed


class SnapshotStore(StoreCalls):
    """The store's snapshot operations (``Store`` has these methods)."""

    def __init__(self, settings: StoreSettings, metrics: Metrics | None = None) -> None:
        super().__init__(settings, metrics)
        self._commit = self.redis.register_script(layout.COMMIT_SNAPSHOT)

    async def commit_snapshot(
        self,
        lease: SessionLease,
        record: SnapshotRecord,
        blob: bytes,
        max_snapshots: int,
    ) -> None:
        """Commit one snapshot (:meth:`commit_snapshots` for one); raises its error."""
        (error,) = await self.commit_snapshots([SnapshotCommit(lease, record, blob, max_snapshots)])
        if error is not None:
            raise error

    async def commit_snapshots(
        self, commits: Sequence[SnapshotCommit]
    ) -> list[SsmserveError | None]:
        """Commit many snapshots (of different sessions) in three round trips per node.

        1. One pipeline: every blob into its record's staging keys with plain ``SET``s in
           pieces (they expire), and every session's snapshot index read (``ZRANGE``).
        2. One pipeline: the piece counts of the snapshots that retention will drop (the
           oldest past ``max_snapshots``), so the scripts can declare their keys.
        3. One batch of commit scripts (``ScriptBatches``): each renames its pieces into
           place, updates the index and drops the declared snapshots.

        A script that found its session's snapshots changed since step 1 (ERR_RACE) is
        read and sent again, up to ``RACE_ATTEMPTS`` times. Returns one entry per commit:
        None when committed, else its error (fenced, pieces gone, ...). Trouble that hits
        them all raises: Redis unreachable, or a lost answer (``StoreOutcomeUnknownError``).
        """
        if not commits:
            return []
        piece = self.settings.piece_bytes
        for c in commits:
            if c.record.pieces != max(1, -(-len(c.blob) // piece)):
                raise ValueError(
                    f"record says {c.record.pieces} pieces, its blob of {len(c.blob)} bytes "
                    f"needs {max(1, -(-len(c.blob) // piece))}"
                )
        errors: list[SsmserveError | None] = [None] * len(commits)
        todo = list(range(len(commits)))
        for attempt in range(RACE_ATTEMPTS):
            indexes = await self._stage_and_list([commits[i] for i in todo], stage=attempt == 0)
            doomed = [
                _retention(ids, commits[i].record.snapshot_id, commits[i].max_snapshots)
                for i, ids in zip(todo, indexes, strict=True)
            ]
            pieces = await self._piece_counts(
                [(commits[i].lease.session_id, ids) for i, ids in zip(todo, doomed, strict=True)]
            )
            calls = []
            for i, ids, counts in zip(todo, doomed, pieces, strict=True):
                c = commits[i]
                k = self.keys(c.lease.session_id)
                drop_keys, drop_args = _declared_drops(k, ids, counts)
                r = c.record
                args = [
                    c.lease.token, r.snapshot_id, r.step, r.pieces, r.label, r.reason,
                    r.created_at, r.size, c.max_snapshots, *drop_args,
                ]  # fmt: skip
                keys = [k.meta, k.snaps, k.labels, k.log, *self._new_snapshot_keys(k, r)]
                calls.append(([*keys, *drop_keys], args))
            replies = await self._scripts("commit_snapshot", self._commit, calls)
            raced = []
            for i, reply in zip(todo, replies, strict=True):
                outcome = self._outcome(reply)
                if isinstance(outcome, SnapshotsChangedError):
                    raced.append(i)
                else:
                    errors[i] = outcome
            todo = raced
            if not todo:
                return errors
        for i in todo:
            errors[i] = SnapshotsChangedError(
                f"the snapshots of session {commits[i].lease.session_id!r} kept changing "
                f"while commit_snapshot ran"
            )
        return errors

    async def _stage(self, k: Keys, record: SnapshotRecord, blob: bytes) -> None:
        """Put ``blob`` into the record's staging keys (one pipeline)."""
        if record.pieces != max(1, -(-len(blob) // self.settings.piece_bytes)):
            raise ValueError(f"record says {record.pieces} pieces for {len(blob)} bytes")

        async def stage() -> None:
            async with self.redis.pipeline(transaction=False) as pipe:
                self._stage_pieces(pipe, k, record, blob)
                await pipe.execute()

        # Staging keys are private to this commit (its id is new): a lost answer here is
        # harmless, the commit that follows finds out whether every piece arrived.
        await self._call("stage_snapshot", stage)

    def _stage_pieces(self, pipe: Any, k: Keys, record: SnapshotRecord, blob: bytes) -> None:
        """Queue the ``SET``s of ``blob``'s pieces into its staging keys (they expire)."""
        piece = self.settings.piece_bytes
        view = memoryview(blob)
        for i in range(record.pieces):
            pipe.set(
                k.stage(record.snapshot_id, i),
                view[i * piece : (i + 1) * piece],
                ex=self.settings.stage_ttl_s,
            )

    async def _stage_and_list(
        self, commits: Sequence[SnapshotCommit], stage: bool
    ) -> list[list[str]]:
        """Step 1 of :meth:`commit_snapshots`: stage the blobs (when ``stage``) and read each
        session's snapshot ids, in one pipeline."""

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for c in commits:
                    k = self.keys(c.lease.session_id)
                    if stage:
                        self._stage_pieces(pipe, k, c.record, c.blob)
                    pipe.zrange(k.snaps, 0, -1)
                return await pipe.execute()

        # Staging keys are private to a commit (its id is new): a lost answer here is
        # harmless, the commit that follows finds out whether every piece arrived.
        replies = await self._call("stage_snapshot" if stage else "commit_snapshot", run)
        indexes, at = [], 0
        for c in commits:
            at += c.record.pieces if stage else 0
            indexes.append([i.decode() for i in replies[at]])
            at += 1
        return indexes

    async def _piece_counts(
        self, doomed: Sequence[tuple[str, list[str]]], op: str = "commit_snapshot"
    ) -> list[list[Any]]:
        """Step 2: the ``pieces`` field of each ``(session id, snapshot ids)`` pair's
        snapshots, in one pipeline (nothing to read: no round trip)."""
        if not any(ids for _, ids in doomed):
            return [[] for _ in doomed]

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for session_id, ids in doomed:
                    k = self.keys(session_id)
                    for snapshot_id in ids:
                        pipe.hget(k.snap(snapshot_id), "pieces")
                return await pipe.execute()

        flat = await self._call(op, run)
        counts, at = [], 0
        for _, ids in doomed:
            counts.append(flat[at : at + len(ids)])
            at += len(ids)
        return counts

    async def list_snapshots(self, session_id: str) -> list[SnapshotRecord]:
        k = self.keys(session_id)
        ids = [
            i.decode()
            for i in await self._call("list_snapshots", lambda: self.redis.zrange(k.snaps, 0, -1))
        ]
        return await self._records(session_id, ids)

    async def _records(self, session_id: str, ids: list[str]) -> list[SnapshotRecord]:
        if not ids:
            return []
        k = self.keys(session_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for snapshot_id in ids:
                    pipe.hgetall(k.snap(snapshot_id))
                return await pipe.execute()

        raws = await self._call("records", run)
        return [SnapshotRecord.from_hash(i, raw) for i, raw in zip(ids, raws, strict=True) if raw]

    async def snapshot_at_or_before(self, session_id: str, step: int) -> SnapshotRecord | None:
        """The newest snapshot whose step is <= ``step``."""
        k = self.keys(session_id)
        ids = await self._call(
            "snapshot_at_or_before",
            lambda: self.redis.zrevrangebyscore(k.snaps, step, "-inf", start=0, num=1),
        )
        records = await self._records(session_id, [i.decode() for i in ids])
        return records[0] if records else None

    async def snapshot_by_id(self, session_id: str, snapshot_id: str) -> SnapshotRecord | None:
        k = self.keys(session_id)
        raw = await self._call("records", lambda: self.redis.hgetall(k.snap(snapshot_id)))
        return SnapshotRecord.from_hash(snapshot_id, raw) if raw else None

    async def snapshot_and_blob(
        self, session_id: str, snapshot_id: str
    ) -> tuple[SnapshotRecord, bytes] | None:
        """Snapshot ``snapshot_id`` and its checkpoint bytes (None when there is no such
        snapshot): its record and first piece in one round trip, the other pieces (a
        checkpoint over ``piece_bytes``, 1-4 MiB) in a second. A load reads both at once."""
        k = self.keys(session_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(k.snap(snapshot_id))
                pipe.get(k.blob(snapshot_id, 0))
                return await pipe.execute()

        raw, first = await self._call("record_and_blob", run)
        if not raw:
            return None
        return await self.snapshot_from(session_id, snapshot_id, raw, [first])

    async def snapshot_from(
        self,
        session_id: str,
        snapshot_id: str,
        raw: dict[bytes, bytes],
        read: list[bytes | None],
    ) -> tuple[SnapshotRecord, bytes]:
        """Snapshot ``snapshot_id`` and its checkpoint bytes from its record's hash and
        the pieces already read, in order (``raw``, ``read``); the others are read here."""
        record = SnapshotRecord.from_hash(snapshot_id, raw)
        pieces = read[: record.pieces]
        if len(pieces) < record.pieces:
            k = self.keys(session_id)
            rest = [k.blob(snapshot_id, i) for i in range(len(pieces), record.pieces)]
            pieces += await self._call("read_blob", lambda: self.redis.mget(rest))
        return record, self._joined(session_id, record, pieces)

    async def snapshot_by_label(self, session_id: str, label: str) -> SnapshotRecord | None:
        snapshot_id = await self._call(
            "snapshot_by_label", lambda: self.redis.hget(self.keys(session_id).labels, label)
        )
        if snapshot_id is None:
            return None
        return await self.snapshot_by_id(session_id, snapshot_id.decode())

    async def read_blob(self, session_id: str, record: SnapshotRecord) -> bytes:
        k = self.keys(session_id)
        names = [k.blob(record.snapshot_id, i) for i in range(record.pieces)]
        pieces = await self._call("read_blob", lambda: self.redis.mget(names))
        return self._joined(session_id, record, pieces)

    @staticmethod
    def _joined(session_id: str, record: SnapshotRecord, pieces: list[bytes | None]) -> bytes:
        """The checkpoint bytes of ``record`` from its pieces, as read."""
        if any(p is None for p in pieces):
            raise StoreError(f"snapshot {record.snapshot_id} of {session_id!r} has lost pieces")
        blob = b"".join(p for p in pieces if p is not None)
        if len(blob) != record.size:
            raise StoreError(
                f"snapshot {record.snapshot_id} is {len(blob)} bytes, index says {record.size}"
            )
        return blob

    async def snapshot_count_and_oldest(self, session_id: str) -> tuple[int, int | None]:
        k = self.keys(session_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zcard(k.snaps)
                pipe.zrange(k.snaps, 0, 0, withscores=True)
                return await pipe.execute()

        count, head = await self._call("snapshot_count_and_oldest", run)
        return int(count), (int(head[0][1]) if head else None)

    @staticmethod
    def _new_snapshot_keys(k: Keys, record: SnapshotRecord) -> list[str]:
        """A new snapshot's keys as ``new_snapshot`` in the scripts reads them."""
        ids = range(record.pieces)
        return [
            k.snap(record.snapshot_id),
            *(k.stage(record.snapshot_id, i) for i in ids),
            *(k.blob(record.snapshot_id, i) for i in ids),
        ]

    async def _with_drops(
        self,
        op: str,
        session_id: str,
        doomed: Callable[[], Awaitable[list[str]]],
        script: AsyncScript,
        keys: list[Any],
        args: list[Any],
    ) -> None:
        """Run a script that deletes snapshots: read which (``doomed``) and their pieces,
        declare their keys after ``keys`` and ``args`` (``declared`` in the scripts), run
        it; read again if it found them changed meanwhile (ERR_RACE)."""
        k = self.keys(session_id)
        for _ in range(RACE_ATTEMPTS):
            ids = await doomed()
            (pieces,) = await self._piece_counts([(session_id, ids)], op)
            drop_keys, drop_args = _declared_drops(k, ids, pieces)
            reply = await self._script(op, script, [*keys, *drop_keys], [*args, *drop_args])
            try:
                self._fenced(reply)
                return
            except SnapshotsChangedError:
                continue
        raise SnapshotsChangedError(
            f"the snapshots of session {session_id!r} kept changing while {op} ran"
        )


def _retention(ids: list[str], new_id: str, max_snapshots: int) -> list[str]:
    """The snapshots a commit of ``new_id`` drops, as the commit script's ``retention``
    picks them: the oldest of ``ids`` (sorted oldest first) past ``max_snapshots``."""
    older = [i for i in ids if i != new_id]
    return older[: max(0, len(older) + 1 - max_snapshots)]


def _declared_drops(k: Keys, ids: list[str], pieces: Sequence[Any]) -> tuple[list[str], list[Any]]:
    """The keys and arguments that declare the snapshots ``ids`` (with their ``pieces``
    fields as read) to a script that drops them (``declared`` in the scripts)."""
    keys: list[str] = []
    args: list[Any] = [len(ids)]
    for snapshot_id, n in zip(ids, pieces, strict=True):
        count = int(n) if n is not None and n.isdigit() else 0
        keys += [k.snap(snapshot_id), *(k.blob(snapshot_id, i) for i in range(count))]
        args += [snapshot_id, count]
    return keys, args
