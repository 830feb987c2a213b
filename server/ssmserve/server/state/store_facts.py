"""What a worker checks about the store itself, not about its sessions.

- **Its identity** (:class:`StoreIdentity`): a random id and a creation time in one key
  (``store_layout.store_identity_key``), written once by the first worker that finds none.
  A Redis that was wiped (FLUSHALL, restarted without persistence, an empty replacement)
  has another identity, or none: the sessions a worker holds in memory are gone from it.
- **Its eviction policy** (:class:`EvictionPolicies`): ``maxmemory-policy`` of every
  server that holds sessions. Any policy but ``noeviction`` lets Redis delete keys when
  it fills up: session metadata, logged inputs, leases and registry entries vanish
  without an error, so acknowledged steps are lost and a session may get two owners.
- **Its replicas** (:class:`ReplicaConfirmation`): how many each server that holds
  sessions has, hence how many confirm each write (Redis WAIT) before it counts as done.

:class:`StoreFactReads` reads them (``Store`` has its methods: ``Store.store_identity``,
``Store.eviction_policies``, ``Store.settle_replica_confirmation``);
``cluster.store_guard`` decides what identity and policy mean.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from ssmserve.server.errors import clip
from ssmserve.server.state import store_layout as layout
from ssmserve.server.state.store_calls import StoreCalls
from ssmserve.server.state.store_errors import StoreError, StoreUnavailableError

#: The only ``maxmemory-policy`` under which Redis never deletes a key on its own.
NO_EVICTION = "noeviction"


@dataclass(frozen=True)
class StoreIdentity:
    """Who the store is: a random id and when it was made (seconds since the epoch)."""

    store_id: str
    created_at: float

    @classmethod
    def new(cls) -> StoreIdentity:
        return cls(secrets.token_hex(8), time.time())

    def to_value(self) -> str:
        return f"{self.store_id} {self.created_at!r}"

    @classmethod
    def from_value(cls, raw: bytes) -> StoreIdentity:
        """The identity a key holds; a value this worker did not write is taken whole as
        the id (so it still compares unequal to any other)."""
        text = raw.decode(errors="replace")
        store_id, _, created = text.partition(" ")
        try:
            return cls(store_id, float(created))
        except ValueError:
            return cls(text[:200], 0.0)

    def describe(self) -> str:
        made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created_at))
        return f"{self.store_id} (made {made})"


@dataclass(frozen=True)
class EvictionPolicies:
    """``maxmemory-policy`` of each server that holds sessions, by its address; or why it
    could not be read (CONFIG and INFO both refused: a managed Redis, an ACL user)."""

    by_server: dict[str, str] = field(default_factory=dict)
    unreadable: str = ""  # '' when every server's policy was read

    @property
    def evicting(self) -> dict[str, str]:
        """The servers whose policy lets Redis delete keys, with that policy."""
        return {s: p for s, p in sorted(self.by_server.items()) if p != NO_EVICTION}


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


class StoreFactReads(StoreCalls):
    """The store's reads of its own facts (``Store`` has these methods)."""

    async def replica_counts(self) -> dict[str, int]:
        """Replicas of each server that holds sessions (the one server, the master behind
        Sentinel, or every master of a cluster): those connected to it now (``ROLE``), or
        more where the topology knows more, up or down: Sentinel's list of its master's
        replicas, a cluster master's (``CLUSTER REPLICAS``). A replica away just now (a
        failover's old master not yet rejoined, a replica restarting) still counts: a
        worker that starts in that window must not acknowledge writes no replica holds
        (the nemesis, Sentinel seed 3: a worker started while the new master had no
        replica yet acknowledged 242 steps that the next failover threw away)."""

        async def read() -> dict[str, int]:
            if isinstance(self.redis, RedisCluster):
                await self.redis.initialize()  # the masters are known once it has run
                targets = [(n.name, {"target_nodes": n}) for n in self.redis.get_primaries()]
            else:
                targets = [("redis", {})]
            counts = {}
            for name, where in targets:
                role = await self.redis.execute_command("ROLE", **where)
                counts[name] = len(role[2]) if role and role[0] in (b"master", "master") else 0
                if where:  # a cluster master: the replicas the cluster knows of it
                    me = await self.redis.execute_command("CLUSTER MYID", **where)
                    known = await self.redis.execute_command("CLUSTER REPLICAS", me, **where)
                    counts[name] = max(counts[name], len(known or ()))
            if (known := await self._sentinel_replicas()) is not None:
                counts["redis"] = max(counts["redis"], known)
            return counts

        return await self._call("replica_counts", read)

    async def _sentinel_replicas(self) -> int | None:
        """How many replicas the sentinels know of their master, up or down (the first
        sentinel that answers); None without Sentinel or with none answering."""
        pool = getattr(self.redis, "connection_pool", None)
        if not isinstance(pool, SentinelConnectionPool):
            return None
        for sentinel in pool.sentinel_manager.sentinels:
            try:
                return len(await sentinel.sentinel_slaves(pool.service_name))
            except (redis_errors.ConnectionError, redis_errors.ResponseError, TimeoutError):
                continue
        return None

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
        sessions have (:meth:`replica_counts`: the fewest any of them has), else 0.

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
        targets = await self._session_servers()

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
        return await self._setting("maxmemory-policy", "memory", "maxmemory_policy", where)

    async def fsync_policies(self) -> dict[str, str]:
        """``appendfsync`` of every server that holds sessions whose AOF is on, by its
        address (servers whose settings cannot be read are left out: a managed Redis)."""
        targets = await self._session_servers()

        async def read() -> dict[str, str]:
            by_server: dict[str, str] = {}
            for name, where in targets:
                try:
                    aof = await self._setting("appendonly", "persistence", "aof_enabled", where)
                    if aof in ("yes", "1"):
                        by_server[name] = await self._setting(
                            "appendfsync", "persistence", "", where
                        )
                except redis_errors.ResponseError:
                    continue
            return by_server

        return await self._call("fsync_policy", read)

    async def _session_servers(self) -> list[tuple[str, dict[str, Any]]]:
        """Each server that holds sessions, by a name for people, with how to reach it."""
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()  # the masters are known once it has run
            return [(n.name, {"target_nodes": n}) for n in self.redis.get_primaries()]
        if self.topology == "sentinel":
            return [("the Sentinel master", {})]
        at = self.redis.connection_pool.connection_kwargs
        return [(at.get("path") or f"{at.get('host')}:{at.get('port')}", {})]

    async def _setting(self, name: str, section: str, info_key: str, where: dict[str, Any]) -> str:
        """A server's setting ``name``: CONFIG GET, else ``info_key`` of INFO ``section``."""
        try:
            got = await self.redis.config_get(name, **where)
            value = got.get(name.encode(), got.get(name))
        except redis_errors.ResponseError as config_refused:
            if not info_key:
                raise
            try:
                value = (await self.redis.info(section, **where)).get(info_key)
            except redis_errors.ResponseError as info_refused:
                raise redis_errors.ResponseError(
                    f"CONFIG GET: {config_refused}; INFO: {info_refused}"
                ) from None
        if value is None:
            raise redis_errors.ResponseError(f"neither CONFIG GET nor INFO names {name}")
        return value.decode() if isinstance(value, bytes) else str(value)
