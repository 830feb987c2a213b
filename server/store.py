"""Redis I/O for sessions: every key name and every Lua script lives in this module.

Key layout (``P`` is the key prefix, ``ssm`` by default; ``{sid}`` is a Redis Cluster hash
tag, so all keys of one session sit in one slot and one script may touch them together)::

    P:sessions                   ZSET   every session id, score 0 (paged with ZRANGEBYLEX)
    P:workers                    SET    ids of registered workers (some may have expired)
    P:worker:<id>                HASH   address, models, load, started_at, draining (PX ttl)
    P:{sid}:meta                 HASH   model, fingerprint, step, log_start, config, times,
                                        epoch, owner (worker id), owner_addr
    P:{sid}:lease                STRING the owning worker's id, or 'handoff:<id>' (PX ttl)
    P:{sid}:log                  HASH   step -> raw input bytes (float32 or int64, LE)
    P:{sid}:snaps                ZSET   snapshot id, scored by its step
    P:{sid}:snap:<id>            HASH   step, label, reason, created_at, size, pieces
    P:{sid}:blob:<id>:<i>        STRING piece i of a committed snapshot's checkpoint bytes
    P:{sid}:stage:<id>:<i>       STRING a piece written but not committed yet (expires)
    P:{sid}:labels               HASH   label -> snapshot id

Writing a snapshot is two phases (DESIGN.md, "Redis over loopback"): plain ``SET``s put the
blob into staging keys in pieces of at most ``piece_bytes``; a small script then renames
the pieces into place and updates the index. Big payloads never pass through Lua, where
they would block Redis for the whole copy. The writer picks the snapshot id before the
first attempt, so a retried commit finds its id already committed and does nothing; every
other write here is also safe to repeat, because redis-py retries failed commands.

**Ownership and fencing.** A session has at most one owner: the worker whose id is in its
``lease`` key, which expires unless renewed. Each acquisition increments ``meta.epoch``
and hands the new epoch to the owner; every write script (log append, snapshot commit,
rollback cut, close, lease renewal) carries the writer's epoch and refuses to change
anything when it is not the current one (``ERR_STALE``). A worker that paused past its
lease and came back can therefore not write over the history of the worker that took the
session over. A migrating owner sets the lease to ``handoff:<target id>``, which only the
target may acquire.

``meta.step`` is the durable step: the step a session comes back at after its worker is
gone. Logged inputs cover ``log_start .. step``; ``log_start - 1`` is the step of the
oldest kept snapshot, so any step in ``[log_start - 1, step]`` can be rebuilt exactly.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from server.errors import ErrorKind, SessionMovedError, SsmserveError

T = TypeVar("T")

#: session ids: safe in key names (no braces, which would break the hash tag) and URLs.
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class StoreError(SsmserveError):
    """Redis said no in a way that is not the caller's fault."""

    kind = ErrorKind.UNAVAILABLE


class StoreUnavailableError(StoreError):
    """Redis cannot be reached (or timed out); the request may be retried."""


class SessionMissingError(SsmserveError):
    kind = ErrorKind.NOT_FOUND


class SessionExistsError(SsmserveError):
    kind = ErrorKind.ALREADY_EXISTS


class SessionClosedError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


class LabelTakenError(SsmserveError):
    kind = ErrorKind.ALREADY_EXISTS


class StaleEpochError(SessionMovedError):
    """A write carried an epoch that is no longer the session's: another worker owns it now.

    For the client this is a redirect like any other (``owner`` says where to go).
    """


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
    epoch: int = 0  # bumped by every acquisition (fencing)
    owner: str = ""  # worker id of the last acquirer ('' after a release)
    owner_addr: str = ""

    @classmethod
    def from_hash(cls, session_id: str, raw: dict[bytes, bytes]) -> SessionMeta:
        return cls(
            session_id=session_id,
            model=raw[b"model"].decode(),
            fingerprint=raw[b"fingerprint"].decode(),
            step=int(raw[b"step"]),
            log_start=int(raw[b"log_start"]),
            config=raw[b"config"],
            created_at=float(raw[b"created_at"]),
            updated_at=float(raw[b"updated_at"]),
            closed=raw.get(b"closed", b"0") == b"1",
            epoch=int(raw.get(b"epoch", b"0")),
            owner=raw.get(b"owner", b"").decode(),
            owner_addr=raw.get(b"owner_addr", b"").decode(),
        )


