"""The asyncio client: every RPC of ``ssmserve.v1.SessionService`` as a coroutine.

    async with AsyncClient("127.0.0.1:50051") as client:
        session = await client.create_session("demo", snapshot_every=16)
        async for out in client.stream_steps(session, signal):
            print(out.step, out.output)

Every method that acts on a session takes it as its id or as the ``SessionInfo`` that
``create_session`` (or ``get_session``, ``list_sessions``) returned. Failures raise the
typed exceptions of :mod:`ssmserve.client.errors`; a step answered with an error raises
:class:`~ssmserve.client.errors.StepFailed` (or is yielded, with ``raise_on_error=False``).

The client follows sessions around the cluster (``routing``, ``retry``): a request that
reaches a worker that does not own the session is redirected to the owner; a worker that
cannot be reached is replaced by another known worker (pass several addresses, and the
client also learns the live ones from ``ListWorkers``). A stream that is cut (migration,
crash, store outage) resumes on the new owner from the last answered step, resending the
unanswered inputs (``resumable_stream``): steps are numbered, so a resend of an applied
step is answered with its recorded output and never applied twice. Until some worker has
answered this client, though, one that cannot be connected to is not waited for:
:class:`~ssmserve.client.errors.ServerUnreachable` comes within seconds (``routing``).
"""

from __future__ import annotations

import os
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any

import grpc

from ssmserve.client.addresses import worker_address
from ssmserve.client.aio_cluster import AsyncClusterCalls
from ssmserve.client.generation import AsyncGenerateCalls, GeneratedToken
from ssmserve.client.prompt_calls import AsyncPromptCalls
from ssmserve.client.resumable_stream import ResumableStream
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.routing import WorkerRouter, WorkerStubs, session_metadata
from ssmserve.client.step_values import (
    Forecast,
    SessionHistory,
    SessionRef,
    StepOutput,
    session_id_of,
    step_input,
    vector_array,
)
from ssmserve.client.tls import TlsConfig
from ssmserve.v1 import ssmserve_pb2 as pb

__all__ = [
    "AsyncClient",
    "Forecast",
    "GeneratedToken",
    "SessionHistory",
    "SessionRef",
    "StepOutput",
    "step_input",
]

CHUNK_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE = 64 << 20


