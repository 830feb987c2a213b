"""The session store's layout in Redis: every key name and every Lua script.

Key layout (``P`` is the key prefix, ``ssm`` by default; ``{sid}`` is a Redis Cluster hash
tag, so all keys of one session sit in one slot and one script may touch them together)::

    P:sessions                   ZSET   every session id, score 0 (paged with ZRANGEBYLEX)
    P:workers                    SET    ids of registered workers (some may have expired)
    P:worker:<id>                HASH   address, models, load, started_at, draining,
                                        numerics (PX ttl)
    P:{sid}:meta                 HASH   model, fingerprint, numerics, step, log_start,
                                        config, times, incarnation, epoch, token,
                                        owner (worker id), owner_addr
    P:{sid}:lease                STRING the owning worker's id, or 'handoff:<id>' (PX ttl)
    P:{sid}:log                  HASH   step -> raw input bytes (float32 or int64, LE)
    P:{sid}:snaps                ZSET   snapshot id, scored by its step
    P:{sid}:snap:<id>            HASH   step, label, reason, created_at, size, pieces
    P:{sid}:blob:<id>:<i>        STRING piece i of a committed snapshot's checkpoint bytes
    P:{sid}:stage:<id>:<i>       STRING a piece written but not committed yet (expires)
    P:{sid}:labels               HASH   label -> snapshot id
    P:{sid}:events               LIST   what happened to it (rollbacks, guard events), as
                                        msgpack maps, oldest first, the newest 1,024 kept
    P:upload:{<id>}              LIST   pieces of a checkpoint being imported, in order
                                        (PX ttl, renewed with each piece; dropped after)

**Fencing.** ``meta.token`` is the current owner's fencing token (``ssmserve.server.state.lease``):
``<incarnation>.<epoch>``, where the incarnation is random per creation of the id and the
epoch counts acquisitions. Only ``CREATE`` and ``ACQUIRE`` make a token; every other
write script starts with ``fence``, which refuses a token that is not the current one and
changes nothing then. ``RENEW`` only extends the caller's own live lease key: it never
re-creates one that expired (the caller must acquire again, which makes a new token).

**Numbers.** Lua numbers are doubles and ``tostring`` prints 1e14 as ``1e+14``; every
number a script writes or uses in a key name goes through ``int()`` (``%d``, exact up to
2^53), and steps are capped far below that (``MAX_STEP``).

**Replies.** Every script answers a table: ``{'OK', ...}`` or ``{'ERR_<CODE>', message,
...}``; ``ssmserve.server.state.store`` turns codes into typed errors.

**Idempotence.** Writes may be sent again after an answer was lost: a retried create
finds its own token, a retried snapshot commit its own id, a log append of steps already
there is refused as a gap (the caller then reloads the session, never guesses).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The largest step a session may reach: exact in Lua's doubles with room to spare
#: (2^53 is about 9.007e15), and far beyond any real stream (30 years at 1M steps/s).
MAX_STEP = 10**15


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
    def events(self) -> str:
        return self._k("events")

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


def upload_key(prefix: str, upload_id: str) -> str:
    """The staging list of one import (``upload_id`` is random, one per ImportCheckpoint)."""
    return f"{prefix}:upload:{{{upload_id}}}"


# ---------------------------------------------------------------------------- scripts
# Each script touches only keys of one session (one hash tag). Keys derived inside a
# script (snap:<id>, blob:<id>:<i>, stage:<id>:<i>) share that tag, so they live in the
# same slot.

# Helpers every script may use.
_COMMON = """
local function int(n)
    return string.format('%d', n)
end

-- The check every write script starts with: refuse a writer whose fencing token is not
-- the session's current one (another worker acquired the session since, or the id was
-- closed and created again).
local function fence(meta, token)
    local current = redis.call('HGET', meta, 'token')
    if not current then
        if redis.call('EXISTS', meta) == 0 then
            return {'ERR_MISSING', 'the session is gone from the store'}
        end
        current = '(none)'
    end
    if current ~= token then
        return {'ERR_STALE', 'fencing token ' .. token .. ' is stale: the session was taken '
            .. 'over (its token is now ' .. current .. ')',
            redis.call('HGET', meta, 'owner_addr') or ''}
    end
    return nil