@dataclass(frozen=True)
class Lease:
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
class WorkerRecord:
    """One live worker as registered in Redis."""

    worker_id: str
    address: str
    models: tuple[str, ...]
    load: int  # resident sessions
    started_at: float
    heartbeat_at: float
    draining: bool

    def to_fields(self) -> dict[str, str]:
        return {
            "address": self.address,
            "models": ",".join(self.models),
            "load": str(self.load),
            "started_at": repr(self.started_at),
            "heartbeat_at": repr(self.heartbeat_at),
            "draining": "1" if self.draining else "0",
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
        return cls(
            snapshot_id=snapshot_id,
            step=int(raw[b"step"]),
            label=raw[b"label"].decode(),
            reason=raw[b"reason"].decode(),
            created_at=float(raw[b"created_at"]),
            size=int(raw[b"size"]),
            pieces=int(raw[b"pieces"]),
        )


@dataclass(frozen=True)
class Keys:
    """Key names of one session."""

    prefix: str
    session_id: str

    def _k(self, suffix: str) -> str:
        return f"{self.prefix}:{{{self.session_id}}}:{suffix}"

    @property
    def meta(self) -> str:
        return self._k("meta")

    @property
    def log(self) -> str:
        return self._k("log")

    @property
    def snaps(self) -> str:
        return self._k("snaps")

    @property
    def labels(self) -> str:
        return self._k("labels")

    @property
    def lease(self) -> str:
        return self._k("lease")

    @property
    def base(self) -> str:
        """The common head of the keys scripts build themselves (snap, blob, stage)."""
        return self._k("")

    def snap(self, snapshot_id: str) -> str:
        return self._k(f"snap:{snapshot_id}")

    def blob(self, snapshot_id: str, piece: int) -> str:
        return self._k(f"blob:{snapshot_id}:{piece}")

    def stage(self, snapshot_id: str, piece: int) -> str:
        return self._k(f"stage:{snapshot_id}:{piece}")


# ---------------------------------------------------------------------------- scripts
# Each script touches only keys of one session (one hash tag). Keys derived inside a
# script (snap:<id>, blob:<id>:<i>) share that tag, so they live in the same slot.
# Errors are returned as "ERR_<KIND> message" strings so Python can type them.

# A helper shared by the scripts that drop snapshots: delete one snapshot and its label.
_DROP_SNAPSHOT = """
local function drop_snapshot(base, snaps, labels, id)
    local snap = base .. 'snap:' .. id
    local pieces = tonumber(redis.call('HGET', snap, 'pieces') or '0')
    local label = redis.call('HGET', snap, 'label')
    for i = 0, pieces - 1 do
        redis.call('UNLINK', base .. 'blob:' .. id .. ':' .. i)
    end
    if label and label ~= '' and redis.call('HGET', labels, label) == id then
        redis.call('HDEL', labels, label)
    end
    redis.call('DEL', snap)
    redis.call('ZREM', snaps, id)
end
"""

# The epoch check every write script starts with: refuse a writer whose epoch is not the
# session's current one (another worker acquired the session since).
_FENCE = """
local function fence(meta, epoch)
    local current = redis.call('HGET', meta, 'epoch')
    if not current then
        return 'ERR_MISSING session is gone from the store'
    end
    if current ~= epoch then
        local owner = redis.call('HGET', meta, 'owner_addr') or ''
        return 'ERR_STALE ' .. (owner ~= '' and owner or '-') .. ' epoch ' .. epoch
            .. ' is stale: the session was taken over (epoch ' .. current .. ')'
    end
    return nil
end
"""

# KEYS: meta, index, lease. ARGV: session id, worker id, lease ttl ms, then field/value pairs
# of the meta hash (epoch 1, owner, owner_addr among them). The creator owns the session.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
    return 'ERR_EXISTS'
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
return 'OK'
"""

# KEYS: meta, lease. ARGV: worker id, worker address, lease ttl ms.
# Free (no lease), or reserved for this worker by a handoff: take it with the next epoch.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
    return 'ERR_MISSING session does not exist'
end
if redis.call('HGET', KEYS[1], 'closed') == '1' then
    return 'ERR_CLOSED session is closed; its final snapshot can still be exported'
end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] and holder ~= 'handoff:' .. ARGV[1] then
    return 'ERR_OWNED ' .. redis.call('PTTL', KEYS[2]) .. ' '
        .. (redis.call('HGET', KEYS[1], 'owner_addr') or '')
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_addr', ARGV[2])
return 'OK ' .. epoch
"""

# KEYS: meta, lease. ARGV: worker id, epoch, lease ttl ms.
# Still ours: extend (or re-set, if it expired and nobody took the session meanwhile).
_RENEW = (
    _FENCE
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then
    return 'HANDOFF'  -- being handed to another worker by this one: leave it alone
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
return 'OK'
"""
)

# KEYS: meta, lease. ARGV: worker id, epoch. The owner lets go (eviction, shutdown).
_RELEASE = (
    _FENCE
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
if redis.call('GET', KEYS[2]) == ARGV[1] then
    redis.call('DEL', KEYS[2])
end
redis.call('HSET', KEYS[1], 'owner', '', 'owner_addr', '')
return 'OK'
"""
)

# KEYS: meta, lease. ARGV: worker id, epoch, target id, target address, ttl ms.
# The owner reserves the session for one target worker, which acquires it next.
_HANDOFF = (
    _FENCE
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
redis.call('SET', KEYS[2], 'handoff:' .. ARGV[3], 'PX', ARGV[5])
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'owner_addr', ARGV[4])
return 'OK'
"""
)

# KEYS: meta, lease. ARGV: worker id, epoch, worker address, ttl ms, target id.
# The target did not take the session: the owner keeps it (same epoch).
_CANCEL_HANDOFF = (
    _FENCE
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= 'handoff:' .. ARGV[5] and holder ~= ARGV[1] then
    return 'ERR_STALE - the session is held by ' .. holder
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_addr', ARGV[3])
return 'OK'
"""
)

