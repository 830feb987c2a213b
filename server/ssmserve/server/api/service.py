"""The gRPC edge: requests in, validated and converted; typed errors out as statuses.

The servicer holds no session logic: it turns protobuf messages into calls on the
:class:`~ssmserve.server.sessions.manager.SessionManager` and results back into messages.
Errors raised below map to status codes in ``ssmserve.server.api.status``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from ssmserve.client.step_values import vector_array
from ssmserve.server.api import status
from ssmserve.server.api.auth import Authenticator, caller
from ssmserve.server.api.budgets import Budgets, BudgetSettings
from ssmserve.server.api.imports import CHUNK_BYTES, CheckpointUpload, RequestError
from ssmserve.server.api.tenancy import TenantScope, tenant_of
from ssmserve.server.cluster.migration import Migrator
from ssmserve.server.errors import ErrorKind, SsmserveError, being_cancelled, clip
from ssmserve.server.observability.recent_latency import RecentLatency
from ssmserve.server.sessions.config import Durability, SessionConfig
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.forecaster import ForecastStep
from ssmserve.server.sessions.guards import (
    GuardAction,
    GuardCheck,
    GuardEvent,
    GuardRule,
    GuardRuleError,
)
from ssmserve.server.sessions.manager import SessionManager
from ssmserve.server.sessions.models import ServedModels, split_key, version_order
from ssmserve.server.sessions.records import RollbackTarget, SessionView
from ssmserve.server.sessions.session import (
    SessionGoneError,
    SnapshotEvent,
    StepOutcome,
    StepRun,
)
from ssmserve.server.state import checkpoint_signing
from ssmserve.server.state.store import SnapshotRecord
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class StreamLimitError(SsmserveError):
    """A stream message carries more steps than a message may."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


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