class AsyncClient(AsyncClusterCalls, AsyncGenerateCalls, AsyncPromptCalls):
    """A client of one ssmserve cluster: sessions, their steps, snapshots, rollbacks,
    forecasts, forks and checkpoints (here), and the cluster's workers and models
    (:class:`~ssmserve.client.aio_cluster.AsyncClusterCalls`).

    Every method may also raise, besides the errors it names: ``ServerUnreachable`` (no
    worker could be connected to, and none ever answered), ``Unavailable`` or
    ``DeadlineExceeded`` (no answer for ``RetryPolicy.give_up_after_s``),
    ``OwnerUnreachable`` (a session's owner does not answer and no worker took it over
    within ``RetryPolicy.takeover_wait_s``), ``Unauthenticated`` or ``PermissionDenied``
    (the token is missing or unknown, or its role may not do this); all are
    ``SsmserveClientError`` (:mod:`ssmserve.client.errors`)."""

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
        """A client of the cluster reachable at ``address`` (``HOST[:PORT]``, port 50051
        when none is given; or several, tried in turn). Connects lazily: nothing is sent
        until the first call.

        ``max_message_bytes``: the largest gRPC message either way. ``retry``: how long
        and how the client rides out moves and outages (default ``RetryPolicy()``).
        ``discover``: learn the other live workers from the cluster. ``tls``: trust roots
        and an optional client certificate (default: plaintext). ``token``: a bearer
        token for workers that require one (default: env SSMSERVE_TOKEN).
        Raises ValueError when no address is given."""
        given = [address] if isinstance(address, str) else list(address)
        addresses = [worker_address(a) for a in given]
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

    def owner_of(self, session: SessionRef) -> str:
        """The address of the worker this client last saw serving ``session`` (an id or
        a SessionInfo), or its first address. Asks nobody; raises nothing."""
        return self.router.owner_of(session_id_of(session))

    async def close(self) -> None:
        """Close every channel; calls still running end with CANCELLED. Safe to repeat."""
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
        """Create a session of ``model`` (``NAME`` or ``NAME@VERSION``) at step 0.

        Takes its id (default: generated) and settings, 0 or None meaning the worker's
        default: a periodic snapshot every ``snapshot_every`` steps, at steps s with
        s % snapshot_every == ``snapshot_phase``; ``max_snapshots`` kept;
        ``history_window`` inputs per checkpoint; ``guards``, rules on every step's
        input or output (``pb.GuardRule``s; ``ssmserve.client.guard_rule`` builds one
        by name); ``durability`` (a ``pb.Durability``); ``idle_ttl_s`` without steps
        before it leaves memory; ``labels``. Returns its SessionInfo, which every
        other method takes as the session. Raises AlreadyExists (the id is taken),
        NotFound (no such model), InvalidArgument (a bad setting), ResourceExhausted (a
        session budget is full)."""
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

    async def get_session(self, session: SessionRef) -> pb.SessionInfo:
        """The session (an id or a SessionInfo) as the cluster has it now.

        Returns a fresh SessionInfo: its step, model, input and output widths, config,
        snapshots, owner. Raises NotFound (no such session)."""
        session_id = session_id_of(session)
        request = pb.GetSessionRequest(session_id=session_id)
        info: pb.SessionInfo = await self.router.call(lambda w: w.sessions.GetSession(request))
        if info.owner:  # any worker answers this; remember who actually serves it
            self.router.remember_owner(session_id, info.owner)
        return info

    async def list_sessions(self, model: str = "", page_size: int = 0) -> list[pb.SessionInfo]:
        """Every session of the cluster (of ``model`` only, if given), all pages fetched
        ``page_size`` at a time (0: the worker's page size). Returns a list of
        SessionInfo. Raises InvalidArgument (a bad page size)."""
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
        self, session: SessionRef, final_snapshot: bool = False
    ) -> pb.CloseSessionResponse:
        """Close the session (an id or a SessionInfo): it takes no more steps.

        ``final_snapshot``: snapshot it first, so it can still be exported. Returns the
        step it closed at and that snapshot's id. Raises NotFound (no such session)."""
        session_id = session_id_of(session)
        request = pb.CloseSessionRequest(session_id=session_id, final_snapshot=final_snapshot)
        return await self.router.call(
            lambda w: w.sessions.CloseSession(request), session_id, idempotent=False
        )

    # ------------------------------------------------------------------ steps

    async def step(self, session: SessionRef, value: Any, step: int | None = None) -> StepOutput:
        """One step of the session (an id or a SessionInfo) on a stream of its own:
        simple, not fast (``stream_steps`` sends many).

        ``value``: a token id (int) or an input vector (anything numpy makes floats of);
        ``step``: its number (default: the session's next). Returns its StepOutput.
        Raises StepFailed (the step was answered with an error: a bad input, a guard),
        NotFound (no such session)."""
        async for out in self.stream_steps(session, [value], first_step=step):
            return out
        raise AssertionError("the stream ended without an answer")

    async def stream_steps(
        self,
        session: SessionRef,
        inputs: Iterable[Any] | AsyncIterable[Any],
        *,
        first_step: int | None = None,
        steps_per_message: int = 1,
        raise_on_error: bool = True,
        last_outputs_only: bool = False,
    ) -> AsyncIterator[StepOutput]:
        """Send ``inputs`` as the next steps of the session (an id or a SessionInfo);
        yields a StepOutput per input, in step order.

        ``inputs``: token ids or vectors, a (possibly endless, possibly async) iterable.
        ``first_step``: the number of the first (default: the session's step + 1); steps
        it already took are answered from its record, not applied again.
        ``steps_per_message`` > 1 groups inputs into messages (throughput); the last group
        is sent when ``inputs`` ends. ``last_outputs_only``: only the last step of each
        message is answered with its output, the others with an empty ``output`` (a
        prompt whose next-token logits are all that is wanted: the worker prefills the
        message's steps as one run and computes only the outputs it sends back, or that
        guards read); the session steps exactly as without it. The stream follows the
        session: when it is cut (the session moved, its worker died, the store was
        briefly away), it reconnects to the owner and resends every input not yet
        answered (with the same ``last_outputs_only``); each step is yielded once.
        Raises StepFailed (a step was answered with an error; with
        ``raise_on_error=False`` it is yielded, its ``error`` set), SessionRewound (the
        session came back behind steps this stream no longer holds), NotFound."""
        session_id = session_id_of(session)
        if first_step is None:
            first_step = (await self.get_session(session_id)).step + 1
        if self.router.discover_pending:
            await self.router.discover()
        stream = ResumableStream(
            self.router, session_id, inputs, first_step, steps_per_message, raise_on_error,
            last_outputs_only,
        )  # fmt: skip
        async for out in stream:
            yield out

    def open_stream(self) -> grpc.aio.StreamStreamCall:
        """A raw bidirectional Stream call to the first worker, for many sessions at once:
        write ``pb.StreamRequest``, read ``pb.StreamResponse``. No redirects, no resends:
        the caller handles what ``stream_steps`` does. Asyncio only."""
        return self.stub.Stream()

    # ------------------------------------------------------------------ snapshots, rollback

    async def snapshot(self, session: SessionRef, label: str = "") -> pb.SnapshotInfo:
        """Snapshot the session (an id or a SessionInfo) at its current step, named
        ``label`` if given (``rollback(to_label=...)`` finds it). Returns the snapshot's
        SnapshotInfo. Raises NotFound (no such session), InvalidArgument (a bad label)."""
        session_id = session_id_of(session)
        request = pb.SnapshotRequest(session_id=session_id, label=label)
        # a snapshot without a label is idempotent (the same step gives the same snapshot)
        return await self.router.call(
            lambda w: w.sessions.Snapshot(request), session_id, idempotent=not label
        )

    async def list_snapshots(self, session: SessionRef) -> list[pb.SnapshotInfo]:
        """The kept snapshots of the session (an id or a SessionInfo), oldest first, as
        SnapshotInfo. Raises NotFound (no such session)."""
        session_id = session_id_of(session)
        request = pb.ListSnapshotsRequest(session_id=session_id)
        reply = await self.router.call(lambda w: w.sessions.ListSnapshots(request), session_id)
        return list(reply.snapshots)

    async def rollback(
        self,
        session: SessionRef,
        *,
        to_step: int | None = None,
        to_snapshot: str | None = None,
        to_label: str | None = None,
        back: int | None = None,
    ) -> pb.RollbackResponse:
        """Return the session (an id or a SessionInfo) exactly to an earlier state: give
        one of ``to_step``, ``to_snapshot`` (an id), ``to_label`` or ``back`` (steps).

        Returns the step it is at now, the snapshot it started from and how many steps
        were replayed. Raises ValueError (not exactly one target), NotFound (no such
        session or snapshot), FailedPrecondition (the step is older than its kept
        snapshots reach, or ahead of the session)."""
        session_id = session_id_of(session)
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
        self, session: SessionRef, horizon: int, *, at_step: int | None = None
    ) -> Forecast:
        """Run the model of the session (an id or a SessionInfo) ``horizon`` steps ahead
        on its own outputs, from its current step or from ``at_step``; the session is
        not changed.

        Returns a Forecast: the outputs (and token ids of a token model) of the steps
        after it, and ``stopped`` when a guard or a non-finite output ended it early.
        Raises InvalidArgument (a bad horizon, or a model that cannot feed its outputs
        back), NotFound, ResourceExhausted (too many forecasts at once)."""
        session_id = session_id_of(session)
        request = pb.ForecastRequest(
            session_id=session_id, horizon=horizon, at_step=at_step, packed_outputs=True
        )

        async def forecast(w: WorkerStubs) -> Forecast:
            async def output_dim() -> int:
                info = await w.sessions.GetSession(pb.GetSessionRequest(session_id=session_id))
                return int(info.output_dim)

            replies = self.router.replies(w.sessions.Forecast(request))
            return await _read_forecast(session_id, replies, output_dim)

        return await self.router.call(forecast, session_id)

    async def history(
        self, session: SessionRef, from_step: int = 0, to_step: int = 0
    ) -> SessionHistory:
        """What the session (an id or a SessionInfo) did over steps ``from_step`` ..
        ``to_step`` (0: from the oldest it can replay, to its current step).

        Returns a SessionHistory: the inputs, the outputs as they were answered, its
        snapshots and events (rollbacks, guards). Raises NotFound, FailedPrecondition
        (steps older than its kept snapshots reach)."""
        session_id = session_id_of(session)
        request = pb.GetHistoryRequest(session_id=session_id, from_step=from_step, to_step=to_step)

        async def history(w: WorkerStubs) -> SessionHistory:
            replies = self.router.replies(w.sessions.GetHistory(request))
            return await _read_history(session_id, replies)

        return await self.router.call(history, session_id)

    async def fork(
        self,
        session: SessionRef,
        *,
        at_step: int | None = None,
        at_snapshot: str | None = None,
        at_label: str | None = None,
        new_session_id: str = "",
        target: str = "",
    ) -> pb.ForkResponse:
        """A new session in the state the session (an id or a SessionInfo) had at a step,
        a snapshot or a label (at most one; none: its current step).

        ``new_session_id``: the fork's id (default: generated); ``target``: the worker
        (HOST:PORT) to serve it. Returns a ForkResponse: the new session's SessionInfo
        (``.session``) and how it was rebuilt. Raises ValueError (several points),
        NotFound, FailedPrecondition (a step out of reach), AlreadyExists (the id)."""
        session_id = session_id_of(session)
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
        session: SessionRef,
        snapshot_id: str = "",
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> bytes:
        """The checkpoint of the session (an id or a SessionInfo), at its current state
        or at ``snapshot_id``, as bytes (``import_checkpoint`` takes them back);
        ``progress(received, total)`` is called after each chunk. Raises NotFound (no
        such session or snapshot)."""
        session_id = session_id_of(session)
        request = pb.ExportCheckpointRequest(session_id=session_id, snapshot_id=snapshot_id)

        async def export(w: WorkerStubs) -> bytes:
            replies = self.router.replies(w.sessions.ExportCheckpoint(request))
            return await _read_checkpoint(replies, progress)

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
        """A session from a checkpoint's bytes (``export_checkpoint``'s).

        ``session_id``: its id (default: the checkpoint's); ``model``: the model to run
        it (default: the one whose fingerprint matches); ``replace``: overwrite a
        session of that id; ``config``: new settings; ``progress(sent, total)`` as chunks
        go. Returns its SessionInfo. Raises InvalidArgument (not a valid checkpoint),
        AlreadyExists (the id, without ``replace``), FailedPrecondition (no model
        matches it), ResourceExhausted (too large, or a budget is full)."""
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