# KEYS: meta, log. ARGV: epoch, first step, updated_at, then one input per step.
# Safe to repeat: the same step gets the same bytes again.
_LOG_APPEND = (
    _FENCE
    + """
local err = fence(KEYS[1], ARGV[1])
if err then return err end
if redis.call('HGET', KEYS[1], 'closed') == '1' then
    return 'ERR_CLOSED session is closed'
end
local first = tonumber(ARGV[2])
local durable = tonumber(redis.call('HGET', KEYS[1], 'step'))
if first > durable + 1 then
    return 'ERR_GAP log append at step ' .. first .. ' but the log ends at ' .. durable
end
local last = first + #ARGV - 4
for i = 4, #ARGV do
    redis.call('HSET', KEYS[2], tostring(first + i - 4), ARGV[i])
end
redis.call('HSET', KEYS[1], 'step', last, 'updated_at', ARGV[3])
return 'OK'
"""
)

# KEYS: meta, snaps, labels, log. ARGV: base, id, step, pieces, label, reason,
# created_at, size, max_snapshots, epoch.
# Renames the staged pieces into place, indexes the snapshot, then applies retention:
# at most max_snapshots are kept, and log entries at or before the oldest kept one go.
_COMMIT_SNAPSHOT = (
    _DROP_SNAPSHOT
    + _FENCE
    + """
local base, id = ARGV[1], ARGV[2]
local step, pieces, label = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local err = fence(KEYS[1], ARGV[10])
if err then return err end
if redis.call('ZSCORE', KEYS[2], id) then
    for i = 0, pieces - 1 do  -- a retried commit: already done; drop the re-staged copy
        redis.call('DEL', base .. 'stage:' .. id .. ':' .. i)
    end
    return 'OK'
end
if label ~= '' and redis.call('HEXISTS', KEYS[3], label) == 1 then
    return 'ERR_LABEL label ' .. label .. ' already names a snapshot'
end
for i = 0, pieces - 1 do
    if redis.call('EXISTS', base .. 'stage:' .. id .. ':' .. i) == 0 then
        return 'ERR_STAGE staged piece ' .. i .. ' of snapshot ' .. id .. ' is missing'
    end
end
for i = 0, pieces - 1 do
    local blob = base .. 'blob:' .. id .. ':' .. i
    redis.call('RENAME', base .. 'stage:' .. id .. ':' .. i, blob)
    redis.call('PERSIST', blob)
end
redis.call('HSET', base .. 'snap:' .. id, 'step', step, 'label', label, 'reason', ARGV[6],
    'created_at', ARGV[7], 'size', ARGV[8], 'pieces', pieces)
redis.call('ZADD', KEYS[2], step, id)
if label ~= '' then
    redis.call('HSET', KEYS[3], label, id)
end
local keep = tonumber(ARGV[9])
while redis.call('ZCARD', KEYS[2]) > keep do
    -- the oldest by step (ids order snapshots of one step by time); never the new one
    local two = redis.call('ZRANGE', KEYS[2], 0, 1)
    drop_snapshot(base, KEYS[2], KEYS[3], two[1] == id and two[2] or two[1])
end
local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
local new_start = tonumber(head[2]) + 1
local log_start = tonumber(redis.call('HGET', KEYS[1], 'log_start'))
if new_start > log_start then
    for s = log_start, new_start - 1 do
        redis.call('HDEL', KEYS[4], tostring(s))
    end
    redis.call('HSET', KEYS[1], 'log_start', new_start)
end
return 'OK'
"""
)

