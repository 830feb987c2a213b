"""Redis I/O for sessions: with ``script_batches`` (batched scripts on each topology), the
only code that talks to Redis.

Key names and Lua scripts live in ``store_layout``; this module runs them and turns their
replies into records, and into the typed errors of ``store_errors``.

Writing a snapshot is two phases (DESIGN.md, "Redis over loopback"): plain ``SET``s put the
blob into staging keys in pieces of at most ``piece_bytes``; a small script then renames
the pieces into place and updates the index. Big payloads never pass through Lua, where
they would block Redis for the whole copy. The writer picks the snapshot id before the
first attempt, so a commit sent again finds its id already committed and does nothing.

**Ownership and fencing.** Every write of a session carries its owner's
:class:`~ssmserve.server.state.lease.SessionLease`; the scripts compare its fencing token with the
session's current one and change nothing when they differ (:class:`StaleEpochError`). A
new session's token comes from :meth:`Store.create_session`, every later one from
:meth:`Store.acquire`; :meth:`Store.renew_leases` only extends live leases.

**Unknown outcomes.** redis-py does not retry here (``retry`` off), and a write whose
answer never came (a timeout, a connection cut after the command left) may or may not
have run: it raises :class:`StoreOutcomeUnknownError`, and the session manager reloads the
session from Redis before it answers anything else about it. Reads that fail raise
:class:`StoreUnavailableError`.

``meta.step`` is the durable step: the step a session comes back at after its worker is
gone. Logged inputs cover ``log_start .. step``; ``log_start - 1`` is the step of the
oldest kept snapshot, so any step in ``[log_start - 1, step]`` can be rebuilt exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from ssmserve.server.errors import SessionMovedError, SsmserveError, clip
from ssmserve.server.observability.metrics import Metrics
from ssmserve.server.state import redis_topology
from ssmserve.server.state import store_layout as layout
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.lease import SessionLease, new_incarnation, new_nonce
from ssmserve.server.state.script_batches import NOT_RUN, ScriptBatches, until_run
from ssmserve.server.state.store_errors import (
    LeaseHeldError,
    SessionExistsError,
    SessionMissingError,
    SessionVanishedError,
    SnapshotsChangedError,
    StagedPiecesMissingError,
    StaleEpochError,
    StoreDataError,
    StoreError,
    StoreOutcomeUnknownError,
    StoreUnavailableError,
    check_reply,
    reply_fields,
    reply_outcome,
    unknown_outcome_of,
)
from ssmserve.server.state.store_facts import EvictionPolicies, StoreIdentity
from ssmserve.server.state.store_layout import Keys

T = TypeVar("T")

EVENTS_KEPT = 1024  # per session: the newest rollbacks and guard events
RACE_ATTEMPTS = 4  # reads and tries again of a script that found the snapshots changed
SESSIONS_PER_CALL = 256  # sessions per call of a *_MANY script (one Redis server)

#: A session id as a client gives it: safe in key names (no braces, which would break the
#: hash tag) and URLs.
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: A stored id: the client's id, behind its tenant and '~' when it has one
#: (``api.tenancy``), so tenants' ids never meet.
STORED_ID_PATTERN = re.compile(
    r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,63}~)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
)


class BadSessionIdError(SsmserveError):
    """A session id that is not 1-128 letters, digits, '.', '_' or '-'."""


def check_session_id(session_id: str, stored: bool = False) -> str:
    """``session_id`` if it is a valid client id (``stored``: a valid stored id)."""
    if not (STORED_ID_PATTERN if stored else SESSION_ID_PATTERN).fullmatch(session_id):
        raise BadSessionIdError(
            f"session id {clip(session_id)} is invalid: use 1-128 letters, digits, '.', "
            f"'_' or '-', starting with a letter or digit"
        )
    return session_id


def _int(raw: dict[bytes, bytes], name: str, what: str, default: bytes | None = None) -> int:
    value = raw.get(name.encode(), default)
    if value is None or not value.isdigit():
        raise StoreDataError(f"{what}: field {name!r} holds {value!r:.40}, not a step number")
    return int(value)


def _float(raw: dict[bytes, bytes], name: str, what: str, default: bytes = b"0") -> float:
    try:
        return float(raw.get(name.encode(), default))
    except ValueError:
        raise StoreDataError(f"{what}: field {name!r} is not a number") from None


@dataclass(frozen=True)
class SessionMeta:
    session_id: str
    model: str
    fingerprint: str
    step: int  # durable step
    log_start: int  # first step with a logged input
    config: bytes  # SessionConfig.to_bytes()
    created_at: float
    updated_at: float
    closed: bool
    epoch: int = 0  # acquisitions within this incarnation (for people; fencing uses token)
    owner: str = ""  # worker id of the last acquirer ('' after a release)
    owner_addr: str = ""
    token: str = ""  # the current owner's fencing token (``state.lease``)
    numerics: str = ""  # the numerics signature its history was computed with

    def to_fields(self) -> list[Any]:
        fields: list[Any] = [
            "model", self.model, "fingerprint", self.fingerprint, "step", self.step,
            "log_start", self.log_start, "config", self.config, "created_at", self.created_at,
            "updated_at", self.updated_at, "closed", "1" if self.closed else "0",
            "incarnation", self.token.partition(".")[0], "epoch", self.epoch,
            "token", self.token, "owner", self.owner, "owner_addr", self.owner_addr,
            "numerics", self.numerics,
        ]  # fmt: skip
        return fields

    @classmethod
    def from_hash(cls, session_id: str, raw: dict[bytes, bytes]) -> SessionMeta:
        what = f"session {session_id!r}"
        try:
            return cls(
                session_id=session_id,
                model=raw[b"model"].decode(),
                fingerprint=raw[b"fingerprint"].decode(),
                step=_int(raw, "step", what),
                log_start=_int(raw, "log_start", what),
                config=raw[b"config"],
                created_at=_float(raw, "created_at", what),
                updated_at=_float(raw, "updated_at", what),
                closed=raw.get(b"closed", b"0") == b"1",
                epoch=_int(raw, "epoch", what, b"0"),
                owner=raw.get(b"owner", b"").decode(),
                owner_addr=raw.get(b"owner_addr", b"").decode(),
                token=raw.get(b"token", b"").decode(),
                numerics=raw.get(b"numerics", b"").decode(),
            )
        except (KeyError, UnicodeDecodeError) as exc:
            raise StoreDataError(f"{what}: its metadata is incomplete ({exc})") from None


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a session's lease right now (``holder`` may be ``handoff:<worker id>``)."""

    holder: str
    owner_addr: str
    ttl_ms: int

    def redirect(self, session_id: str) -> SessionMovedError:
        """The error that sends a caller to this lease's holder."""
        return SessionMovedError(
            f"session {session_id!r} is served by worker {self.owner_addr or '(unknown)'}",
            owner=self.owner_addr,
            retry_after_ms=self.ttl_ms,
        )


