"""Who serves what: this worker's entry in the registry, and the leases of its sessions.

A worker registers itself (id, advertised address, models, load) under a key that expires
``worker_ttl_s`` after its last heartbeat, so the registry lists live workers only. Each
resident session is held by a lease that expires ``lease_ttl_s`` after its last renewal;
one background task renews the worker's entry and all of its leases (one pipeline) every
``renew_every_s``. A lease that cannot be renewed because another worker acquired the
session (its epoch moved on) means this worker lost the session: it drops it at once.

The fencing itself is in Redis (``server/store.py``): every write carries the owner's
epoch, so even a worker that has not noticed yet cannot change a session it lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.errors import SsmserveError
from server.store import Store, WorkerRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnershipSettings:
    """Lease and heartbeat timing (documented defaults)."""

    # A session's lease runs this long after its last renewal: the longest a crashed
    # worker's sessions wait before another worker may take them over.
    lease_ttl_s: float = 5.0
    # The registry entry of a worker that stopped heartbeating disappears after this.
    worker_ttl_s: float = 5.0
    # How often the heartbeat and the lease renewal run; 0: a third of the shorter TTL.
    renew_every_s: float = 0.0

    @property
    def lease_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    @property
    def period_s(self) -> float:
        return self.renew_every_s or min(self.lease_ttl_s, self.worker_ttl_s) / 3


def new_worker_id() -> str:
    return f"{socket.gethostname()[:32]}-{secrets.token_hex(4)}"


class Ownership:
    """This worker's identity and its leases.

    ``held`` returns the ``(session id, epoch)`` of every resident session; ``on_lost`` is
    called with a session id and the error when its lease turned out to be someone else's.
    """

    def __init__(
        self,
        store: Store,
        settings: OwnershipSettings,
        address: str,
        models: Sequence[str],
        held: Callable[[], list[tuple[str, int]]],
        on_lost: Callable[[str, SsmserveError], None],
    ) -> None:
        self.store = store
        self.settings = settings
        self.worker_id = new_worker_id()
        self.address = address
        self.models = tuple(models)
        self.draining = False
        self.started_at = time.time()
        self._held = held
        self._on_lost = on_lost
        self._task: asyncio.Task[None] | None = None

    @property
    def lease_ms(self) -> int:
        return self.settings.lease_ms

    async def start(self) -> None:
        await self.heartbeat()
        self._task = asyncio.create_task(self._keep(), name="ownership")

    async def stop(self, deregister: bool = True) -> None:
        """Stop renewing; ``deregister`` removes the registry entry (a crash leaves it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if deregister:
            with contextlib.suppress(SsmserveError):
                await self.store.deregister_worker(self.worker_id)

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.worker_id,
            address=self.address,
            models=self.models,
            load=len(self._held()),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            draining=self.draining,
        )

    async def heartbeat(self) -> None:
        await self.store.register_worker(self.record(), int(self.settings.worker_ttl_s * 1000))

    async def set_draining(self) -> None:
        self.draining = True
        await self.heartbeat()

    async def renew(self) -> None:
        """Extend every held lease; drop the sessions whose lease is someone else's now."""
        held = self._held()
        results = await self.store.renew_leases(held, self.worker_id, self.lease_ms)
        for (session_id, _epoch), error in zip(held, results, strict=True):
            if error is not None:
                log.warning("session %s: lease not renewed: %s", session_id, error)
                self._on_lost(session_id, error)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.period_s)
            try:
                await self.heartbeat()
                await self.renew()
            except SsmserveError as exc:  # Redis away: keep trying; fencing keeps us honest
                log.warning("heartbeat/lease renewal failed: %s", exc)

    # ------------------------------------------------------------------ peers

    async def live_workers(self) -> list[WorkerRecord]:
        return await self.store.live_workers()

    async def worker_at(self, address: str) -> WorkerRecord | None:
        for record in await self.live_workers():
            if record.address == address:
                return record
        return None

    async def targets(self, model: str) -> list[WorkerRecord]:
        """Other live, non-draining workers serving ``model``, least loaded first."""
        return sorted(
            (
                w
                for w in await self.live_workers()
                if w.worker_id != self.worker_id and not w.draining and model in w.models
            ),
            key=lambda w: (w.load, w.address),
        )
