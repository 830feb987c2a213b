"""The session store's layout in Redis: every key name and every Lua script.

Key layout (``P`` is the key prefix, ``ssm`` by default; ``{sid}`` is a Redis Cluster hash
tag, so all keys of one session sit in one slot and one script may touch them together)::

    P:sessions                   ZSET   every session id, score 0 (paged with ZRANGEBYLEX);
                                        another slot than the sessions' keys, so an id
                                        enters it before its session is written and
                                        leaves after it is deleted: readers skip ids
                                        whose meta is gone
    P:workers                    SET    ids of registered workers (some may have expired)
    P:worker:<id>                HASH   address, models, load, started_at, draining,
                                        numerics (PX ttl)
    P:worker_at:<address>        HASH   the same and worker_id: the entry of the worker
                                        that registered at that address last (PX ttl),
                                        a Migrate's one read of its target
    P:{sid}:meta                 HASH   model, fingerprint, numerics, step, log_start,
                                        config, times, incarnation, epoch, token,
                                        owner (worker id), owner_addr, lease_ms (the
                                        owner's lease TTL), beat (new with every
                                        acquisition and renewal: the token, then
                                        '<token>/<nonce>')
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
    P:store                      STRING the store's identity, '<random id> <created_at>':
                                        written once (SET NX) by the first worker, read
                                        by every worker at start and with each
                                        heartbeat; another one, or none, means the
                                        store was wiped or replaced

**Fencing.** ``meta.token`` is the current owner's fencing token (``ssmserve.server.state.lease``):
``<incarnation>.<epoch>`` from ``CREATE`` (the incarnation is random per creation of the
id) and ``<incarnation>.<epoch>.<nonce>`` from ``ACQUIRE``, where the epoch counts
acquisitions (for people) and the nonce is random per acquisition. The nonce is what
makes a token unique: the epoch counter lives in data that Redis can lose (a failover to
a replica that missed writes, a restored backup, an fsync window), after which the same
epoch is handed out again. Only ``CREATE`` and ``ACQUIRE`` make a token; every other
write script starts with ``fence``, which compares the whole token, refuses one that is
not the current one and changes nothing then. ``RENEW`` only extends the caller's own
live lease key: it never re-creates one that expired (the caller must acquire again,
which makes a new token).

**Takeover.** A lease key expires by Redis's wall clock, which can step; the owner trusts
its lease by its own monotonic clock. So a lease that ran out while its owner never let
go (a crash, a freeze, a clock step) is taken over only by a worker that proves it saw
the lease unrenewed for a whole TTL on its own clock: every acquisition and renewal sets
``meta.beat`` to a value never used before (the token, then the token and a nonce), and
``ACQUIRE`` wants the beat the caller saw that long ago (``cluster.takeover``). A counter
would not do: Redis can lose writes and count the same number again, and an id created
anew starts over.

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

    def snap(self, snapshot_id: str) -> str:
        return self._k(f"snap:{snapshot_id}")

    def blob(self, snapshot_id: str, piece: int) -> str:
        return self._k(f"blob:{snapshot_id}:{piece}")

    def stage(self, snapshot_id: str, piece: int) -> str:
        return self._k(f"stage:{snapshot_id}:{piece}")


def upload_key(prefix: str, upload_id: str) -> str:
    """The staging list of one import (``upload_id`` is random, one per ImportCheckpoint)."""
    return f"{prefix}:upload:{{{upload_id}}}"


def store_identity_key(prefix: str) -> str:
    """The store's identity (``state.store_facts.StoreIdentity``), one key for the store."""
    return f"{prefix}:store"


# ---------------------------------------------------------------------------- scripts
# Each script touches only keys of one session (one hash tag; the exceptions, the *_MANY
# scripts, run on a single Redis server only), and declares every key it
# touches in KEYS (Redis Cluster routes a script by its keys, and Redis does not promise
# that keys a script builds itself are served). Snapshot pieces have names that depend
# on the snapshot, so the caller reads them first and declares them; a script that finds
# the snapshots changed since (another write of the same owner came between) answers
# ERR_RACE and the caller reads again (``SnapshotStore._with_drops``).

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

