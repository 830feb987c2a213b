"""Readiness: the health a worker reports for "", its SessionService and ClusterService.

A worker is ready (SERVING) while it takes work and its store answers. Two things make
it NOT_SERVING, and either is enough: a drain (set when it starts, cleared by undrain),
and a store that does not answer. A cheap periodic PING (``check_every_s``, bounded by
the store's own command deadline) follows the store, whatever it is (embedded, a
server, Sentinel, Cluster): a worker whose Redis died or stalls past ``--redis-timeout``
turns NOT_SERVING within one period after that, so Docker's and Kubernetes' readiness
probes take it out of rotation, and SERVING again after the first PING that is answered,
unless it is draining: a draining worker never turns SERVING by itself.

``ssmserve.v1.Liveness`` is not touched here: it is SERVING from start to exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2

from ssmserve.server.errors import SsmserveError

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ReadinessSettings:
    # One PING per period; a dead store is seen within this (a stalled one within this
    # plus --redis-timeout, the PING's own deadline).
    check_every_s: float = 1.0


class Readiness:
    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        services: Sequence[str],
        ping: Callable[[], Awaitable[None]],
        settings: ReadinessSettings,
    ) -> None:
        self.servicer = servicer
        self.services = tuple(services)
        self.ping = ping
        self.settings = settings
        self.draining = False
        self.store_answers = True
        self.checks = 0  # PINGs done, answered or not (tests wait on it)
        self._task: asyncio.Task[None] | None = None

    @property
    def serving(self) -> bool:
        return self.store_answers and not self.draining

    async def set_draining(self, draining: bool) -> None:
        self.draining = draining
        await self._publish()

    async def _publish(self) -> None:
        status = SERVING if self.serving else NOT_SERVING
        for service in self.services:
            await self.servicer.set(service, status)

    async def start(self) -> None:
        """Publish the current state and follow the store from now on."""
        await self._publish()
        self._task = asyncio.create_task(self._watch(), name="readiness")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_every_s)
            try:
                await self.ping()
                answers, why = True, ""
            except SsmserveError as exc:
                answers, why = False, str(exc)
            self.checks += 1
            if answers == self.store_answers:
                continue
            self.store_answers = answers
            if answers:
                log.warning(
                    "the store answers again%s",
                    "" if self.serving else " (still NOT_SERVING: the worker is draining)",
                )
            else:
                log.error("the store does not answer (%s): health is NOT_SERVING", why)
            await self._publish()