@dataclass(frozen=True)
class WorkerStats:
    """What a worker did, as of its last heartbeat (for ``ssmserve top``; Prometheus has
    the full picture). Counters run from the worker's start."""

    steps: int = 0  # steps applied
    snapshots: int = 0  # snapshots committed
    open_streams: int = 0
    step_p50_ms: float = 0.0  # over the most recent answered steps (``RecentLatency``)
    step_p99_ms: float = 0.0
    memory_held: int = 0  # bytes counted against the memory budget
    memory_budget: int = 0

    def to_fields(self) -> dict[str, str]:
        return {f"stat_{k}": repr(v) for k, v in self.__dict__.items()}

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> WorkerStats:
        values: dict[str, Any] = {}
        for name, kind in (("steps", int), ("snapshots", int), ("open_streams", int),
                           ("step_p50_ms", float), ("step_p99_ms", float),
                           ("memory_held", int), ("memory_budget", int)):  # fmt: skip
            with contextlib.suppress(KeyError, ValueError):  # older workers: defaults
                values[name] = kind(raw[f"stat_{name}".encode()])
        return cls(**values)


@dataclass(frozen=True)
class WorkerRecord:
    """One live worker as registered in Redis."""

    worker_id: str
    address: str
    models: tuple[str, ...]
    load: int  # resident sessions
    started_at: float
    heartbeat_at: float
    draining: bool
    numerics: str = ""  # what its engine's bits depend on (ssmserve.server.engine.numerics)
    stats: WorkerStats = WorkerStats()

    def to_fields(self) -> dict[str, str]:
        return self.stats.to_fields() | {
            "address": self.address,
            "models": ",".join(self.models),
            "load": str(self.load),
            "started_at": repr(self.started_at),
            "heartbeat_at": repr(self.heartbeat_at),
            "draining": "1" if self.draining else "0",
            "numerics": self.numerics,
        }

    @classmethod
    def from_hash(cls, worker_id: str, raw: dict[bytes, bytes]) -> WorkerRecord:
        models = raw.get(b"models", b"").decode()
        return cls(
            worker_id=worker_id,
            address=raw[b"address"].decode(),
            models=tuple(m for m in models.split(",") if m),
            load=int(raw.get(b"load", b"0")),
            started_at=float(raw.get(b"started_at", b"0")),
            heartbeat_at=float(raw.get(b"heartbeat_at", b"0")),
            draining=raw.get(b"draining", b"0") == b"1",
            numerics=raw.get(b"numerics", b"").decode(),
            stats=WorkerStats.from_hash(raw),
        )