end

-- Delete one snapshot and its label.
local function drop_snapshot(base, snaps, labels, id)
    local snap = base .. 'snap:' .. id
    local pieces = tonumber(redis.call('HGET', snap, 'pieces') or '0')
    local label = redis.call('HGET', snap, 'label')
    for i = 0, pieces - 1 do
        redis.call('UNLINK', base .. 'blob:' .. id .. ':' .. int(i))
    end
    if label and label ~= '' and redis.call('HGET', labels, label) == id then
        redis.call('HDEL', labels, label)
    end
    redis.call('DEL', snap)
    redis.call('ZREM', snaps, id)
end

-- Commit a staged snapshot: rename its pieces into place, index it, then apply retention
-- (at most `keep` snapshots; log entries at or before the oldest kept one go). A commit
-- of an id that is already committed (a retry) only drops the re-staged pieces.
local function commit(meta, snaps, labels, log, base, id, step, pieces, label, reason,
                      created_at, size, keep)
    if redis.call('ZSCORE', snaps, id) then
        for i = 0, pieces - 1 do
            redis.call('DEL', base .. 'stage:' .. id .. ':' .. int(i))
        end
        return nil
    end
    local durable = tonumber(redis.call('HGET', meta, 'step'))
    if step > durable then
        return {'ERR_GAP', 'a snapshot at step ' .. int(step) .. ' is ahead of the log, '
            .. 'which ends at step ' .. int(durable)}
    end
    if label ~= '' and redis.call('HEXISTS', labels, label) == 1 then
        return {'ERR_LABEL', 'label ' .. label .. ' already names a snapshot'}
    end
    for i = 0, pieces - 1 do
        if redis.call('EXISTS', base .. 'stage:' .. id .. ':' .. int(i)) == 0 then
            return {'ERR_STAGE', 'staged piece ' .. int(i) .. ' of snapshot ' .. id
                .. ' is missing'}
        end
    end
    for i = 0, pieces - 1 do
        local blob = base .. 'blob:' .. id .. ':' .. int(i)
        redis.call('RENAME', base .. 'stage:' .. id .. ':' .. int(i), blob)
        redis.call('PERSIST', blob)
    end
    redis.call('HSET', base .. 'snap:' .. id, 'step', int(step), 'label', label,
        'reason', reason, 'created_at', created_at, 'size', size, 'pieces', int(pieces))
    redis.call('ZADD', snaps, int(step), id)
    if label ~= '' then
        redis.call('HSET', labels, label, id)
    end
    while redis.call('ZCARD', snaps) > keep do
        -- the oldest by step (ids order snapshots of one step by time); never the new one
        local two = redis.call('ZRANGE', snaps, 0, 1)
        drop_snapshot(base, snaps, labels, two[1] == id and two[2] or two[1])
    end
    local head = redis.call('ZRANGE', snaps, 0, 0, 'WITHSCORES')
    local new_start = tonumber(head[2]) + 1
    local log_start = tonumber(redis.call('HGET', meta, 'log_start'))
    if new_start > log_start then
        for s = log_start, new_start - 1 do
            redis.call('HDEL', log, int(s))
        end
        redis.call('HSET', meta, 'log_start', int(new_start))
    end
    return nil
end
"""

# KEYS: meta, index, lease, snaps, labels, log.
# ARGV: session id, worker id, lease ms, token, base, snapshot id, step, pieces, reason,
# created_at, size, keep, then the field/value pairs of the meta hash (token among them).
# A new session and its first snapshot, at once: a session either exists whole (meta,
# lease and base snapshot) or not at all. Sent again after a lost answer, it finds its
# own token and only drops the re-staged pieces.
CREATE = (
    _COMMON
    + """
local base, id, pieces = ARGV[5], ARGV[6], tonumber(ARGV[8])
if redis.call('EXISTS', KEYS[1]) == 1 then
    if redis.call('HGET', KEYS[1], 'token') == ARGV[4] then
        for i = 0, pieces - 1 do
            redis.call('DEL', base .. 'stage:' .. id .. ':' .. int(i))
        end
        return {'OK'}
    end
    return {'ERR_EXISTS', 'the session already exists'}