-- The snapshots a caller declared for deletion: ARGV[a] says how many, then the id and
-- piece count of each; their keys follow in KEYS from k on: the snapshot's hash, then
-- its pieces. Returns id -> {snap = key, blobs = {keys}}.
local function declared(k, a)
    local drops = {}
    for _ = 1, tonumber(ARGV[a]) do
        local id, pieces = ARGV[a + 1], tonumber(ARGV[a + 2])
        a = a + 2
        local d = {snap = KEYS[k], blobs = {}}
        for i = 1, pieces do
            d.blobs[i] = KEYS[k + i]
        end
        k = k + pieces + 1
        drops[id] = d
    end
    return drops
end

local function race(id)
    return {'ERR_RACE', 'snapshot ' .. id .. ' was not declared or changed since it was read'}
end

-- Delete one snapshot (declared in `drops`) and its label.
local function drop_snapshot(snaps, labels, drops, id)
    local d = drops[id]
    if not d then return race(id) end
    local pieces = tonumber(redis.call('HGET', d.snap, 'pieces') or '0')
    if pieces ~= #d.blobs then return race(id) end
    local label = redis.call('HGET', d.snap, 'label')
    for i = 1, pieces do
        redis.call('UNLINK', d.blobs[i])
    end
    if label and label ~= '' and redis.call('HGET', labels, label) == id then
        redis.call('HDEL', labels, label)
    end
    redis.call('DEL', d.snap)
    redis.call('ZREM', snaps, id)
    return nil
end

-- Before a script changes anything: is every snapshot `ids` names declared as it is?
local function check_declared(drops, ids)
    for _, id in ipairs(ids) do
        local d = drops[id]
        if not d then return race(id) end
        if tonumber(redis.call('HGET', d.snap, 'pieces') or '0') ~= #d.blobs then
            return race(id)
        end
    end
    return nil
end

-- The snapshots retention drops to keep at most `keep` once one more is added: the
-- oldest by step (ids order snapshots of one step by time).
local function retention(snaps, keep)
    local over = redis.call('ZCARD', snaps) + 1 - keep
    if over <= 0 then return {} end
    return redis.call('ZRANGE', snaps, 0, over - 1)
end

-- Commit a staged snapshot: rename its pieces into place, index it, then apply retention
-- (at most `keep` snapshots; log entries at or before the oldest kept one go). `new` holds
-- the new snapshot's keys: snap, stages, blobs. A commit of an id that is already
-- committed (a retry) only drops the re-staged pieces.
local function commit(meta, snaps, labels, log, new, drops, id, step, label, reason,
                      created_at, size, keep)
    local pieces = #new.stages
    if redis.call('ZSCORE', snaps, id) then
        for i = 1, pieces do
            redis.call('DEL', new.stages[i])
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
    for i = 1, pieces do
        if redis.call('EXISTS', new.stages[i]) == 0 then
            return {'ERR_STAGE', 'staged piece ' .. int(i - 1) .. ' of snapshot ' .. id
                .. ' is missing'}
        end
    end
    local old = retention(snaps, keep)
    local err = check_declared(drops, old)
    if err then return err end
    for i = 1, pieces do
        redis.call('RENAME', new.stages[i], new.blobs[i])
        redis.call('PERSIST', new.blobs[i])
    end
    redis.call('HSET', new.snap, 'step', int(step), 'label', label, 'reason', reason,
        'created_at', created_at, 'size', size, 'pieces', int(pieces))
    redis.call('ZADD', snaps, int(step), id)
    if label ~= '' then
        redis.call('HSET', labels, label, id)
    end
    for _, gone in ipairs(old) do
        drop_snapshot(snaps, labels, drops, gone)
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

-- A new snapshot's keys, declared from KEYS[k] on: its hash, `pieces` staging keys, then
-- `pieces` final keys.
local function new_snapshot(k, pieces)
    local new = {snap = KEYS[k], stages = {}, blobs = {}}
    for i = 1, pieces do
        new.stages[i] = KEYS[k + i]
        new.blobs[i] = KEYS[k + pieces + i]
    end
    return new