@dataclass(frozen=True)
class SnapshotRecord:
    snapshot_id: str
    step: int
    label: str
    reason: str
    created_at: float
    size: int
    pieces: int

    @classmethod
    def from_hash(cls, snapshot_id: str, raw: dict[bytes, bytes]) -> SnapshotRecord:
        what = f"snapshot {snapshot_id!r}"
        return cls(
            snapshot_id=snapshot_id,
            step=_int(raw, "step", what),
            label=raw[b"label"].decode(),
            reason=raw[b"reason"].decode(),
            created_at=_float(raw, "created_at", what),
            size=_int(raw, "size", what),
            pieces=_int(raw, "pieces", what),
        )


@dataclass(frozen=True)
class SnapshotCommit:
    """One snapshot for :meth:`Store.commit_snapshots`: its owner's lease, its record, its
    bytes, and how many snapshots its session keeps (retention drops the oldest)."""

    lease: SessionLease
    record: SnapshotRecord
    blob: bytes
    max_snapshots: int


@dataclass(frozen=True)
class StoreSettings:
    url: str
    key_prefix: str = "ssm"
    piece_bytes: int = 4 << 20  # snapshot blobs are SET in pieces of at most this size
    stage_ttl_s: int = 600  # staged pieces of a commit that never came expire after this
    # Every store operation (its commands, a pipeline, a retry after a slot moved) gets
    # this long to answer; then its outcome is unknown (a write) or it failed (a read).
    # Small enough that a stalled Redis is noticed well within a lease TTL, large enough
    # for a 4 MiB piece on a busy loopback.
    socket_timeout_s: float = 2.0
    # After every write, wait until this many replicas have it (Redis WAIT) before it
    # counts as done; fewer in time makes its outcome unknown (the session reloads). 0:
    # asynchronous replication, so a master failover can lose acknowledged steps. None
    # (auto): 1 where every server holding sessions has a replica, else 0
    # (``Store.settle_replica_confirmation``, before the first write).
    wait_replicas: int | None = 0
    wait_timeout_ms: int = 1000  # the WAIT's own bound; below socket_timeout_s


@dataclass(frozen=True)
class ReplicaConfirmation:
    """How many replicas confirm each write, and what that was decided from."""

    replicas: int  # each write waits (WAIT) until this many replicas hold it
    auto: bool  # decided from the replicas found (``--redis-wait-replicas auto``)
    found: dict[str, int]  # replicas connected to each server holding sessions, at start
    unreadable: str = ""  # why they could not be counted ('' if they were)

    def describe(self) -> str:
        """What the worker runs with, and what it means for a client (logged at start)."""
        found = ", ".join(f"{name}: {n}" for name, n in sorted(self.found.items()))
        seen = f" (replicas found: {found})" if found else ""
        if self.replicas:
            return (
                f"every write waits until {self.replicas} replica(s) hold it (Redis WAIT){seen}: "
                f"a failover to a replica keeps every acknowledged step; while fewer "
                f"replicas answer, steps are answered UNAVAILABLE and retried"
                + (
                    " (--redis-wait-replicas 1 keeps serving with a replica down, and a "
                    "failover may then lose the steps only the others had)"
                    if self.auto and self.replicas > 1
                    else ""
                )
            )
        if self.unreadable:
            return (
                f"the replicas could not be counted ({clip(self.unreadable)}), so writes do "
                f"not wait for any: a failover can lose acknowledged steps; give "
                f"--redis-wait-replicas N (or allow the ROLE command)"
            )
        if not self.auto:
            return (
                f"writes wait for no replica (--redis-wait-replicas 0){seen}: a failover "
                f"can lose acknowledged steps"
            )
        if any(self.found.values()):
            bare = ", ".join(name for name, n in sorted(self.found.items()) if not n)
            return (
                f"writes wait for no replica: {bare} ha(s) none{seen}, and a write there "
                f"could never be confirmed; a failover can lose acknowledged steps until "
                f"every one has a replica (counted again with each heartbeat)"
            )
        return (
            "Redis has no replicas: a write counts once the server has it (a crash of the "
            "server loses what its appendfsync policy had not yet written to disk); "
            "replicas that connect later are counted with each heartbeat"
        )


