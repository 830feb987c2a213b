"""One worker's session components, each made with its real dependencies, no manager.

Tests of one component (the intake, the loader) make it from these parts themselves:
a real :class:`Store` on a test redis-server, a registered :class:`Ownership` renewing
its leases, residency, checkpoints, replay and the model lanes (engine, stepper,
forecaster per model), wired as ``SessionManager`` wires them. Two sets of parts on one
Redis act as two workers: the same keys, their own worker ids and leases.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ssmserve.server.cluster.ownership import Ownership, OwnershipSettings
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.config import SessionDefaults
from ssmserve.server.sessions.forecaster import ForecastSettings
from ssmserve.server.sessions.intake import StepIntake
from ssmserve.server.sessions.lifecycle import Lifecycle
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.memory import WorkerMemory
from ssmserve.server.sessions.model_lanes import ModelLanes
from ssmserve.server.sessions.models import ServedModels
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.stepper import StepperSettings
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings

MEMORY_BUDGET = 1 << 30  # bytes: far more than the tests' few demo sessions hold
STEP_TIMEOUT_S = 10.0  # one step's answer, a load included


@dataclass
class SessionParts:
    """What a loader, an intake or a lifecycle is made from, for one worker."""

    models: ServedModels
    store: Store
    ownership: Ownership
    memory: WorkerMemory
    residents: ResidentSessions
    checkpoints: Checkpoints
    replay: Replay
    lanes: ModelLanes

    def loader(self, max_sessions: int = 100, output_window: int = 64) -> SessionLoader:
        return SessionLoader(
            self.models, self.residents, self.checkpoints, self.replay, self.lanes.notifiers,
            max_sessions, output_window, self.memory,
        )  # fmt: skip

    def lifecycle(self, loader: SessionLoader) -> Lifecycle:
        return Lifecycle(
            self.models, self.residents, self.checkpoints, self.replay, loader,
            self.lanes.engines, SessionDefaults(),
        )  # fmt: skip

    async def close(self, release: bool = True) -> None:
        """Stop the parts; ``release`` False leaves Redis as a crashed worker leaves it
        (its leases held, its registry entry standing)."""
        self.checkpoints.close()
        await self.lanes.stop()
        await self.ownership.stop(deregister=release)
        await self.store.aclose()


async def session_parts(
    redis_url: str,
    models: Mapping[str, MambaModel],
    address: str,
    lease_ttl_s: float = 5.0,
) -> SessionParts:
    """Parts of a worker at ``address`` (registered, never listening: the tests here
    call the components directly), its steppers and forecasters not started."""
    store = Store(StoreSettings(url=redis_url))
    served = ServedModels(dict(models))
    memory = WorkerMemory(MEMORY_BUDGET)
    residents: ResidentSessions | None = None

    def held() -> list:
        return [] if residents is None else residents.held()

    ownership = Ownership(
        store,
        OwnershipSettings(lease_ttl_s=lease_ttl_s, worker_ttl_s=lease_ttl_s),
        address,
        sorted(models),
        "test-numerics",
        held=held,
        on_lost=lambda lease, error: residents.lost_lease(lease, error) if residents else None,
        on_expired=lambda lease: residents.expired_lease(lease) if residents else None,
    )
    residents = ResidentSessions(store, ownership, memory)
    checkpoints = Checkpoints(store, residents, writes_in_flight=2)
    engines: dict[str, EngineLane] = {}
    replay = Replay(store, residents, checkpoints, engines)
    lanes = ModelLanes(
        served, engines, store, residents, checkpoints, replay, StepperSettings(),
        ForecastSettings(),
    )  # fmt: skip
    await ownership.start()
    return SessionParts(served, store, ownership, memory, residents, checkpoints, replay, lanes)


async def step_through(intake: StepIntake, session_id: str, first: int, inputs: np.ndarray) -> None:
    """Steps ``first, first + 1, ...`` of ``inputs``, one by one, each answered without error."""
    for t, value in enumerate(inputs, start=first):
        outcome = await asyncio.wait_for(await intake.submit(session_id, t, value), STEP_TIMEOUT_S)
        assert outcome.error is None, outcome.error


def state_bits(state: SessionState) -> np.ndarray:
    """A whole recurrent state as raw bits (equal only if bit-equal)."""
    return state.packed().view(np.uint8)