# KEYS: meta, snaps, labels, log. ARGV: base, step t, current in-memory step, updated_at,
# epoch. History after t is cut: snapshots past t and logged inputs past t are deleted.
_ROLLBACK_CUT = (
    _DROP_SNAPSHOT
    + _FENCE
    + """
local base, t, upto = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local err = fence(KEYS[1], ARGV[5])
if err then return err end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. t, '+inf')) do
    drop_snapshot(base, KEYS[2], KEYS[3], id)
end
local durable = tonumber(redis.call('HGET', KEYS[1], 'step'))
for s = t + 1, math.max(durable, upto) do
    redis.call('HDEL', KEYS[4], tostring(s))
end
if durable > t then
    redis.call('HSET', KEYS[1], 'step', t)
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[4])
return 'OK'
"""
)

# KEYS: meta, snaps, labels, log, index, lease. ARGV: base, session id, keep (a snapshot id
# or ''), epoch. Without keep: every key of the session goes. With keep: the session is
# marked closed and only that snapshot stays (so it can still be exported).
_CLOSE = (
    _DROP_SNAPSHOT
    + _FENCE
    + """
local base, keep = ARGV[1], ARGV[3]
local err = fence(KEYS[1], ARGV[4])
if err then return err end
redis.call('DEL', KEYS[6])
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if id ~= keep then
        drop_snapshot(base, KEYS[2], KEYS[3], id)
    end
end
redis.call('DEL', KEYS[4])
if keep == '' then
    redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
    redis.call('ZREM', KEYS[5], ARGV[2])
else
    redis.call('HSET', KEYS[1], 'closed', '1', 'owner', '', 'owner_addr', '')
end
return 'OK'
"""
)


def _raise_script_error(reply: Any) -> None:
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    if text == "OK":
        return
    code, _, message = text.partition(" ")
    if code == "ERR_STALE":
        owner, _, message = message.partition(" ")
        owner = "" if owner == "-" else owner
        raise StaleEpochError(f"{message} by {owner or 'no live worker'}", owner=owner)
    error: type[SsmserveError] = {
        "ERR_EXISTS": SessionExistsError,
        "ERR_MISSING": SessionMissingError,
        "ERR_CLOSED": SessionClosedError,
        "ERR_LABEL": LabelTakenError,
    }.get(code, StoreError)
    raise error(message or text)


def _script_outcome(reply: Any, ok: tuple[bytes, ...] = (b"OK",)) -> SsmserveError | None:
    """A pipelined script reply as None (success) or the typed error it stands for."""
    if isinstance(reply, Exception):
        return StoreError(f"the session store (Redis) failed: {reply}")
    if reply in ok:
        return None
    try:
        _raise_script_error(reply)
    except SsmserveError as exc:
        return exc
    return StoreError(f"unexpected reply from the session store: {reply!r}")


async def _guarded(call: Callable[[], Awaitable[T]]) -> T:
    """Run one Redis call; connection trouble becomes StoreUnavailableError."""
    try:
        return await call()
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        raise StoreUnavailableError(f"the session store (Redis) is unavailable: {exc}") from None
    except redis_errors.RedisError as exc:
        raise StoreError(f"the session store (Redis) failed: {exc}") from None


@dataclass(frozen=True)
class StoreSettings:
    url: str
    key_prefix: str = "ssm"
    piece_bytes: int = 4 << 20  # snapshot blobs are SET in pieces of at most this size
    stage_ttl_s: int = 600  # staged pieces of a commit that never came expire after this
    socket_timeout_s: float = 5.0


