"""How the store runs one Redis operation: the connection, the deadline, replicas
waited for, and the rule for outcomes (``StoreCalls._call``).

**Unknown outcomes.** redis-py does not retry here (``retry`` off), and a write whose
answer never came (a timeout, a connection cut after the command left) may or may not
have run: it raises :class:`StoreOutcomeUnknownError`, and the session manager reloads the
session from Redis before it answers anything else about it. Reads that fail raise
:class:`StoreUnavailableError`.

**Fencing.** Every write of a session carries its owner's
:class:`~ssmserve.server.state.lease.SessionLease`; the scripts compare its fencing token
with the session's current one and change nothing when they differ
(:class:`StaleEpochError`, counted here).

The store's operations (``store``, ``snapshot_store``, ``import_staging``,
``store_facts``) are subclasses of :class:`StoreCalls`, so they share one connection pool,
one deadline and this one rule; ``script_batches`` sends a batch of scripts on each
topology.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from redis import exceptions as redis_errors
from redis.commands.core import AsyncScript

from ssmserve.server.errors import SsmserveError, clip
from ssmserve.server.observability.metrics import Metrics
from ssmserve.server.state import redis_topology
from ssmserve.server.state.script_batches import (
    NOT_RUN,
    ScriptBatches,
    UnconfirmedWriteError,
    until_run,
)
from ssmserve.server.state.session_ids import check_session_id
from ssmserve.server.state.store_errors import (
    SessionMissingError,
    SessionVanishedError,
    StaleEpochError,
    StoreError,
    StoreOutcomeUnknownError,
    StoreUnavailableError,
    check_reply,
    reply_outcome,
    unknown_outcome_of,
)
from ssmserve.server.state.store_layout import Keys

T = TypeVar("T")

SESSIONS_PER_CALL = 256  # sessions per call of a *_MANY script (one Redis server)


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


class StoreCalls:
    """The connection to the session store and the rules every call follows. One per
    worker (as a ``Store``); safe to share between tasks."""

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

    async def _call(self, op: str, call: Callable[[], Awaitable[T]], write: bool = False) -> T:
        """Run one Redis operation ``op`` (timed); connection trouble becomes
        StoreUnavailableError, or, for a write whose answer may have been lost,
        StoreOutcomeUnknownError."""
        started = time.perf_counter()
        try:
            if write and self.metrics.tracing.enabled:  # writes are traced
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
        StoreOutcomeUnknownError for all of them; on a cluster only when no call's outcome
        is known (one node's lost or unconfirmed answer is an error in its calls' places:
        ``script_batches``)."""
        if not calls:
            return []
        replies = await self._call(op, lambda: self.batches.run(script, calls), True)
        unknown = sum(isinstance(r, UnconfirmedWriteError) for r in replies)
        if unknown:  # one count per call whose outcome is unknown
            self.metrics.redis_errors.labels(op, "outcome_unknown").inc(unknown)
        return replies

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


def _vanished(error: SessionMissingError) -> SessionVanishedError:
    return SessionVanishedError(
        f"{error} while this worker held it (closed by a later owner, or the store was "
        f"wiped: the worker checks which); retry"
    )