end
for i = 0, pieces - 1 do
    if redis.call('EXISTS', base .. 'stage:' .. id .. ':' .. int(i)) == 0 then
        return {'ERR_STAGE', 'staged piece ' .. int(i) .. ' of snapshot ' .. id
            .. ' is missing'}
    end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 13))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
local err = commit(KEYS[1], KEYS[4], KEYS[5], KEYS[6], base, id, tonumber(ARGV[7]), pieces,
    '', ARGV[9], ARGV[10], ARGV[11], tonumber(ARGV[12]))
return err or {'OK'}
"""
)

# KEYS: meta, lease. ARGV: worker id, worker address, lease ms, expected token ('' for
# any), a fresh incarnation and the worker's numerics signature (both used only by
# sessions stored before the store recorded them).
# Free (no lease), held by this worker, or reserved for it by a hand-off: take it with a
# new token. With an expected token, only if nobody acquired it since that token.
ACQUIRE = (
    _COMMON
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
    return {'ERR_MISSING', 'the session does not exist'}
end
if redis.call('HGET', KEYS[1], 'closed') == '1' then
    return {'ERR_CLOSED', 'the session is closed; its final snapshot can still be exported'}
end
if ARGV[4] ~= '' then
    local err = fence(KEYS[1], ARGV[4])
    if err then return err end
end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] and holder ~= 'handoff:' .. ARGV[1] then
    return {'ERR_OWNED', 'the session is held by another worker',
        redis.call('HGET', KEYS[1], 'owner_addr') or '', int(redis.call('PTTL', KEYS[2]))}
end
local incarnation = redis.call('HGET', KEYS[1], 'incarnation')
if not incarnation then
    incarnation = ARGV[5]
    redis.call('HSET', KEYS[1], 'incarnation', incarnation)
end
if (redis.call('HGET', KEYS[1], 'numerics') or '') == '' then
    redis.call('HSET', KEYS[1], 'numerics', ARGV[6])
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local token = incarnation .. '.' .. int(epoch)
redis.call('HSET', KEYS[1], 'token', token, 'owner', ARGV[1], 'owner_addr', ARGV[2])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
return {'OK', token}
"""
)

# KEYS: meta, lease. ARGV: worker id, token, lease ms.
# Extends the caller's own live lease; never re-creates one that ran out (ERR_EXPIRED:
# the caller must acquire again, which gives it a new token).
RENEW = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
local holder = redis.call('GET', KEYS[2])
if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    return {'OK'}
end
if not holder then
    return {'ERR_EXPIRED', 'the lease ran out before it was renewed'}
end
if string.sub(holder, 1, 8) == 'handoff:' then
    return {'HANDOFF'}  -- being handed to another worker by this one: leave it alone
end
return {'ERR_STALE', 'the lease is held by ' .. holder,
    redis.call('HGET', KEYS[1], 'owner_addr') or ''}
"""
)

# KEYS: meta, lease. ARGV: worker id, token. The owner lets go (eviction, shutdown).
RELEASE = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
if redis.call('GET', KEYS[2]) == ARGV[1] then
    redis.call('DEL', KEYS[2])
end
redis.call('HSET', KEYS[1], 'owner', '', 'owner_addr', '')
return {'OK'}
"""
)

# KEYS: meta, lease. ARGV: worker id, token, target id, target address, lease ms.
# The owner reserves the session for one target worker, which acquires it next.
HANDOFF = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
redis.call('SET', KEYS[2], 'handoff:' .. ARGV[3], 'PX', ARGV[5])
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'owner_addr', ARGV[4])
return {'OK'}
"""
)

# KEYS: meta, lease. ARGV: worker id, token, worker address, lease ms, target id.
# The target did not take the session: the owner keeps it (same token).
CANCEL_HANDOFF = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= 'handoff:' .. ARGV[5] and holder ~= ARGV[1] then
    return {'ERR_STALE', 'the session is held by ' .. holder, ''}
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_addr', ARGV[3])
return {'OK'}
"""
)