class Store:
    """Async access to the session store. One per worker; safe to share between tasks."""

    def __init__(self, settings: StoreSettings) -> None:
        if not 1 << 20 <= settings.piece_bytes <= 4 << 20:
            raise ValueError("piece_bytes must be between 1 MiB and 4 MiB")
        self.settings = settings
        self.redis: aioredis.Redis = aioredis.Redis.from_url(
            settings.url,
            decode_responses=False,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
        )
        self._index = f"{settings.key_prefix}:sessions"
        self._workers = f"{settings.key_prefix}:workers"
        self._create = self.redis.register_script(_CREATE)
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._handoff = self.redis.register_script(_HANDOFF)
        self._cancel_handoff = self.redis.register_script(_CANCEL_HANDOFF)
        self._log_append = self.redis.register_script(_LOG_APPEND)
        self._commit = self.redis.register_script(_COMMIT_SNAPSHOT)
        self._cut = self.redis.register_script(_ROLLBACK_CUT)
        self._close = self.redis.register_script(_CLOSE)

    def keys(self, session_id: str) -> Keys:
        return Keys(self.settings.key_prefix, session_id)

    async def ping(self) -> None:
        await _guarded(self.redis.ping)

    async def aclose(self) -> None:
        await self.redis.aclose()

    # ------------------------------------------------------------------ sessions

    async def create_session(self, meta: SessionMeta, lease_ms: int) -> None:
        """Write a new session's metadata; its creator (``meta.owner``) holds the lease."""
        k = self.keys(meta.session_id)
        fields: list[Any] = [
            "model", meta.model, "fingerprint", meta.fingerprint, "step", meta.step,
            "log_start", meta.log_start, "config", meta.config, "created_at", meta.created_at,
            "updated_at", meta.updated_at, "closed", "1" if meta.closed else "0",
            "epoch", meta.epoch, "owner", meta.owner, "owner_addr", meta.owner_addr,
        ]  # fmt: skip
        reply = await _guarded(
            lambda: self._create(
                keys=[k.meta, self._index, k.lease],
                args=[meta.session_id, meta.owner, lease_ms, *fields],
            )
        )
        if reply == b"ERR_EXISTS":
            raise SessionExistsError(f"session {meta.session_id!r} already exists")
        _raise_script_error(reply)

    async def get_meta(self, session_id: str) -> SessionMeta | None:
        raw = await _guarded(lambda: self.redis.hgetall(self.keys(session_id).meta))
        return SessionMeta.from_hash(session_id, raw) if raw else None

    async def list_session_ids(self, after: str, count: int) -> list[str]:
        start = f"({after}" if after else "-"
        ids = await _guarded(
            lambda: self.redis.zrangebylex(self._index, start, "+", start=0, num=count)
        )
        return [i.decode() for i in ids]

    async def close_session(self, session_id: str, epoch: int, keep_snapshot: str = "") -> None:
        k = self.keys(session_id)
        reply = await _guarded(
            lambda: self._close(
                keys=[k.meta, k.snaps, k.labels, k.log, self._index, k.lease],
                args=[k.base, session_id, keep_snapshot, epoch],
            )
        )
        _raise_script_error(reply)

    # ------------------------------------------------------------------ ownership

    async def acquire(self, session_id: str, worker_id: str, address: str, lease_ms: int) -> int:
        """Take the session's lease; returns the new epoch.

        Raises :class:`SessionMovedError` (with the owner's address and how long its lease
        still runs) when another worker holds it.
        """
        k = self.keys(session_id)
        reply = await _guarded(
            lambda: self._acquire(keys=[k.meta, k.lease], args=[worker_id, address, lease_ms])
        )
        text = reply.decode()
        if text.startswith("OK "):
            return int(text[3:])
        if text.startswith("ERR_OWNED "):
            _code, ttl, owner = text.split(" ", 2)
            raise Lease("", owner, max(0, int(ttl))).redirect(session_id)
        _raise_script_error(reply)
        raise AssertionError(f"unexpected acquire reply {text!r}")

    async def renew_leases(
        self, leases: Sequence[tuple[str, int]], worker_id: str, lease_ms: int
    ) -> list[SsmserveError | None]:
        """Extend the leases of ``(session id, epoch)`` pairs in one round trip.

        One entry per lease: None when renewed (or being handed off), else the error
        (:class:`StaleEpochError` when another worker took the session).
        """
        if not leases:
            return []

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for session_id, epoch in leases:
                    k = self.keys(session_id)
                    await self._renew(
                        keys=[k.meta, k.lease], args=[worker_id, epoch, lease_ms], client=pipe
                    )
                return await pipe.execute(raise_on_error=False)

        return [_script_outcome(r, ok=(b"OK", b"HANDOFF")) for r in await _guarded(run)]

    async def release(self, session_id: str, worker_id: str, epoch: int) -> None:
        k = self.keys(session_id)
        reply = await _guarded(
            lambda: self._release(keys=[k.meta, k.lease], args=[worker_id, epoch])
        )
        _raise_script_error(reply)

    async def handoff(
        self,
        session_id: str,
        worker_id: str,
        epoch: int,
        target: WorkerRecord,
        lease_ms: int,
    ) -> None:
        """Reserve the session for ``target``: only it may acquire it next."""
        k = self.keys(session_id)
        args = [worker_id, epoch, target.worker_id, target.address, lease_ms]
        reply = await _guarded(lambda: self._handoff(keys=[k.meta, k.lease], args=args))
        _raise_script_error(reply)

    async def cancel_handoff(
        self,
        session_id: str,
        worker_id: str,
        epoch: int,
        address: str,
        target_id: str,
        lease_ms: int,
    ) -> None:
        """Take back a reservation the target never used; raises StaleEpochError if it did."""
        k = self.keys(session_id)
        args = [worker_id, epoch, address, lease_ms, target_id]
        reply = await _guarded(lambda: self._cancel_handoff(keys=[k.meta, k.lease], args=args))
        _raise_script_error(reply)

    async def lease(self, session_id: str) -> Lease | None:
        """The session's current lease holder, or None when nobody holds it."""
        k = self.keys(session_id)

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(k.lease)
                pipe.pttl(k.lease)
                pipe.hget(k.meta, "owner_addr")
                return await pipe.execute()

        holder, ttl, addr = await _guarded(run)
        if holder is None:
            return None
        return Lease(holder.decode(), (addr or b"").decode(), max(0, int(ttl)))

    # ------------------------------------------------------------------ worker registry

    async def register_worker(self, record: WorkerRecord, ttl_ms: int) -> None:
        """Write (or refresh) a worker's entry; it disappears ``ttl_ms`` after the last one."""
        key = f"{self.settings.key_prefix}:worker:{record.worker_id}"

        async def run() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=record.to_fields())
                pipe.pexpire(key, ttl_ms)
                pipe.sadd(self._workers, record.worker_id)
                await pipe.execute()

        await _guarded(run)

    async def deregister_worker(self, worker_id: str) -> None:
        async def run() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(f"{self.settings.key_prefix}:worker:{worker_id}")
                pipe.srem(self._workers, worker_id)
                await pipe.execute()

        await _guarded(run)

    async def live_workers(self) -> list[WorkerRecord]:
        """Every worker whose entry has not expired, by address; forgets expired ones."""
        ids = [i.decode() for i in await _guarded(lambda: self.redis.smembers(self._workers))]
        if not ids:
            return []

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for worker_id in ids:
                    pipe.hgetall(f"{self.settings.key_prefix}:worker:{worker_id}")
                return await pipe.execute()

        raws = await _guarded(run)
        gone = [i for i, raw in zip(ids, raws, strict=True) if not raw]
        if gone:
            await _guarded(lambda: self.redis.srem(self._workers, *gone))
        live = [WorkerRecord.from_hash(i, raw) for i, raw in zip(ids, raws, strict=True) if raw]
        return sorted(live, key=lambda w: w.address)

    # ------------------------------------------------------------------ input log

    async def append_logs(
        self, appends: Sequence[tuple[str, int, int, Sequence[bytes]]], updated_at: float
    ) -> list[SsmserveError | None]:
        """Group commit: ``(session id, epoch, first step, inputs)`` for many sessions.

        One round trip for all of them.

        Returns one entry per append: None when it was recorded, else the error.
        """
        if not appends:
            return []

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for session_id, epoch, first, inputs in appends:
                    k = self.keys(session_id)
                    await self._log_append(
                        keys=[k.meta, k.log],
                        args=[epoch, first, updated_at, *inputs],
                        client=pipe,
                    )
                return await pipe.execute(raise_on_error=False)

        return [_script_outcome(reply) for reply in await _guarded(run)]

    async def read_log(self, session_id: str, first: int, last: int) -> list[bytes]:
        """Logged inputs of steps ``first..last``; raises StoreError if any is missing."""
        if last < first:
            return []
        fields = [str(s) for s in range(first, last + 1)]
        values = await _guarded(lambda: self.redis.hmget(self.keys(session_id).log, fields))
        missing = [f for f, v in zip(fields, values, strict=True) if v is None]
        if missing:
            raise StoreError(
                f"input log of session {session_id!r} lacks steps {missing[0]}..{missing[-1]}"
            )
        return list(values)

    # ------------------------------------------------------------------ snapshots

    async def commit_snapshot(
        self,
        session_id: str,
        epoch: int,
        record: SnapshotRecord,
        blob: bytes,
        max_snapshots: int,
    ) -> None:
        """Stage ``blob`` with plain SETs in pieces, then commit it with one small script."""
        k = self.keys(session_id)
        piece = self.settings.piece_bytes
        view = memoryview(blob)
        pieces = max(1, -(-len(blob) // piece))
        if record.pieces != pieces:
            raise ValueError(f"record says {record.pieces} pieces, blob needs {pieces}")

        async def stage() -> None:
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in range(pieces):
                    pipe.set(
                        k.stage(record.snapshot_id, i),
                        view[i * piece : (i + 1) * piece],
                        ex=self.settings.stage_ttl_s,
                    )
                await pipe.execute()

        await _guarded(stage)
        args = [
            k.base, record.snapshot_id, record.step, pieces, record.label, record.reason,
            record.created_at, record.size, max_snapshots, epoch,
        ]  # fmt: skip
        reply = await _guarded(
            lambda: self._commit(keys=[k.meta, k.snaps, k.labels, k.log], args=args)
        )
        _raise_script_error(reply)

    async def list_snapshots(self, session_id: str) -> list[SnapshotRecord]:
        k = self.keys(session_id)
        ids = [i.decode() for i in await _guarded(lambda: self.redis.zrange(k.snaps, 0, -1))]
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

        raws = await _guarded(run)
        return [SnapshotRecord.from_hash(i, raw) for i, raw in zip(ids, raws, strict=True) if raw]

    async def snapshot_at_or_before(self, session_id: str, step: int) -> SnapshotRecord | None:
        """The newest snapshot whose step is <= ``step``."""
        k = self.keys(session_id)
        ids = await _guarded(
            lambda: self.redis.zrevrangebyscore(k.snaps, step, "-inf", start=0, num=1)
        )
        records = await self._records(session_id, [i.decode() for i in ids])
        return records[0] if records else None

    async def snapshot_by_id(self, session_id: str, snapshot_id: str) -> SnapshotRecord | None:
        records = await self._records(session_id, [snapshot_id])
        return records[0] if records else None

    async def snapshot_by_label(self, session_id: str, label: str) -> SnapshotRecord | None:
        snapshot_id = await _guarded(lambda: self.redis.hget(self.keys(session_id).labels, label))
        if snapshot_id is None:
            return None
        return await self.snapshot_by_id(session_id, snapshot_id.decode())

    async def read_blob(self, session_id: str, record: SnapshotRecord) -> bytes:
        k = self.keys(session_id)
        names = [k.blob(record.snapshot_id, i) for i in range(record.pieces)]
        pieces = await _guarded(lambda: self.redis.mget(names))
        if any(p is None for p in pieces):
            raise StoreError(f"snapshot {record.snapshot_id} of {session_id!r} has lost pieces")
        blob = b"".join(pieces)
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

        count, head = await _guarded(run)
        return int(count), (int(head[0][1]) if head else None)

    # ------------------------------------------------------------------ rollback

    async def cut_history(
        self, session_id: str, epoch: int, step: int, upto: int, updated_at: float
    ) -> None:
        """Delete snapshots and logged inputs after ``step``; the durable step drops to it."""
        k = self.keys(session_id)
        reply = await _guarded(
            lambda: self._cut(
                keys=[k.meta, k.snaps, k.labels, k.log],
                args=[k.base, step, upto, updated_at, epoch],
            )
        )
        _raise_script_error(reply)

    async def session_keys(self, session_id: str) -> list[str]:
        """Every key of a session (tests and operators; SCAN, so not for hot paths)."""
        pattern = f"{self.settings.key_prefix}:{{{session_id}}}:*"
        return sorted(
            [key.decode() async for key in self.redis.scan_iter(match=pattern, count=500)]
        )
