"""The asyncio client: every RPC of ``ssmserve.v1.SessionService`` as a coroutine.

    async with AsyncClient("127.0.0.1:50051") as client:
        info = await client.create_session("demo", snapshot_every=16)
        async for out in client.stream_steps(info.session_id, signal):
            print(out.step, out.output)

Failures raise the typed exceptions of :mod:`ssmserve.client.errors`; a step answered with an
error raises :class:`~ssmserve.client.errors.StepFailed` (or is yielded, with
``raise_on_error=False``).

The client follows sessions around the cluster (``routing``, ``retry``): a request that
reaches a worker that does not own the session is redirected to the owner; a worker that
cannot be reached is replaced by another known worker (pass several addresses, and the
client also learns the live ones from ``ListWorkers``). A stream that is cut (migration,
crash, store outage) resumes on the new owner from the last answered step, resending the
unanswered inputs (``resumable_stream``): steps are numbered, so a resend of an applied
step is answered with its recorded output and never applied twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from ssmserve.client.errors import from_rpc_error
from ssmserve.client.resumable_stream import ResumableStream
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.routing import WorkerRouter, WorkerStubs, session_metadata
from ssmserve.client.step_values import (
    Forecast,
    SessionHistory,
    StepOutput,
    step_input,
    vector_array,
)
from ssmserve.client.tls import TlsConfig
from ssmserve.v1 import ssmserve_pb2 as pb

__all__ = ["AsyncClient", "Forecast", "SessionHistory", "StepOutput", "step_input"]

CHUNK_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE = 64 << 20


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


class AsyncClient:
    """A client of one ssmserve cluster; ``address`` is one worker or several.

    Why this class is long: it is the API's one facade, a short method per RPC (sessions,
    snapshots, checkpoints, models, cluster operations); the work lives in ``routing``,
    ``resumable_stream`` and ``retry``, and splitting the facade would split what users
    import."""

    def __init__(
        self,
        address: str | Sequence[str],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        *,
        retry: RetryPolicy | None = None,
        discover: bool = True,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        """``tls``: trust roots and an optional client certificate (default: plaintext).
        ``token``: a bearer token for workers that require one (default: SSMSERVE_TOKEN)."""
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise ValueError("give at least one worker address")
        self.address = addresses[0]
        self.retry = retry or RetryPolicy()
        token = token if token is not None else os.environ.get("SSMSERVE_TOKEN")
        token = token.strip() or None if token else None  # a token file's newline is no part
        self.router = WorkerRouter(addresses, self.retry, max_message_bytes, discover, tls, token)
        self.channel = self.router.worker(self.address).channel
        self.stub = self.router.worker(self.address).sessions

    @property
    def addresses(self) -> list[str]:
        """Every worker this client knows (given, redirected to, or discovered)."""
        return self.router.addresses

    async def discover(self) -> None:
        """Learn the live workers' addresses from the cluster (best effort)."""
        await self.router.discover()

    def owner_of(self, session_id: str) -> str:
        """The worker this client last saw serving the session (or its first address)."""
        return self.router.owner_of(session_id)

    async def close(self) -> None:
        await self.router.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        model: str,
        session_id: str = "",
        *,
        snapshot_every: int = 0,
        max_snapshots: int = 0,
        history_window: int = 0,
        guards: Iterable[pb.GuardRule] = (),
        durability: int = pb.DURABILITY_UNSPECIFIED,
        idle_ttl_s: float = 0.0,
        labels: Mapping[str, str] | None = None,
        snapshot_phase: int | None = None,
    ) -> pb.SessionInfo:
        """``snapshot_phase``: periodic snapshots at s % snapshot_every == it (None: worker's)."""
        config = pb.SessionConfig(
            snapshot_every=snapshot_every,
            max_snapshots=max_snapshots,
            history_window=history_window,
            guards=list(guards),
            durability=durability,
            idle_ttl_s=idle_ttl_s,
            labels=dict(labels or {}),
        )
        if snapshot_phase is not None:
            config.snapshot_phase = snapshot_phase
        request = pb.CreateSessionRequest(model=model, session_id=session_id, config=config)
        info: pb.SessionInfo = await self.router.call(
            lambda w: w.sessions.CreateSession(request), idempotent=False
        )
        if info.owner:
            self.router.remember_owner(info.session_id, info.owner)
        return info

    async def get_session(self, session_id: str) -> pb.SessionInfo:
        request = pb.GetSessionRequest(session_id=session_id)
        info: pb.SessionInfo = await self.router.call(lambda w: w.sessions.GetSession(request))
        if info.owner:  # any worker answers this; remember who actually serves it
            self.router.remember_owner(session_id, info.owner)
        return info

    async def list_sessions(self, model: str = "", page_size: int = 0) -> list[pb.SessionInfo]:
        """Every session (all pages)."""
        out: list[pb.SessionInfo] = []
        token = ""
        while True:
            request = pb.ListSessionsRequest(page_size=page_size, page_token=token, model=model)
            page: pb.ListSessionsResponse = await self.router.call(
                lambda w, r=request: w.sessions.ListSessions(r)  # type: ignore[misc]
            )
            out.extend(page.sessions)
            token = page.next_page_token
            if not token:
                return out

    async def close_session(
        self, session_id: str, final_snapshot: bool = False
    ) -> pb.CloseSessionResponse:
        request = pb.CloseSessionRequest(session_id=session_id, final_snapshot=final_snapshot)
        return await self.router.call(
            lambda w: w.sessions.CloseSession(request), session_id, idempotent=False
        )

    # ------------------------------------------------------------------ steps

    async def step(self, session_id: str, value: Any, step: int | None = None) -> StepOutput:
        """One step on its own stream (simple, not fast: use stream_steps for many)."""
        async for out in self.stream_steps(session_id, [value], first_step=step):
            return out
        raise AssertionError("the stream ended without an answer")

    async def stream_steps(
        self,
        session_id: str,
        inputs: Iterable[Any] | AsyncIterable[Any],
        *,
        first_step: int | None = None,
        steps_per_message: int = 1,
        raise_on_error: bool = True,
    ) -> AsyncIterator[StepOutput]:
        """Send ``inputs`` as the next steps of a session; yield each answer in order.

        ``first_step`` defaults to the session's current step + 1. With
        ``steps_per_message`` > 1, inputs are grouped into messages (throughput); the
        last group is sent when ``inputs`` ends.

        The stream follows the session: when it is cut (the session moved, its worker
        died, the store was briefly away), it reconnects to the owner and resends every
        input not yet answered. Each step is yielded exactly once.
        """
        if first_step is None:
            first_step = (await self.get_session(session_id)).step + 1
        if self.router.discover_pending:
            await self.router.discover()
        stream = ResumableStream(
            self.router, session_id, inputs, first_step, steps_per_message, raise_on_error
        )
        async for out in stream:
            yield out

    def open_stream(self) -> grpc.aio.StreamStreamCall:
        """A raw bidirectional stream for many sessions at once (StreamRequest in/out)."""
        return self.stub.Stream()

    # ------------------------------------------------------------------ snapshots, rollback

    async def snapshot(self, session_id: str, label: str = "") -> pb.SnapshotInfo:
        request = pb.SnapshotRequest(session_id=session_id, label=label)
        # a snapshot without a label is idempotent (the same step gives the same snapshot)
        return await self.router.call(
            lambda w: w.sessions.Snapshot(request), session_id, idempotent=not label
        )

    async def list_snapshots(self, session_id: str) -> list[pb.SnapshotInfo]:
        request = pb.ListSnapshotsRequest(session_id=session_id)
        reply = await self.router.call(lambda w: w.sessions.ListSnapshots(request), session_id)
        return list(reply.snapshots)

    async def rollback(
        self,
        session_id: str,
        *,
        to_step: int | None = None,
        to_snapshot: str | None = None,
        to_label: str | None = None,
        back: int | None = None,
    ) -> pb.RollbackResponse:
        """Exactly one target: a step, a snapshot id, a label, or N steps back."""
        targets = {
            "step": to_step,
            "snapshot_id": to_snapshot,
            "label": to_label,
            "steps_back": back,
        }
        given = {k: v for k, v in targets.items() if v is not None}
        if len(given) != 1:
            raise ValueError("rollback takes exactly one of to_step, to_snapshot, to_label, back")
        request = pb.RollbackRequest(session_id=session_id, **given)
        return await self.router.call(
            lambda w: w.sessions.Rollback(request), session_id, idempotent="steps_back" not in given
        )

    # ------------------------------------------------------------------ forecast, fork

    async def forecast(
        self, session_id: str, horizon: int, *, at_step: int | None = None
    ) -> Forecast:
        """Run the session's model ``horizon`` steps ahead on its own outputs, from its
        current step or from ``at_step``; the session is not changed."""
        request = pb.ForecastRequest(
            session_id=session_id, horizon=horizon, at_step=at_step, packed_outputs=True
        )

        async def forecast(w: WorkerStubs) -> Forecast:
            from_step, stopped = 0, None
            outputs: list[np.ndarray] = []
            tokens: list[int] = []
            events: list[pb.GuardEvent] = []
            async for reply in self.router.replies(w.sessions.Forecast(request)):
                from_step = reply.from_step
                for item in reply.steps:
                    events.extend(item.guard_events)
                    if item.HasField("output"):
                        outputs.append(vector_array(item.output))
                    if item.HasField("token"):
                        tokens.append(item.token)
                if reply.HasField("stopped"):
                    stopped = reply.stopped
            if outputs:
                width = len(outputs[0])
            else:  # stopped at its first step: the shape still says what a step holds
                width = (
                    await w.sessions.GetSession(pb.GetSessionRequest(session_id=session_id))
                ).output_dim
            return Forecast(
                session_id=session_id,
                from_step=from_step,
                outputs=np.stack(outputs) if outputs else np.empty((0, width), np.float32),
                tokens=np.asarray(tokens, np.int64) if tokens else None,
                guard_events=events,
                stopped=stopped,
            )

        return await self.router.call(forecast, session_id)

    async def history(
        self, session_id: str, from_step: int = 0, to_step: int = 0
    ) -> SessionHistory:
        """Steps ``from_step..to_step`` of a session as they were answered (0: from the
        oldest it can replay, to its current step), with its snapshots and events."""
        request = pb.GetHistoryRequest(session_id=session_id, from_step=from_step, to_step=to_step)

        async def history(w: WorkerStubs) -> SessionHistory:
            chunks = [c async for c in self.router.replies(w.sessions.GetHistory(request))]
            head = chunks[0]
            token = head.input_dim == 0
            inputs = np.frombuffer(b"".join(c.inputs for c in chunks), "<i8" if token else "<f4")
            outputs = np.frombuffer(b"".join(c.outputs for c in chunks), "<f4")
            return SessionHistory(
                session_id=session_id,
                first_step=head.first_step,
                inputs=inputs.copy() if token else inputs.reshape(-1, head.input_dim).copy(),
                outputs=outputs.reshape(-1, head.output_dim).copy(),
                snapshots=list(head.snapshots),
                events=list(head.events),
            )

        return await self.router.call(history, session_id)

    async def fork(
        self,
        session_id: str,
        *,
        at_step: int | None = None,
        at_snapshot: str | None = None,
        at_label: str | None = None,
        new_session_id: str = "",
        target: str = "",
    ) -> pb.ForkResponse:
        """A new session at the source's state at a step, snapshot or label (at most one;
        none: its current step), optionally served by the worker at ``target``."""
        points = {"step": at_step, "snapshot_id": at_snapshot, "label": at_label}
        given = {k: v for k, v in points.items() if v is not None}
        if len(given) > 1:
            raise ValueError("fork takes at most one of at_step, at_snapshot, at_label")
        request = pb.ForkRequest(
            session_id=session_id, new_session_id=new_session_id, target=target, **given
        )
        reply: pb.ForkResponse = await self.router.call(
            lambda w: w.sessions.Fork(request), session_id, idempotent=False
        )
        if reply.session.owner:
            self.router.remember_owner(reply.session.session_id, reply.session.owner)
        return reply

    # ------------------------------------------------------------------ export, import

    async def export_checkpoint(
        self,
        session_id: str,
        snapshot_id: str = "",
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> bytes:
        """The checkpoint's bytes; ``progress(received, total)`` after each chunk."""
        request = pb.ExportCheckpointRequest(session_id=session_id, snapshot_id=snapshot_id)

        async def export(w: WorkerStubs) -> bytes:
            parts: list[bytes] = []
            received = 0
            async for chunk in self.router.replies(w.sessions.ExportCheckpoint(request)):
                if chunk.index != len(parts):
                    raise ValueError(f"export: chunk {chunk.index} came out of order")
                parts.append(chunk.data)
                received += len(chunk.data)
                if progress is not None:
                    progress(received, chunk.total_size)
            return b"".join(parts)

        return await self.router.call(export, session_id)

    async def import_checkpoint(
        self,
        blob: bytes,
        session_id: str = "",
        *,
        model: str = "",
        replace: bool = False,
        config: pb.SessionConfig | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> pb.SessionInfo:
        """A session from a checkpoint; ``progress(sent, total)`` as chunks are sent."""
        header = pb.ImportHeader(session_id=session_id, model=model, replace=replace, config=config)
        info: pb.SessionInfo = await self.router.call(
            lambda w: w.sessions.ImportCheckpoint(
                _import_requests(header, blob, progress),
                timeout=self.retry.import_timeout_s,
                metadata=session_metadata(session_id),
            ),
            idempotent=False,
        )
        if info.owner:
            self.router.remember_owner(info.session_id, info.owner)
        return info

    # ------------------------------------------------------------------ cluster

    async def upgrade(self, session_id: str, model: str = "") -> pb.UpgradeResponse:
        """Move a session to another version of its model (default: the newest) by
        replaying its kept inputs through it (see the proto's Upgrade)."""
        request = pb.UpgradeRequest(session_id=session_id, model=model)
        reply: pb.UpgradeResponse = await self.router.call(
            lambda w: w.sessions.Upgrade(request), session_id
        )  # idempotent: asking again for the version it now runs changes nothing
        return reply

    async def list_models(self, worker: str = "") -> pb.ListModelsResponse:
        """The models ``worker`` (default: the first address) serves, by name and version."""
        reply: pb.ListModelsResponse = await self.router.call_at(
            worker, lambda w: w.sessions.ListModels(pb.ListModelsRequest())
        )
        return reply

    async def load_model(self, key: str, directory: str, worker: str = "") -> pb.ListModelsResponse:
        """Admin: ``worker`` (default: the first address) serves ``key`` (NAME[@VERSION])
        from ``directory`` on its host from now on; its models after."""
        request = pb.LoadModelRequest(key=key, directory=directory)
        timeout = max(self.retry.call_timeout_s, 120.0)  # the worker compiles its kernels
        reply: pb.ListModelsResponse = await self.router.call_at(
            worker, lambda w: w.cluster.LoadModel(request, timeout=timeout)
        )
        return reply

    async def unload_model(self, key: str, worker: str = "") -> pb.ListModelsResponse:
        """Admin: ``worker`` stops serving ``key`` (refused while sessions there run it)."""
        reply: pb.ListModelsResponse = await self.router.call_at(
            worker, lambda w: w.cluster.UnloadModel(pb.UnloadModelRequest(key=key))
        )
        return reply

    async def list_workers(self) -> list[pb.WorkerInfo]:
        reply = await self.router.call(lambda w: w.cluster.ListWorkers(pb.ListWorkersRequest()))
        return list(reply.workers)

    async def migrate(self, session_id: str, target: str) -> pb.MigrateResponse:
        """Move a session to the worker at ``target`` (HOST:PORT)."""
        request = pb.MigrateRequest(session_id=session_id, target=target)
        reply: pb.MigrateResponse = await self.router.call(
            lambda w: w.cluster.Migrate(request), session_id, idempotent=False
        )
        self.router.remember_owner(session_id, reply.target)
        return reply

    async def drain(self, worker: str = "") -> AsyncIterator[pb.DrainProgress]:
        """Move every session off ``worker`` (default: the first address); yields one
        progress entry per session. Each message (heartbeats, not yielded, come while a
        move is slow) within ``stall_timeout_s`` or ``DeadlineExceeded``, not retried:
        that ends the drain (moves under way finish; drain again for the rest)."""
        call = self.router.worker(self.address).cluster.Drain(pb.DrainRequest(worker=worker))
        with _typed_errors():
            async for progress in self.router.replies(call):
                if not progress.heartbeat:
                    yield progress

    async def undrain(self, worker: str = "") -> pb.WorkerInfo:
        """Undo a drain of ``worker`` (default: the first address): it serves again."""
        request = pb.UndrainRequest(worker=worker)
        reply: pb.WorkerInfo = await self.router.call(lambda w: w.cluster.Undrain(request))
        return reply


def _import_requests(
    header: pb.ImportHeader, blob: bytes, progress: Callable[[int, int], None] | None = None
) -> Iterator[pb.ImportCheckpointRequest]:
    yield pb.ImportCheckpointRequest(header=header)
    view = memoryview(blob)
    count = max(1, -(-len(blob) // CHUNK_BYTES))
    for i in range(count):
        chunk = pb.CheckpointChunk(
            index=i,
            data=bytes(view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]),
            total_size=len(blob),
            last=i == count - 1,
        )
        yield pb.ImportCheckpointRequest(chunk=chunk)
        if progress is not None:
            progress(min(len(blob), (i + 1) * CHUNK_BYTES), len(blob))