async def _read_forecast(
    session_id: str,
    replies: AsyncIterator[pb.ForecastResponse],
    output_dim: Callable[[], Awaitable[int]],
) -> Forecast:
    """A Forecast from a Forecast call's replies (``output_dim()``: the session's output
    width, asked only when it stopped before its first output)."""
    import numpy as np

    from_step, stopped = 0, None
    outputs: list[np.ndarray] = []
    tokens: list[int] = []
    events: list[pb.GuardEvent] = []
    async for reply in replies:
        from_step = reply.from_step
        for item in reply.steps:
            events.extend(item.guard_events)
            if item.HasField("output"):
                outputs.append(vector_array(item.output))
            if item.HasField("token"):
                tokens.append(item.token)
        if reply.HasField("stopped"):
            stopped = reply.stopped
    # stopped at its first step: the shape still says what a step holds
    width = len(outputs[0]) if outputs else await output_dim()
    return Forecast(
        session_id=session_id,
        from_step=from_step,
        outputs=np.stack(outputs) if outputs else np.empty((0, width), np.float32),
        tokens=np.asarray(tokens, np.int64) if tokens else None,
        guard_events=events,
        stopped=stopped,
    )


async def _read_history(session_id: str, replies: AsyncIterator[pb.HistoryChunk]) -> SessionHistory:
    """A SessionHistory from a GetHistory call's chunks."""
    import numpy as np

    chunks = [c async for c in replies]
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


async def _read_checkpoint(
    replies: AsyncIterator[pb.CheckpointChunk], progress: Callable[[int, int], None] | None
) -> bytes:
    """A checkpoint's bytes from an ExportCheckpoint call's chunks, in order."""
    parts: list[bytes] = []
    received = 0
    async for chunk in replies:
        if chunk.index != len(parts):
            raise ValueError(f"export: chunk {chunk.index} came out of order")
        parts.append(chunk.data)
        received += len(chunk.data)
        if progress is not None:
            progress(received, chunk.total_size)
    return b"".join(parts)


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
