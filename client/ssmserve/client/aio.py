"""The asyncio client: every RPC of ``ssmserve.v1.SessionService`` as a coroutine.

    async with AsyncClient("127.0.0.1:50051") as client:
        info = await client.create_session("demo", snapshot_every=16)
        async for out in client.stream_steps(info.session_id, signal):
            print(out.step, out.output)

Failures raise the typed exceptions of :mod:`ssmserve.client.errors`; a step answered with an
error raises :class:`~ssmserve.client.errors.StepFailed` (or is yielded, with
``raise_on_error=False``).

The client follows sessions around the cluster (``client/retry.py``): a request that
reaches a worker that does not own the session is redirected to the owner; a worker that
cannot be reached is replaced by another known worker (pass several addresses, and the
client also learns the live ones from ``ListWorkers``). A stream that is cut (migration,
crash, store outage) resumes on the new owner from the last answered step, resending the
unanswered inputs: steps are numbered, so a resend of an applied step is answered with
its recorded output and never applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
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
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from ssmserve.client.errors import (
    SessionMoved,
    SsmserveClientError,
    StepFailed,
    Unavailable,
    from_rpc_error,
    step_redirect,
)
from ssmserve.client.retry import Backoff, RetryPolicy
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

CHUNK_BYTES = 1 << 20
_RECONNECT_MS = 2000
# Reasons of UNAVAILABLE that mean "this worker cannot reach the store right now".
_STORE_TROUBLE = frozenset({"STORE_UNAVAILABLE", "STORE_OUTCOME_UNKNOWN", "STORE"})
DEFAULT_MAX_MESSAGE = 64 << 20
T = TypeVar("T")
# Codes a call may be retried on (elsewhere): the worker is gone, stopping or unreachable.
_TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


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


@dataclass(frozen=True)
class Forecast:
    """A forecast: the outputs of steps ``from_step + 1 ..``, as stepping a copy would give."""

    session_id: str
    from_step: int
    outputs: np.ndarray  # (h, o) float32; h < horizon when ``stopped`` is set
    tokens: np.ndarray | None  # (h,) int64 for token models: the argmax fed back next
    guard_events: Sequence[pb.GuardEvent]
    stopped: pb.StepError | None  # why it ended early (a guard, an output with NaN/Inf)

    @property
    def steps(self) -> np.ndarray:
        """(h,) the step number of each output."""
        return np.arange(self.from_step + 1, self.from_step + 1 + len(self.outputs))


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


@dataclass
class _Worker:
    channel: grpc.aio.Channel
    sessions: pb_grpc.SessionServiceStub
    cluster: pb_grpc.ClusterServiceStub


class AsyncClient:
    """A client of one ssmserve cluster; ``address`` is one worker or several."""

    def __init__(
        self,
        address: str | Sequence[str],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        *,
        retry: RetryPolicy | None = None,
        discover: bool = True,
    ) -> None:
        self.addresses = [address] if isinstance(address, str) else list(address)
        if not self.addresses:
            raise ValueError("give at least one worker address")
        self.address = self.addresses[0]
        self.retry = retry or RetryPolicy()
        self._max_message = max_message_bytes
        self._workers: dict[str, _Worker] = {}
        self._owners: dict[str, str] = {}  # session id -> where it was last served
        self._unreachable: set[str] = set()
        self._discover = discover
        self.channel = self._worker(self.address).channel
        self.stub = self._worker(self.address).sessions

    def _worker(self, address: str) -> _Worker:
        worker = self._workers.get(address)
        if worker is None:
            policy = self.retry
            channel = grpc.aio.insecure_channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", self._max_message),
                    ("grpc.max_send_message_length", self._max_message),
                    ("grpc.keepalive_time_ms", int(policy.keepalive_time_s * 1000)),
                    ("grpc.keepalive_timeout_ms", int(policy.keepalive_timeout_s * 1000)),
                    # grpc >= 1.60 waits this long for a ping's answer (default 60 s).
                    ("grpc.http2.ping_timeout_ms", int(policy.keepalive_timeout_s * 1000)),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0),
                    # A connection attempt to a frozen worker gives up within seconds (the
                    # default waits 20 s), and one that restarted is retried soon.
                    ("grpc.min_reconnect_backoff_ms", _RECONNECT_MS),
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", _RECONNECT_MS),
                ],
                interceptors=[_DefaultDeadline(policy.call_timeout_s)],
            )
            worker = _Worker(
                channel, pb_grpc.SessionServiceStub(channel), pb_grpc.ClusterServiceStub(channel)
            )
            self._workers[address] = worker
        return worker

    def owner_of(self, session_id: str) -> str:
        """The worker this client last saw serving the session (or its first address)."""
        return self._owners.get(session_id, self.address)

    async def close(self) -> None:
        workers = list(self._workers.values())
        self._workers.clear()
        await asyncio.gather(*(w.channel.close() for w in workers), return_exceptions=True)

    # ------------------------------------------------------------------ following sessions

    def _learn(self, address: str) -> None:
        if address and address not in self.addresses:
            self.addresses.append(address)

    def _other(self, address: str) -> str:
        """The next known worker after ``address``, preferring reachable ones."""
        ring = self.addresses
        start = ring.index(address) + 1 if address in ring else 0
        ordered = ring[start:] + ring[:start]
        return next((a for a in ordered if a not in self._unreachable), ordered[0])

    def _reachable(self, prefer: str = "") -> list[str]:
        """Known workers not marked unreachable, ``prefer`` first (all, if none is left)."""
        ordered = [prefer] if prefer in self.addresses else []
        ordered += [a for a in self.addresses if a != prefer]
        return [a for a in ordered if a not in self._unreachable] or ordered

    async def discover(self) -> None:
        """Learn the live workers' addresses from the cluster (best effort)."""
        self._discover = False
        for address in self._reachable(self.address)[:2]:
            try:
                reply = await self._worker(address).cluster.ListWorkers(
                    pb.ListWorkersRequest(), timeout=2.0
                )
            except grpc.RpcError:
                continue
            for w in reply.workers:
                self._learn(w.address)
            return

    async def _next_address(
        self, address: str, error: SsmserveClientError, backoff: Backoff
    ) -> str:
        """Where to try after ``error`` at ``address``; raises it when retrying is over."""
        if isinstance(error, SessionMoved):
            owner = error.owner
            if (
                owner
                and owner != address
                and owner not in self._unreachable
                and backoff.redirects < self.retry.max_redirects
            ):
                backoff.redirects += 1
                self._learn(owner)
                return owner  # go there at once
            if backoff.expired():
                raise error
            if owner and owner in self._unreachable:
                if backoff.waited_for == owner:
                    # Its lease outlived our wait for it to run out: the owner renewed it,
                    # so it is alive again (restarted, or back from a pause). Go there.
                    self._unreachable.discard(owner)
                    backoff.waited_for = ""
                    backoff.redirects += 1
                    return owner
                # The owner died or froze: its lease runs out in retry_after_ms, then any
                # worker (this one, or another reachable one) takes the session over.
                backoff.waited_for = owner
                await backoff.wait(at_least_s=min(error.retry_after_ms / 1000, 10.0) + 0.005)
                return address if address not in self._unreachable else self._other(address)
            await backoff.wait()
            return address
        if error.code not in _TRANSIENT or backoff.expired():
            raise error
        if not error.reason:  # the worker itself is unreachable or stopping
            self._unreachable.add(address)
            if self._discover:
                await self.discover()
            await backoff.wait()
            return self._other(address)
        await backoff.wait()
        if error.reason in _STORE_TROUBLE:
            # This worker cannot reach the store (a partition, or Redis is away): another
            # worker may, and takes the session over once this one's lease runs out.
            return self._other(address)
        return address  # e.g. the session is being reloaded there: same worker

    async def _call(
        self,
        invoke: Callable[[_Worker], Awaitable[T]],
        session_id: str = "",
        idempotent: bool = True,
    ) -> T:
        """One request, following redirects; retried elsewhere only if ``idempotent``."""
        backoff = Backoff(self.retry)
        address = self.owner_of(session_id) if session_id else self.address
        if address in self._unreachable:  # never start with a worker given up on
            address = self._other(address)
        while True:
            try:
                result = await invoke(self._worker(address))
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                if not idempotent and not isinstance(error, SessionMoved):
                    raise error from None
                address = await self._next_address(address, error, backoff)
                continue
            self._unreachable.discard(address)
            if session_id:
                self._owners[session_id] = address
            return result

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
        info: pb.SessionInfo = await self._call(
            lambda w: w.sessions.CreateSession(request), idempotent=False
        )
        if info.owner:
            self._owners[info.session_id] = info.owner
        return info

    async def get_session(self, session_id: str) -> pb.SessionInfo:
        request = pb.GetSessionRequest(session_id=session_id)
        info: pb.SessionInfo = await self._call(lambda w: w.sessions.GetSession(request))
        if info.owner:  # any worker answers this; remember who actually serves it
            self._owners[session_id] = info.owner
        return info

    async def list_sessions(self, model: str = "", page_size: int = 0) -> list[pb.SessionInfo]:
        """Every session (all pages)."""
        out: list[pb.SessionInfo] = []
        token = ""
        while True:
            request = pb.ListSessionsRequest(page_size=page_size, page_token=token, model=model)
            page: pb.ListSessionsResponse = await self._call(
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
        return await self._call(
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
        if self._discover:
            await self.discover()
        # At least one message's worth may be outstanding, or a message would never fill.
        window = max(self.retry.window, steps_per_message)
        feed = _StepFeed(session_id, _aiter(inputs), first_step, window)
        backoff = Backoff(self.retry)
        address = self.owner_of(session_id)
        try:
            while True:
                call = self._worker(address).sessions.Stream(feed.requests(steps_per_message))
                try:
                    async for result in self._answers(call, feed):
                        backoff.progress()
                        self._unreachable.discard(address)
                        self._owners[session_id] = address
                        if raise_on_error and result.HasField("error"):
                            raise StepFailed(result)
                        yield StepOutput.from_pb(result)
                    if feed.done:
                        return
                    error: SsmserveClientError = Unavailable(f"{address} ended the stream early")
                except grpc.RpcError as exc:
                    error = from_rpc_error(exc)
                except _Retry as retry:
                    error = retry.error
                finally:
                    call.cancel()
                if error.code == grpc.StatusCode.INTERNAL and error.message == _LOST_STATUS:
                    # grpcio replaces the status of a call the server ended while requests
                    # were still being written (a redirect, mostly) with this INTERNAL one.
                    # The cause is lost: ask the cluster where the session is now.
                    if backoff.expired():
                        raise error
                    await backoff.wait()
                    address = await self._locate(session_id, address)
                    continue
                address = await self._next_address(address, error, backoff)
        finally:
            await feed.close()

    async def _locate(self, session_id: str, address: str) -> str:
        """The session's owner as the cluster reports it (``address`` if nobody holds it).

        Asks reachable workers only, each with a deadline: the one that just failed may
        be frozen, and a question to it would wait as long as it does.
        """
        request = pb.GetSessionRequest(session_id=session_id)
        for candidate in self._reachable()[:3]:
            try:
                info = await self._worker(candidate).sessions.GetSession(
                    request, timeout=min(self.retry.call_timeout_s, 5.0)
                )
            except grpc.RpcError as exc:
                if exc.code() in _TRANSIENT:  # type: ignore[attr-defined]
                    self._unreachable.add(candidate)
                    continue
                return address
            self._unreachable.discard(candidate)
            if info.owner and info.owner not in self._unreachable:
                return info.owner
            # Nobody holds it, or its owner is unreachable: this worker takes it over
            # (once the owner's lease runs out; its redirect says when).
            return candidate
        return self._other(address)

    async def _answers(
        self, call: grpc.aio.StreamStreamCall, feed: _StepFeed
    ) -> AsyncIterator[pb.StepResult]:
        """The stream's answers, each once and in step order; _Retry when it must resume."""
        stall = self.retry.stall_timeout_s
        # Iterate (not call.read()): with a request iterator, read() turns a status the
        # server ends the call with while requests are still being written into INTERNAL.
        responses = call.__aiter__()
        while True:
            read: asyncio.Future[pb.StreamResponse] = asyncio.ensure_future(responses.__anext__())
            try:
                while not read.done():
                    await asyncio.wait({read}, timeout=stall)
                    if not read.done() and feed.pending and feed.quiet_for() > stall:
                        raise _Retry(Unavailable(f"no answer for {stall:.0f} s"))
                response = read.result()
            except StopAsyncIteration:
                return
            finally:
                if not read.done():
                    read.cancel()
            for result in response.results:
                if result.step < feed.lo:
                    continue  # answered before the stream was resumed
                if result.step != feed.lo:
                    raise SsmserveClientError(
                        f"session {feed.session_id!r}: the answer to step {result.step} came "
                        f"before the answer to step {feed.lo}"
                    )
                if result.HasField("error") and result.error.code in _TRANSIENT_NUMBERS:
                    # Not applied: the session moved (go to its owner), or the store or the
                    # session is briefly away (retry). Resume from this step.
                    raise _Retry(
                        step_redirect(result.error)
                        or Unavailable(result.error.message, result.error.reason)
                    )
                feed.ack(result.step)
                yield result

    def open_stream(self) -> grpc.aio.StreamStreamCall:
        """A raw bidirectional stream for many sessions at once (StreamRequest in/out)."""
        return self.stub.Stream()

    # ------------------------------------------------------------------ snapshots, rollback

    async def snapshot(self, session_id: str, label: str = "") -> pb.SnapshotInfo:
        request = pb.SnapshotRequest(session_id=session_id, label=label)
        # a snapshot without a label is idempotent (the same step gives the same snapshot)
        return await self._call(
            lambda w: w.sessions.Snapshot(request), session_id, idempotent=not label
        )

    async def list_snapshots(self, session_id: str) -> list[pb.SnapshotInfo]:
        request = pb.ListSnapshotsRequest(session_id=session_id)
        reply = await self._call(lambda w: w.sessions.ListSnapshots(request), session_id)
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
        return await self._call(
            lambda w: w.sessions.Rollback(request), session_id, idempotent="steps_back" not in given
        )

    # ------------------------------------------------------------------ forecast, fork

    async def forecast(
        self, session_id: str, horizon: int, *, at_step: int | None = None
    ) -> Forecast:
        """Run the session's model ``horizon`` steps ahead on its own outputs, from its
        current step or from ``at_step``; the session is not changed."""
        request = pb.ForecastRequest(session_id=session_id, horizon=horizon, at_step=at_step)

        async def forecast(w: _Worker) -> Forecast:
            from_step, stopped = 0, None
            outputs: list[np.ndarray] = []
            tokens: list[int] = []
            events: list[pb.GuardEvent] = []
            async for reply in w.sessions.Forecast(request):
                from_step = reply.from_step
                for item in reply.steps:
                    events.extend(item.guard_events)
                    if item.HasField("output"):
                        outputs.append(np.asarray(item.output.values, np.float32))
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

        return await self._call(forecast, session_id)

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
        reply: pb.ForkResponse = await self._call(
            lambda w: w.sessions.Fork(request), session_id, idempotent=False
        )
        if reply.session.owner:
            self._owners[reply.session.session_id] = reply.session.owner
        return reply

    # ------------------------------------------------------------------ export, import

    async def export_checkpoint(self, session_id: str, snapshot_id: str = "") -> bytes:
        request = pb.ExportCheckpointRequest(session_id=session_id, snapshot_id=snapshot_id)

        async def export(w: _Worker) -> bytes:
            parts: list[bytes] = []
            async for chunk in w.sessions.ExportCheckpoint(request):
                if chunk.index != len(parts):
                    raise ValueError(f"export: chunk {chunk.index} came out of order")
                parts.append(chunk.data)
            return b"".join(parts)

        return await self._call(export, session_id)

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
        info: pb.SessionInfo = await self._call(
            lambda w: w.sessions.ImportCheckpoint(
                _import_requests(header, blob), timeout=self.retry.import_timeout_s
            ),
            idempotent=False,
        )
        if info.owner:
            self._owners[info.session_id] = info.owner
        return info

    # ------------------------------------------------------------------ cluster

    async def list_workers(self) -> list[pb.WorkerInfo]:
        reply = await self._call(lambda w: w.cluster.ListWorkers(pb.ListWorkersRequest()))
        return list(reply.workers)

    async def migrate(self, session_id: str, target: str) -> pb.MigrateResponse:
        """Move a session to the worker at ``target`` (HOST:PORT)."""
        request = pb.MigrateRequest(session_id=session_id, target=target)
        reply: pb.MigrateResponse = await self._call(
            lambda w: w.cluster.Migrate(request), session_id, idempotent=False
        )
        self._owners[session_id] = reply.target
        return reply

    async def drain(self, worker: str = "") -> AsyncIterator[pb.DrainProgress]:
        """Move every session off ``worker`` (default: the first address); yields progress."""
        call = self._worker(self.address).cluster.Drain(pb.DrainRequest(worker=worker))
        with _typed_errors():
            async for progress in call:
                yield progress


_TRANSIENT_NUMBERS = frozenset(code.value[0] for code in _TRANSIENT)


class _DefaultDeadline(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Gives every unary call without a deadline of its own the policy's deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: Any,
        request: Any,
    ) -> Any:
        if client_call_details.timeout is None:
            client_call_details = client_call_details._replace(timeout=self.timeout_s)
        return await continuation(client_call_details, request)


_LOST_STATUS = "Internal error from Core"
_END = object()


class _Retry(Exception):
    """A stream must be resumed (elsewhere, or after a pause) because of ``error``."""

    def __init__(self, error: SsmserveClientError) -> None:
        super().__init__(str(error))
        self.error = error


class _StepFeed:
    """The inputs of one session's stream, kept until answered so they can be resent.

    One task pulls from the caller's iterator (so cancelling a stream attempt never
    cancels the caller's generator mid-item); each attempt's request generator starts at
    the first unanswered step. At most ``window`` steps are outstanding.
    """

    def __init__(
        self, session_id: str, source: AsyncIterator[Any], first_step: int, window: int
    ) -> None:
        self.session_id = session_id
        self.lo = first_step  # the first unanswered step
        self.hi = first_step  # the next step number to draw from the source
        self.exhausted = False
        self._values: dict[int, Any] = {}
        self._window = window
        self._room = asyncio.Event()
        self._lock = asyncio.Lock()
        self._queue: asyncio.Queue[Any] = asyncio.Queue(1)
        self._pump = asyncio.ensure_future(self._pull(source))
        self._quiet_since = time.monotonic()

    async def _pull(self, source: AsyncIterator[Any]) -> None:
        async for value in source:
            await self._queue.put(value)
        await self._queue.put(_END)

    @property
    def pending(self) -> bool:
        return self.hi > self.lo

    @property
    def done(self) -> bool:
        return self.exhausted and not self.pending

    def quiet_for(self) -> float:
        return time.monotonic() - self._quiet_since

    def ack(self, step: int) -> None:
        self._values.pop(step, None)
        self.lo = step + 1
        self._quiet_since = time.monotonic()
        self._room.set()

    async def value_at(self, step: int) -> Any:
        """The input of ``step``, drawing from the source as needed; _END after the last."""
        while step >= self.lo + self._window:
            self._room.clear()
            await self._room.wait()
        if step < self.hi:
            return self._values[step]
        async with self._lock:  # one puller at a time: attempts may overlap briefly
            while step >= self.hi and not self.exhausted:
                value = await self._queue.get()
                if value is _END:
                    self.exhausted = True
                    break
                if not self.pending:
                    self._quiet_since = time.monotonic()
                self._values[self.hi] = value
                self.hi += 1
        return self._values[step] if step < self.hi else _END

    async def requests(self, per_message: int) -> AsyncIterator[pb.StreamRequest]:
        step = self.lo
        while True:
            group: list[pb.StepInput] = []
            while len(group) < per_message:
                step = max(step, self.lo)
                value = await self.value_at(step)
                if value is _END:
                    break
                group.append(step_input(self.session_id, step, value))
                step += 1
            if group:
                yield pb.StreamRequest(steps=group)
            if len(group) < per_message:
                return

    async def close(self) -> None:
        self._pump.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)


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