# KEYS: meta, log. ARGV: token, first step, updated_at, then one input per step.
# The inputs must continue the log exactly (first = durable step + 1); anything else
# means the writer's memory and the store diverged (ERR_GAP: it reloads the session).
LOG_APPEND = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[1])
if err then return err end
if redis.call('HGET', KEYS[1], 'closed') == '1' then
    return {'ERR_CLOSED', 'the session is closed'}
end
local first = tonumber(ARGV[2])
local durable = tonumber(redis.call('HGET', KEYS[1], 'step'))
if first ~= durable + 1 then
    return {'ERR_GAP', 'a log append at step ' .. int(first) .. ' does not continue the log, '
        .. 'which ends at step ' .. int(durable)}
end
local last = first + #ARGV - 4
for i = 4, #ARGV do
    redis.call('HSET', KEYS[2], int(first + i - 4), ARGV[i])
end
redis.call('HSET', KEYS[1], 'step', int(last), 'updated_at', ARGV[3])
return {'OK'}
"""
)

# KEYS: meta, snaps, labels, log. ARGV: base, id, step, pieces, label, reason,
# created_at, size, max_snapshots, token.
COMMIT_SNAPSHOT = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[10])
if err then return err end
err = commit(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], tonumber(ARGV[3]),
    tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9]))
return err or {'OK'}
"""
)

# KEYS: meta, snaps, labels, log. ARGV: base, step t, current in-memory step, updated_at,
# token. History after t is cut: snapshots past t and logged inputs past t are deleted.
ROLLBACK_CUT = (
    _COMMON
    + """
local base, t, upto = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local err = fence(KEYS[1], ARGV[5])
if err then return err end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. int(t), '+inf')) do
    drop_snapshot(base, KEYS[2], KEYS[3], id)
end
local durable = tonumber(redis.call('HGET', KEYS[1], 'step'))
for s = t + 1, math.max(durable, upto) do
    redis.call('HDEL', KEYS[4], int(s))
end
if durable > t then
    redis.call('HSET', KEYS[1], 'step', int(t))
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[4])
return {'OK'}
"""
)

# KEYS: meta, snaps, labels, log, index, lease, events. ARGV: base, session id, keep (a
# snapshot id or ''), token. Without keep: every key of the session goes. With keep: the
# session is marked closed and only that snapshot stays (so it can still be exported).
CLOSE = (
    _COMMON
    + """
local base, keep = ARGV[1], ARGV[3]
local err = fence(KEYS[1], ARGV[4])
if err then return err end
redis.call('DEL', KEYS[6], KEYS[7])
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
return {'OK'}
"""
)

# KEYS: meta, events. ARGV: token, how many to keep, then one msgpack entry per event.
# The owner's record of what happened to the session (for ``GetHistory``); fenced like
# every write, so a stale owner adds nothing.
RECORD_EVENTS = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[1])
if err then return err end
for i = 3, #ARGV do
    redis.call('RPUSH', KEYS[2], ARGV[i])
end
redis.call('LTRIM', KEYS[2], -int(ARGV[2]), -1)
return {'OK'}
"""
)

# ---------------------------------------------------------------------------- Redis ACL

#: What a worker's Redis user needs, and nothing more (``key_prefix`` "ssm"): the
#: commands above (in scripts and outside them), EVALSHA with script loading, and keys
#: under the prefix only. ``tests/test_store.py`` runs a worker as such a user on every
#: Redis version it tests. (CLIENT SETINFO, which redis-py sends on connect, may be
#: refused: redis-py ignores that.)
WORKER_ACL_RULES = (
    "resetkeys ~ssm:* resetchannels -@all +ping +select +multi +exec +discard +evalsha +eval "
    "+script|load +script|exists +get +set +del +unlink +exists +rename +persist +pexpire "
    "+pttl +mget +hget +hgetall +hmget +hset +hdel +hexists +hincrby +sadd +srem +smembers "
    "+zadd +zrem +zcard +zrange +zrangebylex +zrangebyscore +zscore +scan +zrevrangebyscore "
    "+zlexcount +rpush +lrange +llen +ltrim"
)
