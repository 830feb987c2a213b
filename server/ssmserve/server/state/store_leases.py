"""The store's lease operations: a session's lease taken (a new fencing token), renewed,
released, reserved for a hand-off and taken back, and who holds it (``Store`` has these
methods; the scripts are ``store_layout``'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from ssmserve.server.errors import SsmserveError
from ssmserve.server.observability.metrics import Metrics
from ssmserve.server.state import store_layout as layout
from ssmserve.server.state.lease import SessionLease, new_incarnation, new_nonce
from ssmserve.server.state.store_calls import StoreCalls, StoreSettings
from ssmserve.server.state.store_errors import LeaseHeldError, reply_fields
from ssmserve.server.state.store_records import LeaseHolder, WorkerRecord

#: A load's ACQUIRE returns the checkpoint it restores from when it is at most this big
#: (one round trip fewer); a bigger one is read on its own, where copying it through Lua
#: would cost more than the round trip (2 ms more per MiB, measured beside a direct read).
INLINE_CHECKPOINT_BYTES = 128 << 10


class LeaseCalls(StoreCalls):
    """The store's lease operations (``Store`` has these methods)."""

    def __init__(self, settings: StoreSettings, metrics: Metrics | None = None) -> None:
        super().__init__(settings, metrics)
        self._acquire = self.redis.register_script(layout.ACQUIRE)
        self._renew = self.redis.register_script(layout.RENEW)
        self._renew_many = self.redis.register_script(layout.RENEW_MANY)
        self._release = self.redis.register_script(layout.RELEASE)
        self._handoff = self.redis.register_script(layout.HANDOFF)
        self._cancel_handoff = self.redis.register_script(layout.CANCEL_HANDOFF)

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
        raw = await self._acquire_reply(
            session_id, worker_id, address, lease_ms, expect, numerics, proof, load=False
        )
        return reply_fields(raw)[1]

    async def _acquire_reply(
        self,
        session_id: str,
        worker_id: str,
        address: str,
        lease_ms: int,
        expect: str,
        numerics: str,
        proof: str,
        load: bool,
        expected_snapshot: str = "",
    ) -> list[Any]:
        """The ACQUIRE script's reply when it took the lease; raises its refusals. A load
        (``load``) that expects to restore from ``expected_snapshot`` reads its record and
        first piece in the same call."""
        k = self.keys(session_id)
        args = [worker_id, address, lease_ms, expect, new_incarnation(), numerics, new_nonce(),
                proof, expected_snapshot, INLINE_CHECKPOINT_BYTES]  # fmt: skip
        keys = [k.meta, k.lease, k.snaps] if load else [k.meta, k.lease]
        if load and expected_snapshot:
            keys += [k.snap(expected_snapshot), k.blob(expected_snapshot, 0)]
        raw = await self._script("acquire", self._acquire, keys, args)
        # A load's reply goes on after the token with the snapshot's piece (MiBs) and the
        # meta's bytes, which are not text: of a success only the head is read as text.
        head = raw[:3] if isinstance(raw, list) and raw and raw[0] == b"OK" else raw
        reply = reply_fields(head)
        if reply[0] == "ERR_OWNED":
            owner, ttl, beat, owner_lease_ms = reply[2], reply[3], reply[4], reply[5]
            owner_id = reply[6] if len(reply) > 6 else ""
            raise LeaseHeldError(
                f"session {session_id!r} is served by worker {owner or '(unknown)'}"
                + ("" if ttl.isdigit() and int(ttl) > 0 else f" ({reply[1]})"),
                owner=owner,
                retry_after_ms=max(0, int(ttl) if ttl.isdigit() else 0),
                beat=beat,
                owner_lease_ms=int(owner_lease_ms) if owner_lease_ms.isdigit() else 0,
                owner_id=owner_id,
            )
        self._check(head)
        result: list[Any] = raw
        return result

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

    async def handoff(
        self, lease: SessionLease, target: WorkerRecord, lease_ms: int, step: int = -1
    ) -> str:
        """Reserve the session for ``target``: only it may acquire it next. Returns the id
        of the newest snapshot at or before ``step`` (the session's; -1: its durable step
        and none before it), '' when there is none: the one round trip tells the owner
        which snapshot the target loads from."""
        k = self.keys(lease.session_id)
        at = "+inf" if step < 0 else step
        args = [lease.holder, lease.token, target.worker_id, target.address, lease_ms, at]
        reply = await self._script("handoff", self._handoff, [k.meta, k.lease, k.snaps], args)
        fields = self._fenced(reply)
        return fields[1] if len(fields) > 1 else ""

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
