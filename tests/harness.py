"""A real worker for tests: gRPC on a loopback socket, a real redis-server, own event loop.

The worker runs on an asyncio loop in a background thread, exactly as in production
(grpc.aio server, redis.asyncio store); tests talk to it through the real client over
TCP. ``call`` runs a coroutine on the worker's loop for the rare test that must look
inside (e.g. at the manager's resident sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from ssmserve.client.sync import Client
from ssmserve.client.tls import TlsConfig
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.server.worker import Worker, WorkerSettings

T = TypeVar("T")


class WorkerHarness:
    def __init__(
        self,
        models: dict[str, Path],
        redis_url: str,
        *,
        manager: ManagerSettings | None = None,
        client_tls: TlsConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = WorkerSettings(
            models=tuple(models.items()),
            listen="127.0.0.1:0",
            redis_url=redis_url,
            shutdown_grace_s=1.0,
            manager=manager or ManagerSettings(),
            **overrides,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.worker = Worker(self.settings)
        self.address = self.call(self.worker.start())
        self.client = Client(self.address, tls=client_tls)
        self.stopped = False

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def manager(self) -> Any:
        return self.worker.manager

    # The parts of the worker a test looks inside (to drive them, or to put a fault in
    # one), each the object the worker wired into the others.

    @property
    def store(self) -> Any:
        return self.worker.store

    @property
    def memory(self) -> Any:
        """The worker's one memory budget (``WorkerMemory``)."""
        return self.worker.memory

    @property
    def intake(self) -> Any:
        """Where Stream's steps are queued (``StepIntake``)."""
        return self.worker.service.intake

    @property
    def loader(self) -> Any:
        """What loads sessions into memory and unloads or parks them (``SessionLoader``)."""
        return self.worker.manager.loader

    @property
    def checkpoints(self) -> Any:
        return self.worker.manager.checkpoints

    def engine(self, model: str) -> Any:
        """``model``'s engine lane (``EngineLane``: steps, forecasts and replays run on it)."""
        return self.worker.manager.lanes.engines[model]

    def stepper(self, model: str) -> Any:
        return self.worker.manager.lanes.steppers[model]

    def forecaster(self, model: str) -> Any:
        return self.worker.manager.lanes.forecasters[model]

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.client.close()
        self.call(self.worker.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def crash(self) -> None:
        """Stop without the shutdown snapshots: Redis is left as a killed worker leaves it."""
        self.stopped = True
        self.client.close()
        self.call(self.worker.abort())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def saw_lease_unrenewed(self, session_id: str, beat: str) -> None:
        """As if this worker had watched ``session_id``'s lease beat stand at ``beat`` for
        a whole TTL (its owner froze): its next load of the session may take it over
        (``cluster.takeover``). For tests whose owner cannot really freeze (it runs in
        this process) and still must be taken over."""
        from ssmserve.server.state.lease import lease_clock
        from ssmserve.server.state.store_errors import LeaseHeldError

        takeovers = self.worker.ownership.takeovers
        seen = LeaseHeldError("seen", beat=beat)
        self.loop.call_soon_threadsafe(
            lambda: takeovers.saw(session_id, seen, now=lease_clock() - 3600)
        )

    def with_manager(self, **changes: Any) -> ManagerSettings:
        return replace(self.settings.manager, **changes)


@contextlib.contextmanager
def next_engine_call(lane: Any, instead: Callable[..., Awaitable[Any]]) -> Iterator[None]:
    """The next ``lane.step`` (an ``EngineLane``'s batch of steps) runs
    ``instead(step, states, values)``, ``step`` being the real one; later calls compute as
    usual. The real step is back on exit, whether or not the replacement ran."""
    step = lane.step

    async def once(states: Any, values: Any) -> Any:
        lane.step = step
        return await instead(step, states, values)

    lane.step = once
    try:
        yield
    finally:
        lane.step = step