end
"""

# KEYS: meta, lease, snaps, labels, log, then the new snapshot's (``new_snapshot``).
# ARGV: worker id, lease ms, token, snapshot id, step, pieces, reason, created_at, size,
# keep, then the field/value pairs of the meta hash (token among them).
# A new session and its first snapshot, at once: a session either exists whole (meta,
# lease and base snapshot) or not at all. Sent again after a lost answer, it finds its
# own token and only drops the re-staged pieces. (The session index is another slot:
# ``Store.create_session`` adds the id to it first.)
CREATE = (
    _COMMON
    + """
local pieces = tonumber(ARGV[6])
local new = new_snapshot(6, pieces)
if redis.call('EXISTS', KEYS[1]) == 1 then
    if redis.call('HGET', KEYS[1], 'token') == ARGV[3] then
        for i = 1, pieces do
            redis.call('DEL', new.stages[i])
        end
        return {'OK'}
    end
    return {'ERR_EXISTS', 'the session already exists'}
end
for i = 1, pieces do
    if redis.call('EXISTS', new.stages[i]) == 0 then
        return {'ERR_STAGE', 'staged piece ' .. int(i - 1) .. ' of snapshot ' .. ARGV[4]
            .. ' is missing'}
    end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 11))
redis.call('HSET', KEYS[1], 'lease_ms', ARGV[2], 'beat', ARGV[3])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local err = commit(KEYS[1], KEYS[3], KEYS[4], KEYS[5], new, {}, ARGV[4], tonumber(ARGV[5]),
    '', ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10]))
return err or {'OK'}
"""
)

# KEYS: meta, lease, and for a load snaps, then, when the load expects to restore from a
# snapshot (ARGV[9], its id), that snapshot's record and first piece. A load's reply also
# names the newest snapshot at or before the durable step; when that is the one expected,
# its record's fields and values (a list) and, for a checkpoint of at most ARGV[10] bytes,
# its one piece (else nil), or an empty list and nil; then the meta hash's fields and
# values. A bigger checkpoint is read with MGET: a piece copied through Lua costs about
# 2 ms per MiB more than one read directly (``store_leases.INLINE_CHECKPOINT_BYTES``).
# ARGV: worker id, worker address, lease ms, expected token ('' for any), a fresh
# incarnation and the worker's numerics signature (both used only by sessions stored
# before the store recorded them), a fresh nonce, and the caller's proof that the owner
# no longer trusts its lease ('' for none: the ``beat`` it saw stand for a lease TTL by
# its own clock, or the beat of an owner it knows dead; ``cluster.takeover``). A refusal
# names the owner's worker id beside its address and beat, so that the caller can tell
# whether it knows that worker dead (``advertise_lock``). Free (no lease), held by this
# worker, or reserved for it by a hand-off: take it with a new token. With an expected
# token, only if nobody acquired it since that token. A lease whose owner never let go
# is taken over only with the proof, whether or not its key ran out in Redis: Redis
# expires keys by its wall clock, which can jump, so its expiry alone never hands a
# session on (the owner may still trust its lease by its own clock), and a proof holds
# while the key lingers (the beat did not move: nobody renewed it).
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
local beat = redis.call('HGET', KEYS[1], 'beat') or ''
local current = redis.call('HGET', KEYS[1], 'token') or ''
-- A beat is bound to the token it was set under (``beat_of``). One that is not (a session
-- last acquired by a worker that kept no beat) proves nothing, and such a session falls
-- back to Redis's expiry of its lease key.
local bound = current ~= '' and string.sub(beat, 1, #current) == current
local owner = redis.call('HGET', KEYS[1], 'owner') or ''
local proven = bound and ARGV[8] ~= '' and ARGV[8] == beat
if holder and holder ~= ARGV[1] and holder ~= 'handoff:' .. ARGV[1] and not proven then
    return {'ERR_OWNED', 'the session is held by another worker',
        redis.call('HGET', KEYS[1], 'owner_addr') or '', int(redis.call('PTTL', KEYS[2])),
        beat, redis.call('HGET', KEYS[1], 'lease_ms') or '0', owner}
end
if not holder and ARGV[4] == '' and owner ~= '' and owner ~= ARGV[1] and bound and not proven then
    return {'ERR_OWNED', 'the lease ran out in Redis, but this worker has not yet seen it '
        .. 'unrenewed for a whole lease TTL', redis.call('HGET', KEYS[1], 'owner_addr') or '',
        0, beat, redis.call('HGET', KEYS[1], 'lease_ms') or '0', owner}
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
local token = incarnation .. '.' .. int(epoch) .. '.' .. ARGV[7]
redis.call('HSET', KEYS[1], 'token', token, 'owner', ARGV[1], 'owner_addr', ARGV[2],
    'lease_ms', ARGV[3], 'beat', token)
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
if KEYS[3] then
    -- A load: what it restores from, read as the lease is taken (the last owner is
    -- done): the newest snapshot at or before the durable step, and the session's meta.
    local durable = redis.call('HGET', KEYS[1], 'step')
    local newest = redis.call('ZREVRANGEBYSCORE', KEYS[3], durable, '-inf', 'LIMIT', 0, 1)
    local found = newest[1] or ''
    local record, piece = {}, false
    if KEYS[4] and found ~= '' and found == ARGV[9] then
        record = redis.call('HGETALL', KEYS[4])
        local size = tonumber(redis.call('HGET', KEYS[4], 'size') or '')
        if size and size <= tonumber(ARGV[10]) then piece = redis.call('GET', KEYS[5]) end
    end
    local reply = {'OK', token, found, record, piece}
    for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do reply[#reply + 1] = v end
    return reply
end
return {'OK', token}
"""
)

