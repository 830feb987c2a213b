"""The asyncio client: every RPC of ``ssmserve.v1.SessionService`` as a coroutine.

    async with AsyncClient("127.0.0.1:50051") as client:
        info = await client.create_session("demo", snapshot_every=16)
        async for out in client.stream_steps(info.session_id, signal):
            print(out.step, out.output)

Failures raise the typed exceptions of :mod:`client.errors`; a step answered with an
error raises :class:`~client.errors.StepFailed` (or is yielded, with ``raise_on_error=False``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

from client.errors import StepFailed, from_rpc_error

CHUNK_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE = 64 << 20


@dataclass(frozen=True)
class StepOutput:
    session_id: str
    step: int
    output: np.ndarray  # (o,) float32; empty when the step failed
    replayed: bool
    guard_events: Sequence[pb.GuardEvent]
    snapshot_events: Sequence[pb.SnapshotEvent]
    error: pb.StepError | None

    @classmethod
    def from_pb(cls, result: pb.StepResult) -> StepOutput:
        return cls(
            session_id=result.session_id,
            step=result.step,
            output=np.asarray(result.output.values, np.float32),
            replayed=result.replayed,
            guard_events=list(result.guard_events),
            snapshot_events=list(result.snapshot_events),
            error=result.error if result.HasField("error") else None,
        )


def step_input(session_id: str, step: int, value: Any) -> pb.StepInput:
    """A token id (int) or a vector (anything numpy turns into floats) as a StepInput."""
    if isinstance(value, int | np.integer):
        return pb.StepInput(session_id=session_id, step=step, token=int(value))
    values = np.asarray(value, np.float32).reshape(-1).tolist()
    return pb.StepInput(session_id=session_id, step=step, vector=pb.Vector(values=values))


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


class AsyncClient:
    def __init__(self, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self.stub = pb_grpc.SessionServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

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
    ) -> pb.SessionInfo:
        config = pb.SessionConfig(
            snapshot_every=snapshot_every,
            max_snapshots=max_snapshots,
            history_window=history_window,
            guards=list(guards),
            durability=durability,
            idle_ttl_s=idle_ttl_s,
            labels=dict(labels or {}),
        )
        request = pb.CreateSessionRequest(model=model, session_id=session_id, config=config)
        with _typed_errors():
            return await self.stub.CreateSession(request)

    async def get_session(self, session_id: str) -> pb.SessionInfo:
        with _typed_errors():
            return await self.stub.GetSession(pb.GetSessionRequest(session_id=session_id))

    async def list_sessions(self, model: str = "", page_size: int = 0) -> list[pb.SessionInfo]:
        """Every session (all pages)."""
        out: list[pb.SessionInfo] = []
        token = ""
        with _typed_errors():
            while True:
                page = await self.stub.ListSessions(
                    pb.ListSessionsRequest(page_size=page_size, page_token=token, model=model)
                )
                out.extend(page.sessions)
                token = page.next_page_token
                if not token:
                    return out

    async def close_session(
        self, session_id: str, final_snapshot: bool = False
    ) -> pb.CloseSessionResponse:
        request = pb.CloseSessionRequest(session_id=session_id, final_snapshot=final_snapshot)
        with _typed_errors():
            return await self.stub.CloseSession(request)

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
        """
        if first_step is None:
            first_step = (await self.get_session(session_id)).step + 1
        start = first_step

        async def requests() -> AsyncIterator[pb.StreamRequest]:
            step = start
            group: list[pb.StepInput] = []
            async for value in _aiter(inputs):
                group.append(step_input(session_id, step, value))
                step += 1
                if len(group) >= steps_per_message:
                    yield pb.StreamRequest(steps=group)
                    group = []
            if group:
                yield pb.StreamRequest(steps=group)

        call = self.stub.Stream(requests())
        try:
            with _typed_errors():
                async for response in call:
                    for result in response.results:
                        if raise_on_error and result.HasField("error"):
                            raise StepFailed(result)
                        yield StepOutput.from_pb(result)
        finally:
            call.cancel()

    def open_stream(self) -> grpc.aio.StreamStreamCall:
        """A raw bidirectional stream for many sessions at once (StreamRequest in/out)."""
        return self.stub.Stream()

    # ------------------------------------------------------------------ snapshots, rollback

    async def snapshot(self, session_id: str, label: str = "") -> pb.SnapshotInfo:
        with _typed_errors():
            return await self.stub.Snapshot(pb.SnapshotRequest(session_id=session_id, label=label))

    async def list_snapshots(self, session_id: str) -> list[pb.SnapshotInfo]:
        with _typed_errors():
            reply = await self.stub.ListSnapshots(pb.ListSnapshotsRequest(session_id=session_id))
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
        with _typed_errors():
            return await self.stub.Rollback(request)

    # ------------------------------------------------------------------ export, import

    async def export_checkpoint(self, session_id: str, snapshot_id: str = "") -> bytes:
        request = pb.ExportCheckpointRequest(session_id=session_id, snapshot_id=snapshot_id)
        parts: list[bytes] = []
        with _typed_errors():
            async for chunk in self.stub.ExportCheckpoint(request):
                if chunk.index != len(parts):
                    raise ValueError(f"export: chunk {chunk.index} came out of order")
                parts.append(chunk.data)
        return b"".join(parts)

    async def import_checkpoint(
        self,
        blob: bytes,
        session_id: str = "",
        *,
        model: str = "",
        replace: bool = False,
        config: pb.SessionConfig | None = None,
    ) -> pb.SessionInfo:
        header = pb.ImportHeader(session_id=session_id, model=model, replace=replace, config=config)
        with _typed_errors():
            return await self.stub.ImportCheckpoint(_import_requests(header, blob))


def _import_requests(header: pb.ImportHeader, blob: bytes) -> Iterator[pb.ImportCheckpointRequest]:
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


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
