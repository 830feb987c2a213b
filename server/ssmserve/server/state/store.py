"""The session store: sessions, their leases, their input logs and events, and the
worker registry, in Redis. ``Store`` is the one object the worker holds; its lease
operations are ``store_leases``', its snapshot operations ``snapshot_store``'s, its
import staging ``import_staging``'s, what it knows about Redis itself ``store_facts``',
and the rules every call follows (deadline, unknown outcomes, fencing) ``store_calls``'.

Key names and Lua scripts live in ``store_layout``; these modules run them and turn their
replies into records (``store_records``), and into the typed errors of ``store_errors``.

**Ownership and fencing.** A new session's fencing token comes from
:meth:`Store.create_session`, every later one from :meth:`Store.acquire`;
:meth:`Store.renew_leases` only extends live leases.

``meta.step`` is the durable step: the step a session comes back at after its worker is
gone. Logged inputs cover ``log_start .. step``; ``log_start - 1`` is the step of the
oldest kept snapshot, so any step in ``[log_start - 1, step]`` can be rebuilt exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from ssmserve.server.errors import SsmserveError
from ssmserve.server.observability.metrics import Metrics
from ssmserve.server.state import store_layout as layout
from ssmserve.server.state.import_staging import ImportStaging
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import SessionLease

# sessions/manager.py imports the error of a bad session id from here.
from ssmserve.server.state.session_ids import BadSessionIdError as BadSessionIdError
from ssmserve.server.state.session_ids import check_session_id
from ssmserve.server.state.snapshot_store import SnapshotStore
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_errors import (
    SessionExistsError,
    StoreError,
    StoreOutcomeUnknownError,
    StoreUnavailableError,
    reply_fields,
    unknown_outcome_of,
)
from ssmserve.server.state.store_facts import StoreFactReads
from ssmserve.server.state.store_leases import LeaseCalls
from ssmserve.server.state.store_records import (
    AcquiredLoad,
    SessionMeta,
    SnapshotRecord,
    WorkerRecord,
    flat_hash,
)

EVENTS_KEPT = 1024  # per session: the newest rollbacks and guard events


class Store(LeaseCalls, SnapshotStore, ImportStaging, StoreFactReads):
    """Async access to the session store. One per worker; safe to share between tasks."""

    def __init__(self, settings: StoreSettings, metrics: Metrics | None = None) -> None:
        super().__init__(settings, metrics)
        self._index = f"{settings.key_prefix}:sessions"
        self._workers = f"{settings.key_prefix}:workers"
        self._create = self.redis.register_script(layout.CREATE)
        self._log_append = self.redis.register_script(layout.LOG_APPEND)
        self._log_append_many = self.redis.register_script(layout.LOG_APPEND_MANY)
        self._cut = self.redis.register_script(layout.ROLLBACK_CUT)
        self._close = self.redis.register_script(layout.CLOSE)
        self._record_events = self.redis.register_script(layout.RECORD_EVENTS)
        self._forget_worker_at = self.redis.register_script(layout.FORGET_WORKER_AT)
        self._meta_to_load = self.redis.register_script(layout.META_TO_LOAD)
        self._meta_confirmed = self.redis.register_script(layout.META_CONFIRMED)

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        meta: SessionMeta,
        lease_ms: int,
        record: SnapshotRecord,
        blob: bytes,
        max_snapshots: int,
    ) -> None:
        """Write a new session and its first snapshot at once; ``meta.owner`` holds it.

        ``meta.token`` is the creator's fencing token (a fresh incarnation, epoch 1). If
        the answer is lost, the store is asked again whether this token's session exists,
        so the outcome is known when this returns or raises anything but
        :class:`StoreOutcomeUnknownError`.
        """
        k = self.keys(meta.session_id)
        await self._stage(k, record, blob)
        args = [
            meta.owner, lease_ms, meta.token, record.snapshot_id, record.step, record.pieces,
            record.reason, record.created_at, record.size, max_snapshots, *meta.to_fields(),
        ]  # fmt: skip
        keys = [k.meta, k.lease, k.snaps, k.labels, k.log, *self._new_snapshot_keys(k, record)]
        # The index is another slot: the id goes in first (a reader skips an id whose
        # session is not there, so a create that fails after this leaves no ghost).
        index = {meta.session_id: 0}
        await self._call("create_session", lambda: self.redis.zadd(self._index, index))
        try:
            reply = await self._script("create_session", self._create, keys, args)
        except StoreOutcomeUnknownError as unknown:
            try:  # ask again: did it run?
                current = await self.get_meta(meta.session_id)
            except StoreUnavailableError:
                raise StoreOutcomeUnknownError(
                    f"session {meta.session_id!r} may or may not have been created: {unknown}"
                ) from None
            if current is not None and current.token == meta.token:
                if self.wait_replicas:  # applied, but maybe on the master only
                    raise StoreOutcomeUnknownError(
                        f"session {meta.session_id!r} was created, but too few replicas "
                        f"confirmed it: {unknown}"
                    ) from None
                return  # it was applied
            if current is not None:
                raise SessionExistsError(f"session {meta.session_id!r} already exists") from None
            raise StoreUnavailableError(
                "the session store (Redis) did not answer; the session was not created"
            ) from None
        try:
            self._check(reply)
        except SessionExistsError:
            raise SessionExistsError(f"session {meta.session_id!r} already exists") from None

    async def get_meta(self, session_id: str) -> SessionMeta | None:
        raw = await self._call("get_meta", lambda: self.redis.hgetall(self.keys(session_id).meta))
        return SessionMeta.from_hash(session_id, raw) if raw else None

    async def meta_confirmed(self, session_id: str) -> SessionMeta | None:
        """:meth:`get_meta` for telling a client where a session no worker holds stands.
        When replicas must confirm writes (``wait_replicas``), only what they hold: a step
        whose write the master applied but no replica confirmed (its outcome unknown) is
        lost by a failover, so it is never reported. Raises StoreUnavailableError while
        too few replicas confirm the read (the caller retries)."""
        if not self.wait_replicas:
            return await self.get_meta(session_id)
        meta_key = self.keys(session_id).meta
        try:
            raw = await self._script("get_meta", self._meta_confirmed, [meta_key], [])
            if isinstance(raw, Exception):  # its write refused (OOM, READONLY): unconfirmed
                raise unknown_outcome_of(raw) or StoreOutcomeUnknownError(str(raw))
        except StoreOutcomeUnknownError as exc:
            raise StoreUnavailableError(
                f"the session store could not confirm that its replicas hold session "
                f"{session_id!r} as read ({exc}); retry"
            ) from None
        return SessionMeta.from_hash(session_id, flat_hash(raw)) if raw else None

    async def meta_to_load(self, session_id: str) -> tuple[SessionMeta | None, str]:
        """:meth:`get_meta`, with the id of the newest snapshot at or before the durable
        step ('' for none) in the same round trip: what a load checks before it acquires,
        and the snapshot it asks :meth:`acquire_to_load` to read."""
        k = self.keys(session_id)
        raw = await self._call("get_meta", lambda: self._meta_to_load(keys=[k.meta, k.snaps]))
        pairs = raw[1:]
        if not pairs:
            return None, ""
        meta = SessionMeta.from_hash(session_id, flat_hash(pairs))
        return meta, raw[0].decode()

    async def acquire_to_load(
        self,
        session_id: str,
        worker_id: str,
        address: str,
        lease_ms: int,
        numerics: str = "",
        proof: str = "",
        valid_until: float = 0.0,
        expected_snapshot: str = "",
    ) -> AcquiredLoad:
        """:meth:`acquire` for a load, in the same round trip reading what the load
        restores from (:class:`AcquiredLoad`): the session's meta as the lease is taken
        (the last owner is done), its newest snapshot at or before the durable step, and,
        when that is ``expected_snapshot``, its record and checkpoint bytes (a checkpoint
        over ``INLINE_CHECKPOINT_BYTES`` is read in a second round trip). The lease is trusted
        until ``valid_until``, a ``lease_clock()`` bound the caller takes from when it sent
        the call. What does not parse is raised once the lease is let go again."""
        raw = await self._acquire_reply(
            session_id, worker_id, address, lease_ms, "", numerics, proof, load=True,
            expected_snapshot=expected_snapshot,
        )  # fmt: skip
        fields = reply_fields(raw[:3])
        lease = SessionLease(session_id, fields[1], worker_id, max(0.0, valid_until))
        snapshot_id, record, first, pairs = fields[2], raw[3], raw[4], raw[5:]
        try:
            meta = SessionMeta.from_hash(session_id, flat_hash(pairs))
            read = None
            if record:  # the snapshot expected is the newest
                inline = [] if first is None else [first]  # a big one is not inline
                read = await self.snapshot_from(session_id, snapshot_id, flat_hash(record), inline)
        except BaseException:
            with contextlib.suppress(SsmserveError):
                await self.release(lease)
            raise
        return AcquiredLoad(lease, meta, snapshot_id, read)

    async def count_sessions(self, prefix: str) -> int:
        """Stored sessions whose id starts with ``prefix`` (a tenant's, ending in '~')."""
        return int(
            await self._call(
                "count_sessions",
                lambda: self.redis.zlexcount(self._index, f"[{prefix}", f"({prefix}\x7f"),
            )
        )

    async def list_session_ids(self, after: str, count: int, prefix: str = "") -> list[str]:
        """Up to ``count`` ids after ``after``, in order; only those starting with
        ``prefix`` (a tenant's, ending in '~': every later character sorts below DEL)."""
        start = f"({after}" if after else (f"[{prefix}" if prefix else "-")
        end = f"({prefix}\x7f" if prefix else "+"
        ids = await self._call(
            "list_session_ids",
            lambda: self.redis.zrangebylex(self._index, start, end, start=0, num=count),
        )
        return [i.decode(errors="replace") for i in ids]

    async def close_session(self, lease: SessionLease, keep_snapshot: str = "") -> None:
        k = self.keys(lease.session_id)

        async def gone() -> list[str]:
            ids = await self._call("close_session", lambda: self.redis.zrange(k.snaps, 0, -1))
            return [i.decode() for i in ids if i.decode() != keep_snapshot]

        await self._with_drops(
            "close_session",
            lease.session_id,
            gone,
            self._close,
            [k.meta, k.snaps, k.labels, k.log, k.lease, k.events],
            [keep_snapshot, lease.token],
        )
        if not keep_snapshot:  # the index is another slot: the id leaves it after
            await self._call(
                "close_session", lambda: self.redis.zrem(self._index, lease.session_id)
            )

    # ------------------------------------------------------------------ worker registry

    async def register_worker(self, record: WorkerRecord, ttl_ms: int) -> None:
        """Write (or refresh) a worker's entry and its copy at its address; both disappear
        ``ttl_ms`` after the last one."""
        key = self._worker_key(record.worker_id)
        at = self._worker_at_key(record.address)
        fields = record.to_fields()

        async def run() -> None:
            # The entry and its expiry at once (one key, so one slot even on a cluster);
            # the copy at the address and the set of ids are other slots, and readers
            # forget ids whose entry is gone. The copy is replaced whole, so nothing of an
            # earlier worker at that address stays in it.
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=fields)
                pipe.pexpire(key, ttl_ms)
                await pipe.execute()
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(at)
                pipe.hset(at, mapping=fields | {"worker_id": record.worker_id})
                pipe.pexpire(at, ttl_ms)
                await pipe.execute()
            await self.redis.sadd(self._workers, record.worker_id)

        await self._call("register_worker", run)

    async def deregister_worker(self, worker_id: str, address: str) -> None:
        async def run() -> None:  # three slots on a cluster: three commands
            await self._forget_worker_at(keys=[self._worker_at_key(address)], args=[worker_id])
            await self.redis.delete(self._worker_key(worker_id))
            await self.redis.srem(self._workers, worker_id)

        await self._call("deregister_worker", run)

    async def worker_at(self, address: str) -> WorkerRecord | None:
        """The live worker registered at ``address``, or None: its copy there, one round
        trip (a Migrate's look at its target); without one (a worker of a version that
        keeps none, or nobody there), the whole registry's read decides."""
        raw = await self._call(
            "worker_at", lambda: self.redis.hgetall(self._worker_at_key(address))
        )
        if raw.get(b"worker_id") and b"address" in raw:
            return WorkerRecord.from_hash(raw[b"worker_id"].decode(), raw)
        return next((w for w in await self.live_workers() if w.address == address), None)

    def _worker_key(self, worker_id: str) -> str:
        return f"{self.settings.key_prefix}:worker:{worker_id}"

    def _worker_at_key(self, address: str) -> str:
        return f"{self.settings.key_prefix}:worker_at:{address}"

    async def live_workers(self) -> list[WorkerRecord]:
        """Every worker whose entry has not expired, by address; forgets expired ones."""
        ids = [
            i.decode()
            for i in await self._call("live_workers", lambda: self.redis.smembers(self._workers))
        ]
        if not ids:
            return []

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for worker_id in ids:
                    pipe.hgetall(self._worker_key(worker_id))
                return await pipe.execute()

        raws = await self._call("live_workers", run)
        gone = [i for i, raw in zip(ids, raws, strict=True) if not raw]
        if gone:
            await self._call("live_workers", lambda: self.redis.srem(self._workers, *gone))
        live = [WorkerRecord.from_hash(i, raw) for i, raw in zip(ids, raws, strict=True) if raw]
        return sorted(live, key=lambda w: w.address)

    # ------------------------------------------------------------------ input log

    async def append_logs(
        self,
        appends: Sequence[tuple[SessionLease, InputBlock]],
        updated_at: float,
    ) -> list[SsmserveError | None]:
        """Group commit: ``(lease, inputs)`` for many sessions, one round trip.

        Returns one entry per append: None when it was recorded, else the error. A lost
        answer raises :class:`StoreOutcomeUnknownError` for all of them.
        """
        if not appends:
            return []
        if isinstance(self.redis, RedisCluster):  # one script per session: one slot each
            calls = []
            for lease, block in appends:
                k = self.keys(lease.session_id)
                calls.append(
                    ([k.meta, k.log], [lease.token, block.first, updated_at, *block.inputs()])
                )
            replies = await self._scripts("append_logs", self._log_append, calls)
            return [self._outcome(reply) for reply in replies]
        # One server: LOG_APPEND_MANY. Per session: token, first step, input count, its
        # inputs as one string.
        per_session = []
        for lease, block in appends:
            k = self.keys(lease.session_id)
            args = (lease.token, block.first, block.count, block.data)
            per_session.append(((k.meta, k.log), args))
        return await self._many(
            "append_logs", self._log_append_many, [updated_at], per_session, "group commit"
        )

    async def read_log(self, session_id: str, first: int, last: int) -> list[bytes]:
        """Logged inputs of steps ``first..last``; raises StoreError if any is missing."""
        if last < first:
            return []
        fields = [str(s) for s in range(first, last + 1)]
        values = await self._call(
            "read_log", lambda: self.redis.hmget(self.keys(session_id).log, fields)
        )
        missing = [f for f, v in zip(fields, values, strict=True) if v is None]
        if missing:
            raise StoreError(
                f"input log of session {session_id!r} lacks steps {missing[0]}..{missing[-1]}"
            )
        return list(values)

    # ------------------------------------------------------------------ events

    async def record_events(
        self, lease: SessionLease, entries: Sequence[bytes], keep: int = EVENTS_KEPT
    ) -> None:
        """Append what happened to a session (msgpack maps, ``SessionEvent``), keeping the
        newest ``keep``."""
        k = self.keys(lease.session_id)
        reply = await self._script(
            "record_events", self._record_events, [k.meta, k.events], [lease.token, keep, *entries]
        )
        self._fenced(reply)

    async def read_events(self, session_id: str) -> list[bytes]:
        k = self.keys(session_id)
        return list(await self._call("read_events", lambda: self.redis.lrange(k.events, 0, -1)))

    # ------------------------------------------------------------------ rollback

    async def cut_history(
        self, lease: SessionLease, step: int, upto: int, updated_at: float
    ) -> None:
        """Delete snapshots and logged inputs after ``step``; the durable step drops to it."""
        k = self.keys(lease.session_id)

        async def later() -> list[str]:
            ids = await self._call(
                "cut_history", lambda: self.redis.zrangebyscore(k.snaps, f"({step}", "+inf")
            )
            return [i.decode() for i in ids]

        await self._with_drops(
            "cut_history",
            lease.session_id,
            later,
            self._cut,
            [k.meta, k.snaps, k.labels, k.log],
            [step, upto, updated_at, lease.token],
        )

    async def session_keys(self, session_id: str) -> list[str]:
        """Every key of a session (tests and operators; SCAN, so not for hot paths)."""
        pattern = f"{self.settings.key_prefix}:{{{check_session_id(session_id, stored=True)}}}:*"

        async def scan() -> list[str]:
            return [key.decode() async for key in self.redis.scan_iter(match=pattern, count=500)]

        return sorted(await self._call("session_keys", scan))