# Extends the caller's own live lease; never re-creates one that ran out (ERR_EXPIRED:
# the caller must acquire again, which gives it a new token).
_RENEW = """
local function renew(meta, lease, holder, token, ms, nonce)
    local err = fence(meta, token)
    if err then return err end
    local current = redis.call('GET', lease)
    if current == holder then
        redis.call('PEXPIRE', lease, ms)
        redis.call('HSET', meta, 'beat', token .. '/' .. nonce)
        return {'OK'}
    end
    if not current then
        return {'ERR_EXPIRED', 'the lease ran out before it was renewed'}
    end
    if string.sub(current, 1, 8) == 'handoff:' then
        -- Being handed to another worker by this one: leave the reservation alone. The
        -- owner goes on trusting its lease, so the beat moves as for a renewal.
        redis.call('HSET', meta, 'beat', token .. '/' .. nonce)
        return {'HANDOFF'}
    end
    return {'ERR_STALE', 'the lease is held by ' .. current,
        redis.call('HGET', meta, 'owner_addr') or ''}
end
"""

# KEYS: meta, lease. ARGV: worker id, token, lease ms, a fresh nonce (the new beat's).
RENEW = (
    _COMMON
    + _RENEW
    + """
return renew(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
"""
)

# The renewals of many sessions of one worker in one call: on one Redis server only (as
# LOG_APPEND_MANY, and for the same reason: redis-py's Python per pipelined command cost
# more than the renewal; a worker renews every session it holds every period). KEYS: meta
# and lease of each session. ARGV: lease ms, a fresh nonce (one per call: each session's
# beat is its own token and it), then per session: worker id, token. Returns one reply
# per session, as RENEW's.
RENEW_MANY = (
    _COMMON
    + _RENEW
    + """
local replies = {}
for s = 1, #KEYS / 2 do
    replies[s] = renew(KEYS[2 * s - 1], KEYS[2 * s], ARGV[2 * s + 1], ARGV[2 * s + 2], ARGV[1],
        ARGV[2])
end
return replies
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

# KEYS: meta, lease, snaps. ARGV: worker id, token, target id, target address, lease ms,
# the session's step. The owner reserves the session for one target worker, which
# acquires it next; the reply names the newest snapshot at or before the step (the one
# the target loads from), '' when there is none.
HANDOFF = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[2])
if err then return err end
redis.call('SET', KEYS[2], 'handoff:' .. ARGV[3], 'PX', ARGV[5])
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'owner_addr', ARGV[4])
local newest = redis.call('ZREVRANGEBYSCORE', KEYS[3], ARGV[6], '-inf', 'LIMIT', 0, 1)
return {'OK', newest[1] or ''}
"""
)

# KEYS: meta, lease. ARGV: worker id, token, worker address, lease ms, target id, a fresh
# nonce (the new beat's). The target did not take the session: the owner keeps it (same
# token).
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
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_addr', ARGV[3], 'beat',
    ARGV[2] .. '/' .. ARGV[6])