class SessionService(pb_grpc.SessionServiceServicer):
    def __init__(
        self,
        manager: SessionManager,
        settings: ServiceSettings,
        migrator: Migrator,
        authenticator: Authenticator | None = None,
        refusal: Callable[[], SsmserveError | None] = lambda: None,
    ) -> None:
        self.manager = manager
        self.settings = settings
        self.migrator = migrator  # places forks on other workers
        self.authenticator = authenticator  # None or disabled: no tenants
        # Why this worker must not serve now (``serving_gate``); None: it serves.
        self.refusal = refusal
        self.budgets = Budgets(settings.budgets, manager.store, manager.residents.footprint_of)
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
            return info_to_pb(await self.manager.view(scope.stored(request.session_id)), scope)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        scope = self._scope(context)
        async with status.edge(context, scope.clean):
            models = self.manager.models
            resident = Counter(
                s.model_name
                for s in self.manager.residents.by_id.values()
                if s.id.startswith(scope.prefix)
            )
            order = sorted(models, key=lambda k: (split_key(k)[0], version_order(split_key(k)[1])))
            infos = [model_to_pb(key, models, resident[key]) for key in order]
            return pb.ListModelsResponse(worker=self.manager.ownership.address, models=infos)

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
            budget = self.settings.max_message_bytes - _RESPONSE_MARGIN
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
        reader = _StreamReader(self.manager, self.settings, scope, self.refusal)
        task = asyncio.create_task(reader.run(request_iterator), name="stream-reader")
        budget = self.settings.max_message_bytes - _RESPONSE_MARGIN
        self.open_streams += 1
        try:
            latency = self.manager.metrics.step_latency
            while (message := await reader.answers.get()) is not None:
                received, futures, packed, steps = message
                outcomes = [await f for f in futures]
                for response in answer_responses(outcomes, scope, packed, budget):
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
                async for steps in job.batches(self.manager.settings.forecast.message_bytes):
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
                self.manager.metrics.forecast_seconds.observe(time.perf_counter() - started)

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
        per_chunk = max(1, (self.settings.max_message_bytes - _RESPONSE_MARGIN) // per_step)
        first = pb.HistoryChunk(
            input_dim=0 if inputs.ndim == 1 else inputs.shape[1],
            output_dim=outputs.shape[1],
            snapshots=[snapshot_to_pb(request.session_id, r) for r in history.snapshots],
            events=[_event_to_pb(e) for e in history.events],
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
            if request.target or self.manager.ownership.draining:
                await self.migrator.place(view.session_id, request.target)
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
                    self.manager.store, self.settings.max_import_bytes, buffer.reserve
                )
                try:
                    await upload.receive(request_iterator)
                    header = upload.header
                    assert header is not None  # receive() checked it
                    with self.manager.memory.reserve(
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


class _StreamReader:
    """Reads one Stream's requests and queues the futures of their steps.

    The queue is unbounded; ``slots`` bounds how many messages are read ahead of their
    answers, so cancelling the stream (the client went away) never leaves the reader
    blocked on a full queue.
    """

    def __init__(
        self,
        manager: SessionManager,
        settings: ServiceSettings,
        scope: TenantScope,
        refusal: Callable[[], SsmserveError | None] = lambda: None,
    ) -> None:
        self.manager = manager
        self.settings = settings
        self.scope = scope
        self.refusal = refusal  # set: every step is answered with it, none is applied
        # Per message: when it arrived, the futures of its steps (one per step or run),
        # whether it asked for packed outputs, how many steps it has.
        self.answers: asyncio.Queue[tuple[float, list[_Answer], bool, int] | None] = asyncio.Queue()
        self.slots = asyncio.Semaphore(settings.max_inflight_messages)
        self.failure: SsmserveError | None = None

    async def run(self, request_iterator: AsyncIterator[pb.StreamRequest]) -> None:
        requests = request_iterator.__aiter__()
        try:
            while True:
                await self.slots.acquire()
                try:
                    request = await requests.__anext__()
                except StopAsyncIteration:
                    return
                received = time.perf_counter()
                futures = await self._submit(request)
                self.answers.put_nowait(
                    (received, futures, request.packed_outputs, len(request.steps))
                )
        except SsmserveError as exc:
            self.failure = exc
        finally:
            self.answers.put_nowait(None)

    async def _submit(self, request: pb.StreamRequest) -> list[_Answer]:
        loop = asyncio.get_running_loop()
        futures: list[_Answer] = []
        if (refusal := self.refusal()) is not None:
            for step in request.steps:
                future = loop.create_future()
                future.set_result(StepOutcome(step.session_id, step.step, error=refusal))
                futures.append(future)
            return futures
        limit = self.settings.max_steps_per_message
        steps = request.steps
        too_many = len(steps) > limit
        packed = None if too_many else PackedInputs.of(steps)
        i = 0
        stepwise = 0  # steps before this index go one by one (their run was refused)
        while i < len(steps):
            step = steps[i]
            if not too_many and i >= stepwise and (end := run_end(steps, i)) - i > 1:
                run = self._submit_run(steps, packed, i, end)
                if run is not None:
                    futures.append(run)
                    i = end
                    continue
                stepwise = end
            try:
                if too_many:
                    raise StreamLimitError(
                        f"a message may carry at most {limit} steps, this one has "
                        f"{len(request.steps)}; none of them was applied"
                    )
                sid = self.scope.stored(step.session_id)
                finite = packed is not None
                value = packed.value(i) if packed is not None else step_value(step)
                future = self.manager.intake.submit_resident(sid, step.step, value, finite)
                if future is None:  # not in memory: load it first
                    future = await self.manager.intake.submit(sid, step.step, value, finite)
            except SsmserveError as exc:
                future = loop.create_future()
                future.set_result(StepOutcome(step.session_id, step.step, error=exc))
            except asyncio.CancelledError:
                if being_cancelled():  # this stream is ending
                    raise
                # Something this step waited on was cancelled under it, not this stream.
                # Ending the stream with that CancelledError would never reach the client
                # (gRPC sends no status for it): answer the step with a retryable error.
                future = loop.create_future()
                error = SessionGoneError(
                    f"step {step.step} of session {clip(step.session_id)} was interrupted "
                    "on this worker; retry"
                )
                future.set_result(StepOutcome(step.session_id, step.step, error=error))
            futures.append(future)
            i += 1
        return futures

    def _submit_run(
        self, steps: Sequence[pb.StepInput], packed: PackedInputs | None, lo: int, hi: int
    ) -> asyncio.Future[StepRun] | None:
        """Steps ``lo:hi`` of a message (one session, consecutive step numbers) queued as
        one run; None when they go step by step (then each step's checks answer it)."""
        values = run_values(steps, packed, lo, hi)
        if values is None:
            return None
        try:
            sid = self.scope.stored(steps[lo].session_id)
        except SsmserveError:
            return None
        return self.manager.intake.submit_run_resident(sid, steps[lo].step, values)


#: A step's answer to come: its own outcome, or a run of steps of one session.
_Answer = asyncio.Future[StepOutcome] | asyncio.Future[StepRun]


def run_end(steps: Sequence[pb.StepInput], lo: int) -> int:
    """The end of the run of steps starting at ``lo``: the steps after it of the same
    session with consecutive step numbers."""
    first = steps[lo]
    sid, step = first.session_id, first.step
    hi = lo + 1
    while hi < len(steps):
        nxt = steps[hi]
        step += 1
        if nxt.step != step or nxt.session_id != sid:
            break
        hi += 1
    return hi


def run_values(
    steps: Sequence[pb.StepInput], packed: PackedInputs | None, lo: int, hi: int
) -> np.ndarray | None:
    """The inputs of steps ``lo:hi`` as one array: token ids ``(T,)`` int64, or finite
    vectors of one width ``(T, i)`` float32. None for anything else (mixed kinds, a
    malformed or non-finite vector): those steps go one by one, each checked alone."""
    if packed is not None:  # the whole message decoded and checked finite at once
        return packed.rows(lo, hi)
    part = steps[lo:hi]
    kinds = {step.WhichOneof("value") for step in part}
    if kinds == {"token"}:
        return np.fromiter((step.token for step in part), np.int64, len(part))
    if kinds != {"vector"}:
        return None
    try:
        rows = [vector_value(step.vector, "") for step in part]
    except RequestError:  # malformed: each step's own check says how
        return None
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        return None
    values = np.stack(rows)  # (T, i)
    return values if np.isfinite(values).all() else None


#: Room left in a message for what is not results (framing, the continued flag).
_RESPONSE_MARGIN = 64 << 10


def answer_responses(
    outcomes: Sequence[StepOutcome | StepRun], scope: TenantScope, packed: bool, budget: int
) -> Iterator[pb.StreamResponse]:
    """The answers to one request: built in place in one response (each StepResult added
    to it, its size computed once, in C), split by :func:`split_results` only when they
    exceed ``budget``. Building each result alone and copying it in cost ~2x the CPU."""
    response = pb.StreamResponse()
    add = response.results.add
    for outcome in outcomes:
        if isinstance(outcome, StepRun):
            fill_run_results(add, outcome, scope, packed)
        else:
            fill_result(add(), outcome, scope, packed)
    if response.ByteSize() <= budget:
        yield response
    else:
        yield from split_results(list(response.results), budget)


def split_results(results: list[pb.StepResult], budget: int) -> Iterator[pb.StreamResponse]:
    """The answers to one request, in responses of at most ``budget`` bytes each (all but
    the last marked ``continued``). One result always fits: the worker refuses models
    whose single output could not (``Worker.start``)."""
    batch: list[pb.StepResult] = []
    size = 0
    for result in results:
        n = result.ByteSize() + 8  # tag and length prefix
        if batch and size + n > budget:
            yield pb.StreamResponse(results=batch, continued=True)
            batch, size = [], 0
        batch.append(result)
        size += n
    yield pb.StreamResponse(results=batch)


# ---------------------------------------------------------------------------- conversions

_ALL = TenantScope()  # ids as stored (no tenant to take out)


class PackedInputs:
    """The inputs of a message whose steps all carry packed vectors, decoded at once: one
    float32 array, every value checked finite (:meth:`of`). Step ``i``'s vector is
    ``flat[starts[i]:starts[i + 1]]``.

    Why: high-rate streams send hundreds of packed steps per message, and decoding and
    checking each alone cost ~5 us of the server's CPU per step; this is ~0.5. A run of
    steps is a view of ``flat`` too (:meth:`rows`), with no copy per step.
    """

    __slots__ = ("flat", "starts")

    def __init__(self, flat: np.ndarray, starts: list[int]) -> None:
        self.flat = flat  # (sum of widths,) float32, owned
        self.starts = starts  # len(steps) + 1 offsets into flat

    @classmethod
    def of(cls, steps: Sequence[pb.StepInput]) -> PackedInputs | None:
        """None when any step carries something else (a token, ``values``, nothing) or a
        vector that is malformed or not finite: such a message is decoded step by step,
        which names the step at fault."""
        blobs = []
        starts = [0]
        end = 0
        for step in steps:
            vector = step.vector
            blob = vector.packed
            if not blob or len(blob) % 4 or vector.values:
                return None
            blobs.append(blob)
            end += len(blob) >> 2
            starts.append(end)
        flat = np.frombuffer(b"".join(blobs), "<f4").astype(np.float32)  # one owned copy
        return cls(flat, starts) if np.isfinite(flat).all() else None

    def value(self, i: int) -> np.ndarray:
        """Step ``i``'s vector (a view)."""
        return self.flat[self.starts[i] : self.starts[i + 1]]

    def rows(self, lo: int, hi: int) -> np.ndarray | None:
        """Steps ``lo:hi`` as one (T, i) view when their vectors have one width, else None."""
        starts = self.starts
        width = starts[lo + 1] - starts[lo]
        for j in range(lo + 1, hi):
            if starts[j + 1] - starts[j] != width:
                return None
        return self.flat[starts[lo] : starts[hi]].reshape(hi - lo, width)


def step_value(step: pb.StepInput) -> int | np.ndarray:
    which = step.WhichOneof("value")
    if which == "token":
        return int(step.token)
    if which == "vector":
        return vector_value(step.vector, f"step {step.step} of session {step.session_id!r}")
    raise RequestError(f"step {step.step} of session {step.session_id!r} carries no input")


_ACTIONS = {
    pb.GuardRule.ACTION_UNSPECIFIED: GuardAction.REPORT,
    pb.GuardRule.ACTION_REPORT: GuardAction.REPORT,
    pb.GuardRule.ACTION_CLAMP: GuardAction.CLAMP,
    pb.GuardRule.ACTION_REJECT: GuardAction.REJECT,
    pb.GuardRule.ACTION_ROLLBACK: GuardAction.ROLLBACK,
}
_CHECKS = {pb.GuardRule.CHECK_FINITE: GuardCheck.FINITE, pb.GuardRule.CHECK_RANGE: GuardCheck.RANGE}
_DURABILITY = {
    pb.DURABILITY_UNSPECIFIED: Durability.LOG,
    pb.DURABILITY_LOG: Durability.LOG,
    pb.DURABILITY_SNAPSHOT: Durability.SNAPSHOT,
    pb.DURABILITY_NONE: Durability.NONE,
}


def config_from_pb(config: pb.SessionConfig) -> SessionConfig:
    guards = []
    for rule in config.guards:
        if rule.check not in _CHECKS:
            raise GuardRuleError(
                f"guard {clip(rule.name)}: check must be CHECK_FINITE or CHECK_RANGE"
            )
        if rule.action not in _ACTIONS:
            raise GuardRuleError(f"guard {clip(rule.name)}: unknown action {rule.action}")
        guards.append(
            GuardRule(
                name=rule.name,
                check=_CHECKS[rule.check],
                action=_ACTIONS[rule.action],
                min=rule.min if rule.HasField("min") else None,
                max=rule.max if rule.HasField("max") else None,
                dims=tuple(rule.dims),
            )
        )
    if config.durability not in _DURABILITY:
        raise RequestError(f"unknown durability mode {config.durability}")
    return SessionConfig(
        snapshot_every=config.snapshot_every,
        max_snapshots=config.max_snapshots,
        history_window=config.history_window,
        guards=tuple(guards),
        durability=_DURABILITY[config.durability],
        idle_ttl_s=config.idle_ttl_s,
        labels=dict(config.labels),
        snapshot_phase=config.snapshot_phase if config.HasField("snapshot_phase") else None,
    )


def config_to_pb(config: SessionConfig) -> pb.SessionConfig:
    out = pb.SessionConfig(
        snapshot_every=config.snapshot_every,
        max_snapshots=config.max_snapshots,
        history_window=config.history_window,
        guards=[
            pb.GuardRule(
                name=g.name,
                check=int(g.check),
                action=int(g.action),
                min=g.min,
                max=g.max,
                dims=list(g.dims),
            )
            for g in config.guards
        ],
        durability=int(config.durability),
        idle_ttl_s=config.idle_ttl_s,
        labels=dict(config.labels),
    )
    if config.snapshot_phase is not None:
        out.snapshot_phase = config.snapshot_phase
    return out


def info_to_pb(view: SessionView, scope: TenantScope = _ALL) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=scope.shown(view.session_id),
        tenant=tenant_of(view.session_id),
        model=view.model,
        model_fingerprint=view.fingerprint,
        step=view.step,
        config=config_to_pb(view.config),
        created_at=view.created_at,
        updated_at=view.updated_at,
        snapshot_count=view.snapshot_count,
        oldest_rollback_step=view.oldest_rollback_step,
        owner=view.owner,
        resident=view.resident,
        input_dim=view.input_dim,
        output_dim=view.output_dim,
        token_input=view.token_input,
        closed=view.closed,
    )


def model_to_pb(key: str, models: ServedModels, resident: int) -> pb.ModelInfo:
    model = models[key]
    c = model.config
    name, version = split_key(key)
    return pb.ModelInfo(
        key=key,
        name=name,
        version=version,
        fingerprint=model.fingerprint,
        input_dim=0 if c.is_token_model else c.input_dim,
        output_dim=c.output_dim,
        token_input=c.is_token_model,
        resident_sessions=resident,
        newest=models.newest(key),
    )


def snapshot_to_pb(session_id: str, record: SnapshotRecord) -> pb.SnapshotInfo:
    return pb.SnapshotInfo(
        snapshot_id=record.snapshot_id,
        session_id=session_id,
        step=record.step,
        label=record.label,
        reason=record.reason,
        created_at=record.created_at,
        size_bytes=record.size,
    )


def _event_to_pb(event: SessionEvent) -> pb.SessionEvent:
    message = pb.SessionEvent(
        kind=event.kind, step=event.step, at=event.at, cause=event.cause, guard=event.guard,
        action=event.action, detail=event.detail,
    )  # fmt: skip
    if event.to_step >= 0:
        message.to_step = event.to_step
    return message


def _guard_event_to_pb(event: GuardEvent) -> pb.GuardEvent:
    return pb.GuardEvent(
        guard=event.guard,
        action=int(event.action),
        step=event.step,
        dims=list(event.dims),
        detail=event.detail,
        rolled_back_to=event.rolled_back_to or 0,
    )


def _snapshot_event_to_pb(event: SnapshotEvent) -> pb.SnapshotEvent:
    return pb.SnapshotEvent(snapshot_id=event.snapshot_id, step=event.step, reason=event.reason)


def forecast_step_to_pb(item: ForecastStep, packed: bool = False) -> pb.ForecastStep:
    out = pb.ForecastStep(
        step=item.step, guard_events=[_guard_event_to_pb(e) for e in item.guard_events]
    )
    if item.output is not None:
        _set_vector(out.output, item.output, packed)
    if item.token is not None:
        out.token = item.token
    return out


def result_to_pb(
    outcome: StepOutcome, scope: TenantScope = _ALL, packed: bool = False
) -> pb.StepResult:
    result = pb.StepResult()
    fill_result(result, outcome, scope, packed)
    return result


def fill_result(
    result: pb.StepResult, outcome: StepOutcome, scope: TenantScope, packed: bool
) -> None:
    """``result`` (empty) := ``outcome`` as the client sees it."""
    result.session_id = scope.shown(outcome.session_id)
    result.step = outcome.step
    if outcome.replayed:
        result.replayed = True
    if outcome.guard_events:
        result.guard_events.extend(_guard_event_to_pb(e) for e in outcome.guard_events)
    if outcome.snapshot_events:
        result.snapshot_events.extend(_snapshot_event_to_pb(e) for e in outcome.snapshot_events)
    if outcome.output is not None:
        _set_vector(result.output, outcome.output, packed)
    if outcome.error is not None:
        result.error.CopyFrom(status.step_error(outcome.error, scope.clean))


def fill_run_results(
    add: Callable[[], pb.StepResult], run: StepRun, scope: TenantScope, packed: bool
) -> None:
    """A result per step of ``run`` (``add`` makes each): from its row of ``run.outputs``
    while it has nothing else to say, else from its own outcome."""
    sid = scope.shown(run.session_id)
    outputs = run.outputs  # (T, o)
    blob = outputs.astype("<f4", copy=False).tobytes() if packed else b""
    width = len(blob) // len(outputs)
    for t, outcome in enumerate(run.outcomes):
        result = add()
        if outcome is not None:
            fill_result(result, outcome, scope, packed)
            continue
        result.session_id = sid
        result.step = run.first + t
        if packed:
            result.output.packed = blob[t * width : (t + 1) * width]
        else:
            result.output.values.extend(outputs[t].tolist())


def _set_vector(vector: pb.Vector, values: np.ndarray, packed: bool) -> None:
    """``values`` (float32) into ``vector``: as little-endian bytes when ``packed``."""
    if packed:
        vector.packed = values.astype("<f4", copy=False).tobytes()
    else:
        vector.values.extend(values.tolist())


def vector_value(vector: pb.Vector, what: str) -> np.ndarray:
    """A Vector's floats as float32 (either form, decoded as the client decodes them); a
    malformed one is a RequestError."""
    if vector.packed and len(vector.values):
        raise RequestError(f"{what}: a vector sets values or packed, not both")
    if len(vector.packed) % 4:
        raise RequestError(
            f"{what}: packed vector has {len(vector.packed)} bytes, not a multiple of 4 "
            "(little-endian float32)"
        )
    return vector_array(vector)