class Store:
    """Async access to the session store. One per worker; safe to share between tasks.

    Why this class is long: it is the only code that talks to Redis, one short method per
    script or read, all sharing one connection pool, one deadline and one rule for
    unknown outcomes (``_call``); splitting it by concern would scatter that rule.
    Keys and scripts live in ``store_layout``, reply codes in ``store_errors``, how a
    batch of scripts is sent on each topology in ``script_batches``.
    """

    def __init__(self, settings: StoreSettings, metrics: Metrics | None = None) -> None:
        if not 1 << 20 <= settings.piece_bytes <= 4 << 20:
            raise ValueError("piece_bytes must be between 1 MiB and 4 MiB")
        self.settings = settings
        self.metrics = metrics or Metrics(enabled=False)
        self.topology = redis_topology.topology_of(settings.url)
        waits = settings.wait_replicas != 0  # a number, or auto
        if waits and settings.wait_timeout_ms >= settings.socket_timeout_s * 1000:
            raise ValueError("wait_timeout_ms must be below the command deadline")
        self.redis: Any = redis_topology.connect(settings.url, settings.socket_timeout_s)
        # Replicas each write waits for; auto (None) waits for none until settled.
        self.wait_replicas = settings.wait_replicas or 0
        self.batches = ScriptBatches(
            self.redis,
            self.wait_replicas,
            settings.wait_timeout_ms,
            settings.socket_timeout_s,
            self._retry,
        )
        self._index = f"{settings.key_prefix}:sessions"
        self._workers = f"{settings.key_prefix}:workers"
        self._create = self.redis.register_script(layout.CREATE)
        self._acquire = self.redis.register_script(layout.ACQUIRE)
        self._renew = self.redis.register_script(layout.RENEW)
        self._renew_many = self.redis.register_script(layout.RENEW_MANY)
        self._release = self.redis.register_script(layout.RELEASE)
        self._handoff = self.redis.register_script(layout.HANDOFF)
        self._cancel_handoff = self.redis.register_script(layout.CANCEL_HANDOFF)
        self._log_append = self.redis.register_script(layout.LOG_APPEND)
        self._log_append_many = self.redis.register_script(layout.LOG_APPEND_MANY)
        self._commit = self.redis.register_script(layout.COMMIT_SNAPSHOT)
        self._cut = self.redis.register_script(layout.ROLLBACK_CUT)
        self._close = self.redis.register_script(layout.CLOSE)
        self._record_events = self.redis.register_script(layout.RECORD_EVENTS)

    async def _call(self, op: str, call: Callable[[], Awaitable[T]], write: bool = False) -> T:
        """Run one Redis operation ``op`` (timed); connection trouble becomes
        StoreUnavailableError, or, for a write whose answer may have been lost,
        StoreOutcomeUnknownError."""
        started = time.perf_counter()
        try:
            if write:  # writes are traced (a no-op unless tracing is on)
                with self.metrics.tracing.span(f"redis.{op}"):
                    return await self._until_run(call, started)
            return await self._until_run(call, started)
        except (*NOT_RUN, redis_errors.RedisClusterException) as exc:
            # Not run (a slot moving past the deadline, or not served), or a bug such
            # as keys in two slots: nothing was applied either way.
            self.metrics.redis_errors.labels(op, "unavailable").inc()
            raise StoreUnavailableError(
                f"the session store (Redis Cluster) did not run the command: {clip(str(exc))}"
            ) from None
        except (
            redis_errors.ConnectionError,
            redis_errors.TimeoutError,
            OSError,
            # redis-py's cluster client closes every connection when it reloads the slot
            # map, also one that another task is about to write on: that write then finds
            # no socket ("'NoneType' object has no attribute 'writelines'", seen while
            # slots moved under live streams). Whether the command went out is unknown.
            AttributeError,
        ) as exc:
            if write:
                self.metrics.redis_errors.labels(op, "outcome_unknown").inc()
                raise StoreOutcomeUnknownError(
                    f"the session store (Redis) did not answer a write, which may or may not "
                    f"have been applied: {exc}"
                ) from None
            self.metrics.redis_errors.labels(op, "unavailable").inc()
            raise StoreUnavailableError(
                f"the session store (Redis) is unavailable: {exc}"
            ) from None
        except redis_errors.RedisError as exc:
            unknown = unknown_outcome_of(exc)  # OOM, READONLY: only writes are refused so
            if unknown is not None:
                self.metrics.redis_errors.labels(op, "outcome_unknown").inc()
                raise unknown from None
            self.metrics.redis_errors.labels(op, "error").inc()
            raise StoreError(f"the session store (Redis) failed: {exc}") from None
        finally:
            self.metrics.redis_seconds.labels(op).observe(time.perf_counter() - started)

    async def _until_run(self, call: Callable[[], Awaitable[T]], started: float) -> T:
        """``call()`` under the command deadline, sent again while a cluster says it did
        not run. On one server and behind Sentinel the deadline is this ``asyncio.timeout``
        (their clients have no socket timeout: ``redis_topology``); a cluster client keeps
        its socket timeouts and its own recovery from them, uninterrupted by ours."""
        deadline_s = self.settings.socket_timeout_s
        if redis_topology.keeps_socket_timeout(self.topology):
            return await until_run(call, started, deadline_s, self._retry)
        deadline = asyncio.timeout(deadline_s)
        try:
            async with deadline:
                return await until_run(call, started, deadline_s, self._retry)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise redis_errors.TimeoutError(f"no answer within {deadline_s:g} s") from None

    def _retry(self) -> None:
        self.metrics.redis_errors.labels("redirect", "retried").inc()

    async def _script(
        self, op: str, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
    ) -> Any:
        """Run one write script (waiting for replicas when the settings say so)."""
        if not self.wait_replicas:
            return await self._call(op, lambda: script(keys=keys, args=args), write=True)
        return (await self._scripts(op, script, [(keys, args)]))[0]

    async def _scripts(
        self, op: str, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]
    ) -> list[Any]:
        """Run one write script many times in one round trip (per Redis node); one reply
        per call, errors as exceptions in the list. A lost answer raises
        StoreOutcomeUnknownError for all of them."""
        if not calls:
            return []
        return await self._call(op, lambda: self.batches.run(script, calls), True)

    async def _many(
        self,
        op: str,
        script: AsyncScript,
        shared: Sequence[Any],
        per_session: Sequence[tuple[Sequence[str], Sequence[Any]]],
        what: str,
    ) -> list[SsmserveError | None]:
        """A *_MANY script (one Redis server only) for many sessions: one call per
        SESSIONS_PER_CALL of them, in one round trip, with KEYS the sessions' keys and ARGV
        ``shared`` then the sessions' arguments, in order. One outcome per session.

        A call that failed as a whole (a script stopped part way keeps what it wrote)
        gives each of its sessions StoreOutcomeUnknownError: each may or may not be
        written. Why these scripts: redis-py's Python per command was most of the cost of
        a batched write (~20 us per session as one EVALSHA each).
        """
        chunks = [
            per_session[i : i + SESSIONS_PER_CALL]
            for i in range(0, len(per_session), SESSIONS_PER_CALL)
        ]
        calls = []
        for chunk in chunks:
            keys: list[str] = []
            args: list[Any] = list(shared)
            for session_keys, session_args in chunk:
                keys += session_keys
                args += session_args
            calls.append((keys, args))
        replies = await self._scripts(op, script, calls)
        outcomes: list[SsmserveError | None] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, list) and len(reply) == len(chunk):
                outcomes += (self._outcome(r) for r in reply)
                continue
            self.metrics.redis_errors.labels(op, "outcome_unknown").inc()
            unknown = unknown_outcome_of(reply) if isinstance(reply, Exception) else None
            error = unknown or StoreOutcomeUnknownError(
                f"the session store (Redis) refused a batched {what}, which may have been "
                f"applied in part: {clip(str(reply))}"
            )
            outcomes += [error] * len(chunk)
        return outcomes

    def _check(self, raw: Any) -> list[str]:
        """``check_reply``, counting refusals by fencing."""
        try:
            return check_reply(raw)
        except StaleEpochError:
            self.metrics.fenced_writes.inc()
            raise

    def _outcome(self, raw: Any) -> SsmserveError | None:
        """``reply_outcome`` of a fenced write, counting refusals by fencing."""
        outcome = reply_outcome(raw)
        if isinstance(outcome, StaleEpochError):
            self.metrics.fenced_writes.inc()
        elif type(outcome) is SessionMissingError:
            return _vanished(outcome)
        return outcome

    def _fenced(self, raw: Any) -> list[str]:
        """``_check`` of a fenced write's reply: a session found missing vanished while
        the writer held it (``SessionVanishedError``)."""
        try:
            return self._check(raw)
        except SessionVanishedError:
            raise
        except SessionMissingError as exc:
            raise _vanished(exc) from None

    def keys(self, session_id: str) -> Keys:
        return Keys(self.settings.key_prefix, check_session_id(session_id, stored=True))

    async def ping(self) -> None:
        await self._call("ping", self.redis.ping)

    async def aclose(self) -> None:
        await self.batches.aclose()
        await self.redis.aclose()

    # ------------------------------------------------------------------ the store itself

    async def replica_counts(self) -> dict[str, int]:
        """Replicas connected to each server that holds sessions (``ROLE``): the one
        server, the master behind Sentinel, or every master of a cluster."""
        if isinstance(self.redis, RedisCluster):
            targets = [(n.name, {"target_nodes": n}) for n in self.redis.get_primaries()]
        else:
            targets = [("redis", {})]

        async def read() -> dict[str, int]:
            counts = {}
            for name, where in targets:
                role = await self.redis.execute_command("ROLE", **where)
                counts[name] = len(role[2]) if role and role[0] in (b"master", "master") else 0
            return counts

        return await self._call("replica_counts", read)

    async def follow_replicas(self) -> int | None:
        """With ``wait_replicas`` auto: count the replicas again and, if every server that
        holds sessions now has more than writes wait for, wait for that many from now on.
        Never fewer: a replica that is down must not quietly lower what an acknowledged
        step survives (writes then wait, and fail, until it is back). Returns the new
        count when it rose, else None. A worker that started while a replica was away
        (restarting, or not yet rejoined after a failover) so gets its guarantee back."""
        if self.settings.wait_replicas is not None:
            return None
        counts = await self.replica_counts()
        wanted = min(counts.values()) if counts else 0
        if wanted <= self.wait_replicas:
            return None
        self.wait_replicas = self.batches.wait_replicas = wanted
        return wanted

    async def settle_replica_confirmation(self) -> ReplicaConfirmation:
        """Decide, before the first write, how many replicas confirm each write: the
        setting when it names a number; auto (None): every replica the servers holding
        sessions have now (the fewest any of them has), else 0.

        Why every replica, not one: Sentinel promotes one replica and only then points the
        others at it, while the old master still takes writes. A write the old master made
        in between, confirmed by a replica that is about to be re-pointed, is thrown away
        when that replica resyncs from the new master: with two replicas and WAIT 1, a
        failover lost acknowledged steps in every run beside two CPU hogs
        (``tests/test_replicated_redis.py``). A write every replica confirmed is on the
        promoted one, whichever it is."""
        wanted = self.settings.wait_replicas
        counts: dict[str, int] = {}
        unreadable = ""
        try:
            counts = await self.replica_counts()
        except StoreUnavailableError:
            raise
        except StoreError as exc:  # ROLE refused (an ACL user without +role)
            unreadable = str(exc)
        if wanted is None:
            wanted = min(counts.values()) if counts else 0
        self.wait_replicas = self.batches.wait_replicas = wanted
        return ReplicaConfirmation(wanted, self.settings.wait_replicas is None, counts, unreadable)

    async def store_identity(self) -> StoreIdentity | None:
        """The store's identity (``store_facts``); None when it has none (new, or wiped)."""
        key = layout.store_identity_key(self.settings.key_prefix)
        raw = await self._call("store_identity", lambda: self.redis.get(key))
        return None if raw is None else StoreIdentity.from_value(raw)

    async def claim_store_identity(self, candidate: StoreIdentity) -> StoreIdentity:
        """Give the store ``candidate`` as its identity unless it has one (SET NX); the
        identity it has now. Sent again after a lost answer, it finds whichever won."""
        key = layout.store_identity_key(self.settings.key_prefix)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(key, candidate.to_value(), nx=True)
                pipe.get(key)
                return await pipe.execute()

        for _ in range(3):  # deleted between the two commands (a wipe): ask again
            _, raw = await self._call("store_identity", run, write=True)
            if raw is not None:
                return StoreIdentity.from_value(raw)
        raise StoreUnavailableError(
            "the store's identity was gone as soon as it was written, three times: "
            "something keeps wiping the store"
        )

    async def eviction_policies(self) -> EvictionPolicies:
        """``maxmemory-policy`` of every server that holds sessions: the one server, the
        master behind Sentinel, or every master of a cluster. Read with CONFIG GET or,
        where CONFIG is refused (managed Redis disables it; an ACL user may lack it), from
        INFO memory; ``unreadable`` says why when both are refused."""
        if isinstance(self.redis, RedisCluster):
            targets = [(n.name, {"target_nodes": n}) for n in self.redis.get_primaries()]
        elif self.topology == "sentinel":
            targets = [("the Sentinel master", {})]
        else:
            at = self.redis.connection_pool.connection_kwargs
            targets = [(at.get("path") or f"{at.get('host')}:{at.get('port')}", {})]

        async def read() -> EvictionPolicies:
            by_server: dict[str, str] = {}
            refused: list[str] = []
            for name, where in targets:
                try:
                    by_server[name] = await self._eviction_policy(where)
                except redis_errors.ResponseError as exc:  # refused, not unavailable
                    refused.append(f"{name}: {str(exc)[:300]}")
            return EvictionPolicies(by_server, "; ".join(refused))

        return await self._call("eviction_policy", read)

    async def _eviction_policy(self, where: dict[str, Any]) -> str:
        try:
            got = await self.redis.config_get("maxmemory-policy", **where)
            value = got.get(b"maxmemory-policy", got.get("maxmemory-policy"))
        except redis_errors.ResponseError as config_refused:
            try:
                value = (await self.redis.info("memory", **where)).get("maxmemory_policy")
            except redis_errors.ResponseError as info_refused:
                raise redis_errors.ResponseError(
                    f"CONFIG GET: {config_refused}; INFO: {info_refused}"
                ) from None
        if value is None:
            raise redis_errors.ResponseError("neither CONFIG GET nor INFO names the policy")
        return value.decode() if isinstance(value, bytes) else str(value)

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

    # ------------------------------------------------------------------ declared keys

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

    # ------------------------------------------------------------------ ownership

    async def acquire(
        self,
        session_id: str,
        worker_id: str,
        address: str,
        lease_ms: int,
        expect: str = "",
        numerics: str = "",
        proof: str = "",
    ) -> str:
        """Take the session's lease; returns the new fencing token.

        ``expect``: only if the session's token is still this one (nobody acquired it
        since). ``numerics``: recorded for a session stored without a signature.
        ``proof``: the beat this worker saw at least a lease TTL ago, needed to take over a
        lease that ran out while its owner never let go (``cluster.takeover``). Raises
        :class:`LeaseHeldError` (the owner's address, how long its lease still runs in
        Redis, the beat now) when another worker holds it or may still trust it.
        """
        k = self.keys(session_id)
        args = [worker_id, address, lease_ms, expect, new_incarnation(), numerics, new_nonce(),
                proof]  # fmt: skip
        raw = await self._script("acquire", self._acquire, [k.meta, k.lease], args)
        reply = reply_fields(raw)
        if reply[0] == "ERR_OWNED":
            owner, ttl, beat, owner_lease_ms = reply[2], reply[3], reply[4], reply[5]
            raise LeaseHeldError(
                f"session {session_id!r} is served by worker {owner or '(unknown)'}"
                + ("" if ttl.isdigit() and int(ttl) > 0 else f" ({reply[1]})"),
                owner=owner,
                retry_after_ms=max(0, int(ttl) if ttl.isdigit() else 0),
                beat=beat,
                owner_lease_ms=int(owner_lease_ms) if owner_lease_ms.isdigit() else 0,
            )
        self._check(raw)
        return reply[1]

    async def renew_leases(
        self, leases: Sequence[SessionLease], lease_ms: int
    ) -> list[SsmserveError | None]:
        """Extend live leases in one round trip; one entry per lease: None when renewed
        (or being handed off), else the error (:class:`StaleEpochError` when the session
        is someone else's, :class:`LeaseExpiredError` when the lease ran out)."""
        if not leases:
            return []

        if isinstance(self.redis, RedisCluster):  # one script per session: one slot each
            calls = []
            nonce = new_nonce()
            for lease in leases:
                k = self.keys(lease.session_id)
                calls.append(([k.meta, k.lease], [lease.holder, lease.token, lease_ms, nonce]))
            replies = await self._scripts("renew_leases", self._renew, calls)
            return [self._outcome(r) for r in replies]
        # One server: RENEW_MANY. Per session: holder, token.
        per_session = []
        for lease in leases:
            k = self.keys(lease.session_id)
            per_session.append(((k.meta, k.lease), (lease.holder, lease.token)))
        return await self._many(
            "renew_leases", self._renew_many, [lease_ms, new_nonce()], per_session, "renewal"
        )

    async def release(self, lease: SessionLease) -> None:
        k = self.keys(lease.session_id)
        reply = await self._script(
            "release", self._release, [k.meta, k.lease], [lease.holder, lease.token]
        )
        self._fenced(reply)

    async def handoff(self, lease: SessionLease, target: WorkerRecord, lease_ms: int) -> None:
        """Reserve the session for ``target``: only it may acquire it next."""
        k = self.keys(lease.session_id)
        args = [lease.holder, lease.token, target.worker_id, target.address, lease_ms]
        reply = await self._script("handoff", self._handoff, [k.meta, k.lease], args)
        self._fenced(reply)

    async def cancel_handoff(
        self, lease: SessionLease, address: str, target_id: str, lease_ms: int
    ) -> None:
        """Take back a reservation the target never used; raises StaleEpochError if it did."""
        k = self.keys(lease.session_id)
        args = [lease.holder, lease.token, address, lease_ms, target_id, new_nonce()]
        reply = await self._script("cancel_handoff", self._cancel_handoff, [k.meta, k.lease], args)
        self._fenced(reply)

    async def lease_holder(self, session_id: str) -> LeaseHolder | None:
        """The session's current lease holder, or None when nobody holds it."""
        k = self.keys(session_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(k.lease)
                pipe.pttl(k.lease)
                pipe.hget(k.meta, "owner_addr")
                return await pipe.execute()

        holder, ttl, addr = await self._call("lease_holder", run)
        if holder is None:
            return None
        return LeaseHolder(holder.decode(), (addr or b"").decode(), max(0, int(ttl)))

    # ------------------------------------------------------------------ worker registry

    async def register_worker(self, record: WorkerRecord, ttl_ms: int) -> None:
        """Write (or refresh) a worker's entry; it disappears ``ttl_ms`` after the last one."""
        key = f"{self.settings.key_prefix}:worker:{record.worker_id}"

        async def run() -> None:
            # The entry and its expiry at once (one key, so one slot even on a cluster);
            # the set of ids is another slot, and readers forget ids whose entry is gone.
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=record.to_fields())
                pipe.pexpire(key, ttl_ms)
                await pipe.execute()
            await self.redis.sadd(self._workers, record.worker_id)

        await self._call("register_worker", run)

    async def deregister_worker(self, worker_id: str) -> None:
        async def run() -> None:  # two slots on a cluster: two commands
            await self.redis.delete(f"{self.settings.key_prefix}:worker:{worker_id}")
            await self.redis.srem(self._workers, worker_id)

        await self._call("deregister_worker", run)

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
                    pipe.hgetall(f"{self.settings.key_prefix}:worker:{worker_id}")
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

    # ------------------------------------------------------------------ snapshots

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
        records = await self._records(session_id, [snapshot_id])
        return records[0] if records else None

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
        if any(p is None for p in pieces):
            raise StoreError(f"snapshot {record.snapshot_id} of {session_id!r} has lost pieces")
        blob = b"".join(pieces)
        if len(blob) != record.size:
            raise StoreError(
                f"snapshot {record.snapshot_id} is {len(blob)} bytes, index says {record.size}"
            )
        return blob

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

    # ------------------------------------------------------------------ import staging

    async def stage_upload_piece(self, upload_id: str, piece: bytes | memoryview) -> int:
        """Append a piece of an imported checkpoint to its staging list, which expires
        ``stage_ttl_s`` after its newest piece; the list's length after it."""
        key = layout.upload_key(self.settings.key_prefix, upload_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, piece)
                pipe.pexpire(key, self.settings.stage_ttl_s * 1000)
                return await pipe.execute()

        # The list is private to one import (its id is new): a lost answer shows as a
        # wrong length at the next piece or at read-back, never as a wrong checkpoint.
        return int((await self._call("stage_upload_piece", run))[0])

    async def read_upload(self, upload_id: str, pieces: int, size: int) -> memoryview:
        """The staged checkpoint, whole: ``size`` bytes from ``pieces`` pieces (read
        a few at a time into one buffer, so it is held once)."""
        key = layout.upload_key(self.settings.key_prefix, upload_id)
        buffer, offset = bytearray(size), 0
        for start in range(0, pieces, 8):
            stop = min(start + 8, pieces) - 1
            got = await self._call(
                "read_upload", lambda s=start, e=stop: self.redis.lrange(key, s, e)
            )
            if len(got) != stop - start + 1:
                raise StagedPiecesMissingError(
                    f"the staged import lost pieces ({start + len(got)} of {pieces} left): it "
                    f"took longer than {self.settings.stage_ttl_s} s between two chunks"
                )
            for piece in got:
                if offset + len(piece) > size:
                    raise StagedPiecesMissingError(f"the staged import holds over {size} bytes")
                buffer[offset : offset + len(piece)] = piece
                offset += len(piece)
        if offset != size:
            raise StagedPiecesMissingError(f"the staged import holds {offset} bytes, not {size}")
        return memoryview(buffer).toreadonly()

    async def drop_upload(self, upload_id: str) -> None:
        key = layout.upload_key(self.settings.key_prefix, upload_id)
        await self._call("drop_upload", lambda: self.redis.unlink(key))

    async def snapshot_count_and_oldest(self, session_id: str) -> tuple[int, int | None]:
        k = self.keys(session_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zcard(k.snaps)
                pipe.zrange(k.snaps, 0, 0, withscores=True)
                return await pipe.execute()

        count, head = await self._call("snapshot_count_and_oldest", run)
        return int(count), (int(head[0][1]) if head else None)

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


def _vanished(error: SessionMissingError) -> SessionVanishedError:
    return SessionVanishedError(
        f"{error} while this worker held it (closed by a later owner, or the store was "
        f"wiped: the worker checks which); retry"
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