return {'OK'}
"""
)

# One session's log append: ``count`` inputs as steps first, first + 1, ..., given as
# ARGV[from..from + count - 1] (``packed`` nil) or as one string of ``count`` inputs of
# equal length (``packed``). They must continue the log exactly (first = durable step + 1);
# anything else means the writer's memory and the store diverged (ERR_GAP: it reloads).
_APPEND = """
local function append(meta, log, token, first, updated_at, count, packed, from)
    local err = fence(meta, token)
    if err then return err end
    if redis.call('HGET', meta, 'closed') == '1' then
        return {'ERR_CLOSED', 'the session is closed'}
    end
    local durable = tonumber(redis.call('HGET', meta, 'step'))
    if first ~= durable + 1 then
        return {'ERR_GAP', 'a log append at step ' .. int(first) .. ' does not continue the log, '
            .. 'which ends at step ' .. int(durable)}
    end
    if packed then
        local width = #packed / count
        for i = 0, count - 1 do
            local input = string.sub(packed, i * width + 1, (i + 1) * width)
            redis.call('HSET', log, int(first + i), input)
        end
    else
        for i = 0, count - 1 do
            redis.call('HSET', log, int(first + i), ARGV[from + i])
        end
    end
    redis.call('HSET', meta, 'step', int(first + count - 1), 'updated_at', updated_at)
    return {'OK'}
end
"""

# KEYS: meta, log. ARGV: token, first step, updated_at, then one input per step.
LOG_APPEND = (
    _COMMON
    + _APPEND
    + """
return append(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), ARGV[3], #ARGV - 3, nil, 4)
"""
)

# The appends of many sessions in one call: on one Redis server only (the exception to
# "one session per script": its keys span many hash tags, which Redis Cluster refuses;
# there each session's append is its own LOG_APPEND). Redis runs a script whole or, when
# refused up front (OOM, BUSY), not at all. KEYS: meta and log of each session. ARGV:
# updated_at, then per session: token, first step, input count, its inputs as one string
# (inputs of one session have one length). Returns one reply per session, as LOG_APPEND's.
LOG_APPEND_MANY = (
    _COMMON
    + _APPEND
    + """
local replies = {}
for s = 1, #KEYS / 2 do
    local a = 2 + 4 * (s - 1)
    replies[s] = append(KEYS[2 * s - 1], KEYS[2 * s], ARGV[a], tonumber(ARGV[a + 1]), ARGV[1],
        tonumber(ARGV[a + 2]), ARGV[a + 3])
end
return replies
"""
)

# KEYS: meta, snaps, labels, log, the new snapshot's (``new_snapshot``), then the
# snapshots retention may drop (``declared``). ARGV: token, id, step, pieces, label, reason,
# created_at, size, max_snapshots, then the declared list.
COMMIT_SNAPSHOT = (
    _COMMON
    + """
local err = fence(KEYS[1], ARGV[1])
if err then return err end
local pieces = tonumber(ARGV[4])
local new = new_snapshot(5, pieces)
local drops = declared(6 + 2 * pieces, 10)
err = commit(KEYS[1], KEYS[2], KEYS[3], KEYS[4], new, drops, ARGV[2], tonumber(ARGV[3]),
    ARGV[5], ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9]))
return err or {'OK'}
"""
)

# KEYS: meta, snaps, labels, log, then the snapshots after t (``declared``). ARGV: step t,
# current in-memory step, updated_at, token, then the declared list. History after t is
# cut: snapshots past t and logged inputs past t are deleted.
ROLLBACK_CUT = (
    _COMMON
    + """
local t, upto = tonumber(ARGV[1]), tonumber(ARGV[2])
local err = fence(KEYS[1], ARGV[4])
if err then return err end
local drops = declared(5, 5)
local later = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. int(t), '+inf')
err = check_declared(drops, later)
if err then return err end
for _, id in ipairs(later) do
    drop_snapshot(KEYS[2], KEYS[3], drops, id)
end
local durable = tonumber(redis.call('HGET', KEYS[1], 'step'))
for s = t + 1, math.max(durable, upto) do
    redis.call('HDEL', KEYS[4], int(s))
