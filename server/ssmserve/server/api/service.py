"""``SessionService``: the handlers of the session RPCs.

The servicer holds no session logic: it turns protobuf messages into calls on the
:class:`~ssmserve.server.sessions.manager.SessionManager` and results back into messages
(``conversions``); Stream's requests and answers go through ``stream_pipeline``, which
queues steps on the :class:`~ssmserve.server.sessions.intake.StepIntake`. Imports are
staged in the ``store`` and decoded within the worker's ``memory`` budget; forks are
placed by the ``migrator``. Errors raised below map to status codes in
``ssmserve.server.api.status``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from ssmserve.server.api import answer_fence, generate_calls, status
from ssmserve.server.api.auth import Authenticator, caller
from ssmserve.server.api.budgets import Budgets, BudgetSettings
from ssmserve.server.api.conversions import (
    RESPONSE_MARGIN,
    config_from_pb,
    event_to_pb,
    forecast_step_to_pb,
    info_to_pb,
    model_to_pb,
    snapshot_to_pb,
)
from ssmserve.server.api.imports import CHUNK_BYTES, CheckpointUpload, RequestError
from ssmserve.server.api.stream_pipeline import StreamReader, answer_responses
from ssmserve.server.api.tenancy import TenantScope
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.observability.metrics import Metrics
from ssmserve.server.observability.recent_latency import RecentLatency
from ssmserve.server.sessions.errors import lease_lapsed
from ssmserve.server.sessions.generation import GenerateSettings, Generations
from ssmserve.server.sessions.intake import StepIntake
from ssmserve.server.sessions.manager import SessionManager
from ssmserve.server.sessions.memory import WorkerMemory
from ssmserve.server.sessions.migration import Migrator
from ssmserve.server.sessions.models import split_key, version_order
from ssmserve.server.sessions.records import RollbackTarget
from ssmserve.server.state import checkpoint_signing
from ssmserve.server.state.store import Store
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class ServiceSettings:
    max_message_bytes: int = 4 << 20  # answers are split to stay below this
    max_steps_per_message: int = 4096
    max_inflight_messages: int = 64  # per stream: messages read ahead of their answers
    max_import_bytes: int = 1 << 30  # largest checkpoint ImportCheckpoint accepts
    # HMAC key for exported checkpoints (state/checkpoint_signing.py); None: unsigned.
    checkpoint_key: bytes | None = None
    require_signed_checkpoints: bool = False  # imports must carry a valid signature
    budgets: BudgetSettings = field(default_factory=BudgetSettings)
    generate: GenerateSettings = field(default_factory=GenerateSettings)


class SessionService(pb_grpc.SessionServiceServicer):
    def __init__(
        self,
        manager: SessionManager,
        intake: StepIntake,
        settings: ServiceSettings,
        migrator: Migrator,
        *,
        store: Store,
        memory: WorkerMemory,
        metrics: Metrics,
        authenticator: Authenticator | None = None,
        refusal: Callable[[], SsmserveError | None] = lambda: None,
    ) -> None:
        self.manager = manager
        self.intake = intake  # Stream's steps are queued here
        self.settings = settings
        self.migrator = migrator  # places forks on other workers
        self.store = store  # ImportCheckpoint stages its chunks here
        self.memory = memory  # the worker's budget: an import is decoded within it
        self.metrics = metrics
        self.authenticator = authenticator  # None or disabled: no tenants
        # Why this worker must not serve now (``serving_gate``); None: it serves.
        self.refusal = refusal
        self.budgets = Budgets(settings.budgets, store, manager.resident_bytes)
        # Generate's steps go through the same intake as Stream's.
        self.generations = Generations(
            manager.loader, intake, manager.replay, manager.residents, settings.generate
        )
        self.open_streams = 0  # Stream calls running now (a vanished client's is reaped)
        self.recent_latency = RecentLatency()  # for the registry entry (ssmserve top)

    def _scope(self, context: grpc.aio.ServicerContext) -> TenantScope:
        """The caller's session ids (the Authorization interceptor let it in already)."""
        if self.authenticator is None:
            return TenantScope()
        return TenantScope.of(caller(self.authenticator, context))

    # ------------------------------------------------------------------ sessions

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            config = config_from_pb(request.config)
            await self.budgets.check_new_session(scope.tenant, scope.prefix)
            view = await self.manager.create(
                request.model, scope.new_id(request.session_id), config
            )
            return info_to_pb(view, scope)

    async def GetSession(
        self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            view = await self.manager.view(scope.stored(request.session_id), owner_only=True)
            return info_to_pb(view, scope)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            models = self.manager.models
            resident = self.manager.resident_models(scope.prefix)
            order = sorted(models, key=lambda k: (split_key(k)[0], version_order(split_key(k)[1])))
            infos = [model_to_pb(key, models, resident[key]) for key in order]
            return pb.ListModelsResponse(worker=self.migrator.address, models=infos)

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            after = scope.stored(request.page_token) if request.page_token else ""
            views, token = await self.manager.list(
                request.page_size, after, request.model, scope.prefix
            )
            # A page holds at most page_size sessions and fits in one message: sessions
            # with many labels and guards are large, so the page may end early.
            budget = self.settings.max_message_bytes - RESPONSE_MARGIN
            infos: list[pb.SessionInfo] = []
            size = 0
            for view in views:
                info = info_to_pb(view, scope)
                n = info.ByteSize() + 8
                if infos and size + n > budget:
                    token = infos[-1].session_id
                    break
                infos.append(info)
                size += n
            else:
                token = scope.shown(token)
            return pb.ListSessionsResponse(sessions=infos, next_page_token=token)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            step, snapshot_id = await self.manager.close(
                scope.stored(request.session_id), request.final_snapshot
            )
            return pb.CloseSessionResponse(step=step, snapshot_id=snapshot_id)

    # ------------------------------------------------------------------ streaming

    async def Stream(
        self,
        request_iterator: AsyncIterator[pb.StreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StreamResponse]:
        # Requests are read ahead (up to max_inflight_messages) while earlier ones are
        # being stepped; answers go out in request order. Every problem of a step, a
        # redirect included, is answered in its StepResult: ending a bidi call while the
        # client still writes can reach the client as INTERNAL with the real status lost.
        scope = self._scope(context)
        reader = StreamReader(
            self.intake,
            scope,
            self.settings.max_steps_per_message,
            self.settings.max_inflight_messages,
            self.refusal,
        )
        task = asyncio.create_task(reader.run(request_iterator), name="stream-reader")
        budget = self.settings.max_message_bytes - RESPONSE_MARGIN
        self.open_streams += 1
        try:
            latency = self.metrics.step_latency
            while (message := await reader.answers.get()) is not None:
                received, futures, packed, steps, silent = message
                outcomes = [await f for f in futures]
                # Decided as the answers leave, not when they were made (``answer_fence``).
                if fenced := answer_fence.fence_outcomes(outcomes):
                    self.metrics.answers_fenced.inc(fenced)
                for i, response in enumerate(
                    answer_responses(outcomes, scope, packed, budget, silent)
                ):
                    if i and answer_fence.any_stale(outcomes):  # flow control held it back
                        await status.abort(context, answer_fence.lapsed_stream(), scope.clean)
                    yield response
                reader.slots.release()
                answered = time.perf_counter() - received
                self.recent_latency.add(answered, steps)
                latency.observe(answered, steps)  # each of its steps
            await task
            if reader.failure is not None:  # e.g. a message that is not valid protobuf
                await status.abort(context, reader.failure, scope.clean)
        finally:
            self.open_streams -= 1
            task.cancel()  # never blocks: the reader waits only for a slot or a request

    # ------------------------------------------------------------------ snapshots, rollback

    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.SnapshotInfo:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            record = await self.manager.snapshot(scope.stored(request.session_id), request.label)
            return snapshot_to_pb(request.session_id, record)

    async def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            records = await self.manager.list_snapshots(scope.stored(request.session_id))
            return pb.ListSnapshotsResponse(
                snapshots=[snapshot_to_pb(request.session_id, r) for r in records]
            )

    async def Rollback(
        self, request: pb.RollbackRequest, context: grpc.aio.ServicerContext
    ) -> pb.RollbackResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            which = request.WhichOneof("target")
            if which is None:
                raise RequestError(
                    "rollback needs a target: snapshot_id, label, step or steps_back"
                )
            target = RollbackTarget(**{which: getattr(request, which)})
            result = await self.manager.rollback(scope.stored(request.session_id), target)
            return pb.RollbackResponse(
                step=result.step,
                from_snapshot_id=result.from_snapshot_id,
                replayed_steps=result.replayed_steps,
            )

    # ------------------------------------------------------------------ forecast, fork

    async def Forecast(
        self, request: pb.ForecastRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ForecastResponse]:
        scope = self._scope(context)
        started = time.perf_counter()
        with self.budgets.forecasting_or_none(scope.tenant) as slot:
            async with status.edge(context, scope.clean):
                slot.take()  # a tenant past its forecast budget is refused here
                job = await self.manager.forecast(
                    scope.stored(request.session_id),
                    request.horizon,
                    request.at_step if request.HasField("at_step") else None,
                )
            try:
                async for steps in job.batches():
                    if job.lease is not None and not job.lease.valid():  # ``answer_fence``
                        what = f"forecast steps from step {job.from_step}"
                        await status.abort(
                            context, lease_lapsed(request.session_id, what), scope.clean
                        )
                    yield pb.ForecastResponse(
                        from_step=job.from_step,
                        steps=[forecast_step_to_pb(x, request.packed_outputs) for x in steps],
                    )
                if job.stopped is not None:
                    if job.stopped.kind is ErrorKind.UNAVAILABLE:  # the worker stopped: retry
                        await status.abort(context, job.stopped, scope.clean)
                    yield pb.ForecastResponse(
                        from_step=job.from_step,
                        stopped=status.step_error(job.stopped, scope.clean),
                    )
            finally:
                job.close()  # done, or the client went away: stop computing, free memory
                self.metrics.forecast_seconds.observe(time.perf_counter() - started)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        scope = self._scope(context)
        async for response in generate_calls.answer(
            self.generations, request, scope, context, self.refusal
        ):
            yield response

    async def Upgrade(
        self, request: pb.UpgradeRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpgradeResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            view, result = await self.manager.upgrade(
                scope.stored(request.session_id), request.model
            )
            return pb.UpgradeResponse(
                session=info_to_pb(view, scope),
                from_model=result.from_model,
                replayed_from_step=result.replayed_from_step,
                replayed_steps=result.replayed_steps,
            )

    async def GetHistory(
        self, request: pb.GetHistoryRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HistoryChunk]:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            history = await self.manager.history(
                scope.stored(request.session_id), request.from_step, request.to_step
            )
        inputs = np.ascontiguousarray(history.inputs, history.inputs.dtype.newbyteorder("<"))
        outputs = np.ascontiguousarray(history.outputs, "<f4")
        count = len(outputs)
        per_step = max(1, inputs[:1].nbytes + outputs[:1].nbytes)
        per_chunk = max(1, (self.settings.max_message_bytes - RESPONSE_MARGIN) // per_step)
        first = pb.HistoryChunk(
            input_dim=0 if inputs.ndim == 1 else inputs.shape[1],
            output_dim=outputs.shape[1],
            snapshots=[snapshot_to_pb(request.session_id, r) for r in history.snapshots],
            events=[event_to_pb(e) for e in history.events],
        )
        for start in range(0, max(count, 1), per_chunk):
            chunk = first if start == 0 else pb.HistoryChunk()
            n = min(per_chunk, count - start)
            chunk.first_step = history.first_step + start
            chunk.count = n
            chunk.inputs = (
                inputs[start : start + n].astype(inputs.dtype.newbyteorder("<")).tobytes()
            )
            chunk.outputs = outputs[start : start + n].astype("<f4").tobytes()
            yield chunk

    async def Fork(
        self, request: pb.ForkRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForkResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            which = request.WhichOneof("at")
            at = RollbackTarget(**{which: getattr(request, which)}) if which else RollbackTarget()
            await self.budgets.check_new_session(scope.tenant, scope.prefix)
            result = await self.manager.fork(
                scope.stored(request.session_id), at, scope.new_id(request.new_session_id)
            )
            view = result.view
            if await self.migrator.place(view.session_id, request.target):
                view = await self.manager.view(view.session_id)
            return pb.ForkResponse(
                session=info_to_pb(view, scope),
                source_session_id=scope.shown(result.source_session_id),
                step=result.step,
                from_snapshot_id=result.from_snapshot_id,
                replayed_steps=result.replayed_steps,
            )

    # ------------------------------------------------------------------ export, import

    async def ExportCheckpoint(
        self, request: pb.ExportCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CheckpointChunk]:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            blob = await self.manager.export(scope.stored(request.session_id), request.snapshot_id)
            if self.settings.checkpoint_key is not None:
                blob = checkpoint_signing.sign(blob, self.settings.checkpoint_key)
        view = memoryview(blob)
        count = max(1, -(-len(blob) // CHUNK_BYTES))
        for i in range(count):
            yield pb.CheckpointChunk(
                index=i,
                data=bytes(view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]),
                total_size=len(blob),
                last=i == count - 1,
            )

    async def ImportCheckpoint(
        self,
        request_iterator: AsyncIterator[pb.ImportCheckpointRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.SessionInfo:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            # The import budget holds while the chunks are staged in Redis; the worker's
            # memory budget while the checkpoint is held whole, to be decoded.
            with self.budgets.importing(scope.tenant) as buffer:
                await self.budgets.check_new_session(scope.tenant, scope.prefix)
                upload = CheckpointUpload(
                    self.store, self.settings.max_import_bytes, buffer.reserve
                )
                try:
                    await upload.receive(request_iterator)
                    header = upload.header
                    assert header is not None  # receive() checked it
                    with self.memory.reserve(
                        "imports", upload.total, "decoding an imported checkpoint"
                    ):
                        blob, _verified = checkpoint_signing.unwrap(
                            await upload.read(),
                            self.settings.checkpoint_key,
                            self.settings.require_signed_checkpoints,
                        )
                        view = await self.manager.import_checkpoint(
                            blob,
                            scope.stored(header.session_id) if header.session_id else "",
                            header.model,
                            config_from_pb(header.config),
                            header.replace,
                            scope.adopted,
                        )
                finally:
                    await upload.drop()
            return info_to_pb(view, scope)
