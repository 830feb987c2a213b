"""The store itself, watched: its eviction policy and its identity (``state.store_facts``).

**An evicting Redis is refused.** Any ``maxmemory-policy`` but ``noeviction`` lets Redis
delete keys when it fills up, silently: session metadata, logged inputs, leases and
registry entries vanish, so acknowledged steps are lost and a session may get two owners.
A starting worker that finds one refuses to start (:class:`EvictingRedisError`, saying
what it found and what to set) unless ``--allow-evicting-redis`` is given (then it warns).
Found at a heartbeat (someone changed it live), the worker stops serving: health
NOT_SERVING and every call UNAVAILABLE with that message (:attr:`StoreGuard.refusal`),
until the policy is ``noeviction`` again. Where the policy cannot be read (CONFIG and INFO
both refused) the worker says so once, at WARNING, and serves: the operator must make
sure.

**A wiped or replaced store is said loudly.** The store's identity is adopted at start
(written if there is none) and read again with every heartbeat, and whenever a session
this worker holds is found missing (:meth:`StoreGuard.check_identity`). Another identity,
or none, means the store was wiped (FLUSHALL, a restart without persistence) or replaced:
the worker logs an ERROR, counts it (``ssmserve_store_resets_total``), tells
``on_reset`` (the session manager answers DATA_LOSS for every session it held, and
serves none of them from memory), and adopts the new identity, writing one if none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.state.store_facts import (
    NO_EVICTION,
    EvictionPolicies,
    StoreFactReads,
    StoreIdentity,
)

log = logging.getLogger(__name__)


class EvictingRedisError(SsmserveError):
    """The store's Redis may delete keys on its own (``maxmemory-policy`` is not
    ``noeviction``): refused at start, and UNAVAILABLE for every call when found later."""

    kind = ErrorKind.UNAVAILABLE


def evicting_message(evicting: dict[str, str]) -> str:
    """What was found, why it loses data, and what to set."""
    found = ", ".join(f"{policy!r} on {server}" for server, policy in evicting.items())
    return (
        f"the session store's Redis evicts keys: maxmemory-policy is {found}. An evicting "
        f"Redis deletes session keys, leases and registry entries silently when it fills "
        f"up, so acknowledged steps vanish and a session may get two owners. Set "
        f"{NO_EVICTION!r}: `CONFIG SET maxmemory-policy {NO_EVICTION}` (and "
        f"`maxmemory-policy {NO_EVICTION}` in redis.conf, or in the managed service's "
        f"parameter group), on every master; or start with --allow-evicting-redis to "
        f"serve anyway"
    )


#: Why a Redis whose AOF is not fsynced before it answers can lose acknowledged steps.
FSYNC_WARNING = (
    "Redis %s answers writes before its AOF has them on disk (appendfsync %s): killed "
    "(kill -9, the OOM killer) while a slow fsync holds its AOF writes back, it comes back "
    "without up to 2 s of acknowledged steps, and replicas that resync from it drop them "
    "too. For no loss set appendfsync always (CONFIG SET appendfsync always, and in its "
    "config): a group commit then waits for one fsync (docs/redis.md)"
)


class StoreGuard:
    """Reads the store's eviction policy and identity at start and with each heartbeat.

    :attr:`refusal` is read by the serving gate (``api.serving_gate``) and by readiness
    (``worker``), so calls and health follow it. ``on_reset`` is called with the identity
    the worker had when the store turns out to be wiped or replaced; it returns how many
    sessions this worker lost.
    """

    def __init__(
        self,
        store: StoreFactReads,
        allow_evicting: bool = False,
    ) -> None:
        self.store = store
        self.allow_evicting = allow_evicting
        self.on_reset: Callable[[StoreIdentity | None], int] = lambda _was: 0
        self.identity: StoreIdentity | None = None  # adopted at start
        self.refusal: EvictingRedisError | None = None  # set: serve nothing
        self.resets = 0  # wipes or replacements seen (tests, operators)
        self._seen: dict[str, str] = {}  # the evicting servers last logged (no repeats)
        self._said_unreadable = False
        self._identity_lock = asyncio.Lock()  # one identity check (and adoption) at a time

    async def start(self) -> None:
        """Before the worker serves: refuse an evicting Redis (raises
        :class:`EvictingRedisError`), and adopt the store's identity."""
        self._judge(await self.store.eviction_policies(), starting=True)
        self.identity = await self.store.claim_store_identity(StoreIdentity.new())
        log.info("session store identity %s", self.identity.describe())
        for server, policy in sorted((await self.store.fsync_policies()).items()):
            if policy != "always":
                log.warning(FSYNC_WARNING, server, policy)

    async def check(self) -> None:
        """With each heartbeat: the policy and the identity, read at once. Never raises:
        a store that does not answer is the heartbeat's to report, and the next round
        reads again."""
        policies, identity = await asyncio.gather(
            self.store.eviction_policies(), self.check_identity(), return_exceptions=True
        )
        for result in (policies, identity):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, SsmserveError):
                log.debug("store check failed: %s", result)
            elif isinstance(result, BaseException):  # a bug: said, and the heartbeat goes on
                log.error("store check failed", exc_info=result)
        if isinstance(policies, EvictionPolicies):
            self._judge(policies, starting=False)

    async def check_identity(self) -> bool:
        """Read the store's identity; True when it is not the one adopted (the store was
        wiped or replaced: ``on_reset`` has been told, and the new identity adopted)."""
        async with self._identity_lock:
            found = await self.store.store_identity()
            if found is not None and found == self.identity:
                return False
            was = self.identity
            self.resets += 1
            self.store.metrics.store_resets.inc()
            lost = self.on_reset(was)
            self.identity = found or await self.store.claim_store_identity(StoreIdentity.new())
            log.error(
                "the session store was wiped or replaced: its identity was %s, it is now %s. "
                "Every session this worker held is lost (%d); they answer DATA_LOSS until "
                "created or imported again",
                was.describe() if was else "(none)",
                found.describe() if found else "(none: it came back empty)",
                lost,
                extra={"event": "store_reset"},
            )
            return True

    def _judge(self, policies: EvictionPolicies, starting: bool) -> None:
        if policies.unreadable:
            if not self._said_unreadable:
                self._said_unreadable = True
                log.warning(
                    "cannot read the session store's maxmemory-policy (%s), so this worker "
                    "cannot tell whether Redis may delete session keys on its own. Make sure "
                    "it is %r (in redis.conf, or the managed service's parameter group), or "
                    "allow this worker's Redis user CONFIG GET or INFO",
                    policies.unreadable,
                    NO_EVICTION,
                )
            if not policies.by_server:
                return
        evicting = policies.evicting
        if evicting == self._seen:
            return
        self._seen = evicting
        if not evicting:
            if self.refusal is not None:
                self.refusal = None
                log.warning("maxmemory-policy is %r again: serving", NO_EVICTION)
            return
        message = evicting_message(evicting)
        if self.allow_evicting:
            log.warning("%s (serving anyway: --allow-evicting-redis)", message)
            return
        if starting:
            raise EvictingRedisError(message)
        self.refusal = EvictingRedisError(message)
        log.error("%s. This worker serves nothing until then.", message)