end
if durable > t then
    redis.call('HSET', KEYS[1], 'step', int(t))
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[3])
return {'OK'}
"""
)

# KEYS: meta, snaps, labels, log, lease, events, then every snapshot but `keep`
# (``declared``). ARGV: keep (a snapshot id or ''), token, then the declared list. Without
# keep: every key of the session goes. With keep: the session is marked closed and only
# that snapshot stays (so it can still be exported). (The session index is another slot:
# ``Store.close_session`` removes the id from it after.)
CLOSE = (
    _COMMON
    + """
local keep = ARGV[1]
local err = fence(KEYS[1], ARGV[2])
if err then return err end
local drops = declared(7, 3)
local gone = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if id ~= keep then gone[#gone + 1] = id end
end
err = check_declared(drops, gone)
if err then return err end
redis.call('DEL', KEYS[5], KEYS[6])
for _, id in ipairs(gone) do
    drop_snapshot(KEYS[2], KEYS[3], drops, id)
end
redis.call('DEL', KEYS[4])
if keep == '' then
    redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
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

# KEYS: meta, snaps. What a load checks before it acquires: the id of the newest snapshot
# at or before the durable step ('' for none), then the meta hash's fields and values
# (none when the session does not exist). The load asks ACQUIRE to read that snapshot.
META_TO_LOAD = """
local fields = redis.call('HGETALL', KEYS[1])
local durable = redis.call('HGET', KEYS[1], 'step')
local found = ''
if durable and tonumber(durable) then
    found = redis.call('ZREVRANGEBYSCORE', KEYS[2], durable, '-inf', 'LIMIT', 0, 1)[1] or ''
end
local reply = {found}
for _, v in ipairs(fields) do reply[#reply + 1] = v end
return reply
"""

# KEYS: meta. The meta hash's fields and values (none when the session does not exist),
# read by a call that writes: the step is written back unchanged, so that the WAIT after
# it (on the same connection) returns only once the replicas hold everything read here
# (a replica applies the master's writes in order). What a client is told of a session
# no worker holds, when replicas must confirm writes (``Store.meta_confirmed``).
META_CONFIRMED = """
local fields = redis.call('HGETALL', KEYS[1])
local step = redis.call('HGET', KEYS[1], 'step')
if step then redis.call('HSET', KEYS[1], 'step', step) end
return fields
"""

# KEYS: worker_at. ARGV: worker id. A worker that stops forgets the copy of its entry at
# its address, unless a later worker at that address has written its own there.
FORGET_WORKER_AT = """
if redis.call('HGET', KEYS[1], 'worker_id') == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

# ---------------------------------------------------------------------------- Redis ACL

#: What a worker's Redis user needs, and nothing more (``key_prefix`` "ssm"): the
#: commands above (in scripts and outside them), EVALSHA with script loading, and keys
#: under the prefix only. ``tests/test_store.py`` runs a worker as such a user on every
#: Redis version it tests. (CLIENT SETINFO, which redis-py sends on connect, may be
#: refused: redis-py ignores that.) INFO is how the worker reads ``maxmemory_policy``
#: where CONFIG GET is refused (``cluster.store_guard``); CONFIG GET itself is left out,
#: since it would show this user the server's passwords too.
WORKER_ACL_RULES = (
    "resetkeys ~ssm:* resetchannels -@all +ping +select +multi +exec +discard +evalsha +eval "
    "+script|load +script|exists +get +set +del +unlink +exists +rename +persist +pexpire "
    "+pttl +mget +hget +hgetall +hmget +hset +hdel +hexists +hincrby +sadd +srem +smembers "
    "+zadd +zrem +zcard +zrange +zrangebylex +zrangebyscore +zscore +scan +zrevrangebyscore "
    "+zlexcount +rpush +lrange +llen +ltrim +wait +info +role"
)
#: What a worker needs beyond :data:`WORKER_ACL_RULES` on Redis Cluster (on every node):
#: the cluster client learns the slot map (CLUSTER SLOTS) and each command's keys
#: (COMMAND) when it connects.
WORKER_CLUSTER_ACL_RULES = "+cluster|slots +command"
