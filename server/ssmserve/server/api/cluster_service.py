"""The gRPC edge of the cluster operations: ListWorkers, Migrate, Drain, Undrain,
AdoptSession, LoadModel, UnloadModel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import grpc

from ssmserve.server.api import status
from ssmserve.server.api.conversions import model_to_pb
from ssmserve.server.api.heartbeats import with_heartbeats
from ssmserve.server.api.imports import RequestError
from ssmserve.server.cluster.ownership import Ownership
from ssmserve.server.cluster.peers import Peers
from ssmserve.server.errors import clip
from ssmserve.server.sessions.manager import SessionManager
from ssmserve.server.sessions.migration import Migrator, UnknownWorkerError
from ssmserve.server.state.store_records import WorkerRecord
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc


class ModelAdmin(Protocol):
    """What LoadModel and UnloadModel ask of the worker (``Worker``)."""

    async def load_model(self, key: str, directory: Path) -> None: ...

    async def unload_model(self, key: str) -> None: ...


class ClusterService(pb_grpc.ClusterServiceServicer):
    """``peers`` relays a Drain or Undrain of another worker; ``manager`` says which
    models are served and resident; ``models`` loads and unloads them."""

    def __init__(
        self,
        migrator: Migrator,
        ownership: Ownership,
        peers: Peers,
        manager: SessionManager,
        models: ModelAdmin,
    ) -> None:
        self.migrator = migrator
        self.ownership = ownership
        self.peers = peers
        self.manager = manager
        self.models = models

    async def LoadModel(
        self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        async with status.edge(context):
            if not request.key or not request.directory:
                raise RequestError("LoadModel needs a key (NAME[@VERSION]) and a directory")
            await self.models.load_model(request.key, Path(request.directory))
            return self._models()

    async def UnloadModel(
        self, request: pb.UnloadModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        async with status.edge(context):
            await self.models.unload_model(request.key)
            return self._models()

    def _models(self) -> pb.ListModelsResponse:
        manager = self.manager
        resident = manager.resident_models()
        return pb.ListModelsResponse(
            worker=self.ownership.address,
            models=[model_to_pb(k, manager.models, resident[k]) for k in sorted(manager.models)],
        )

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        async with status.edge(context):
            workers = await self.ownership.live_workers()
            return pb.ListWorkersResponse(workers=[worker_to_pb(w) for w in workers])

    async def Migrate(
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateResponse:
        async with status.edge(context):
            if not request.session_id or not request.target:
                raise RequestError("migrate needs a session_id and a target (HOST:PORT)")
            result = await self.migrator.migrate(request.session_id, request.target)
            return pb.MigrateResponse(
                session_id=result.session_id,
                source=result.source,
                target=result.target,
                step=result.step,
                snapshot_id=result.snapshot_id,
                elapsed_ms=result.elapsed_ms,
            )

    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DrainProgress]:
        async with status.edge(context):
            if await self._elsewhere(request.worker):
                progress = self.peers.drain(request.worker)
            else:
                progress = self._own_drain()
            last = pb.DrainProgress()

            def heartbeat() -> pb.DrainProgress:
                return pb.DrainProgress(done=last.done, total=last.total, heartbeat=True)

            every = self.migrator.settings.drain_heartbeat_s
            async for p in with_heartbeats(progress, every, heartbeat):
                if not p.heartbeat:
                    last = p
                yield p

    async def _own_drain(self) -> AsyncIterator[pb.DrainProgress]:
        async for p in self.migrator.drain():
            yield pb.DrainProgress(
                session_id=p.session_id, target=p.target, done=p.done, total=p.total, error=p.error
            )

    async def Undrain(
        self, request: pb.UndrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        async with status.edge(context):
            if await self._elsewhere(request.worker):
                return await self.peers.undrain(request.worker)
            await self.migrator.undrain()
            return worker_to_pb(self.ownership.record())

    async def _elsewhere(self, worker: str) -> bool:
        """Whether a Drain or Undrain of ``worker`` is for another (live) worker to do."""
        if not worker or worker == self.ownership.address:
            return False
        if await self.ownership.worker_at(worker) is None:
            raise UnknownWorkerError(f"no live worker is registered at {clip(worker)}")
        return True

    async def AdoptSession(
        self, request: pb.AdoptSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdoptSessionResponse:
        async with status.edge(context):
            step, epoch = await self.migrator.adopt(request.session_id)
            return pb.AdoptSessionResponse(step=step, epoch=epoch)


def worker_to_pb(w: WorkerRecord) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=w.worker_id,
        address=w.address,
        models=list(w.models),
        load=w.load,
        started_at=w.started_at,
        heartbeat_at=w.heartbeat_at,
        draining=w.draining,
        numerics=w.numerics,
        stats=pb.WorkerStats(
            steps=w.stats.steps,
            snapshots=w.stats.snapshots,
            open_streams=w.stats.open_streams,
            step_p50_ms=w.stats.step_p50_ms,
            step_p99_ms=w.stats.step_p99_ms,
            memory_held_bytes=w.stats.memory_held,
            memory_budget_bytes=w.stats.memory_budget,
        ),
    )
