"""The blocking client: :class:`~ssmserve.client.aio.AsyncClient`'s methods, called synchronously.

    with Client("127.0.0.1:50051") as client:
        session = client.create_session("demo")
        for out in client.stream_steps(session, signal):
            ...

One implementation serves both APIs: the async client runs on a private event loop in a
background thread, and each method here waits for its result there. Async iterators
(``stream_steps``, ``drain``) come back as ordinary iterators. Each method is written out
(not forwarded by ``__getattr__``), so that ``help(Client)``, IDEs and type checkers see
it; its docstring is the async method's (``tests/test_client_api.py`` checks both match).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, TypeVar

from ssmserve.client.aio import DEFAULT_MAX_MESSAGE, AsyncClient
from ssmserve.client.prompt_calls import PREFILL_STEPS_PER_MESSAGE
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.step_values import Forecast, SessionHistory, SessionRef, StepOutput
from ssmserve.client.sync_cluster import ClusterCalls
from ssmserve.client.sync_generate import GenerateCalls
from ssmserve.client.tls import TlsConfig
from ssmserve.v1 import ssmserve_pb2 as pb

T = TypeVar("T")
# How long closing waits for a call that Ctrl-C cut to unwind on the loop thread.
_UNWIND_S = 5.0


class Client(ClusterCalls, GenerateCalls):
    """A blocking client of one ssmserve cluster: sessions, their steps, snapshots,
    rollbacks, forecasts, forks and checkpoints (here), and the cluster's workers and
    models (:class:`~ssmserve.client.sync_cluster.ClusterCalls`).

    Every method may also raise, besides the errors it names:
    ``ServerUnreachable`` (no worker could be connected to, and none ever answered this
    client), ``Unavailable`` or ``DeadlineExceeded`` (workers stopped answering for longer
    than ``RetryPolicy.give_up_after_s``), ``Unauthenticated`` or ``PermissionDenied``
    (the token is missing, unknown, or its role may not do this); all are
    ``SsmserveClientError`` (:mod:`ssmserve.client.errors`).
    """

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
        self.address = address if isinstance(address, str) else address[0]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"ssmserve-client[{self.address}]", daemon=True
        )
        self._thread.start()

        async def make() -> AsyncClient:
            return AsyncClient(
                address, max_message_bytes, retry=retry, discover=discover, tls=tls, token=token
            )

        self._aio = self._run(make())
        self.address = self._aio.address

    # ------------------------------------------------------------------ plumbing

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C here: the call stops on the loop thread too
            raise

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._run(_aclose(agen))

    def close(self) -> None:
        """Close every channel; calls still running end with CANCELLED. Safe to repeat."""
        if self._loop.is_closed():
            return
        self._run(self._aio.close())
        self._run(_end_tasks_left())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def addresses(self) -> list[str]:
        """Every worker this client knows (given, redirected to, or discovered)."""
        return list(self._aio.addresses)

    def owner_of(self, session: SessionRef) -> str:
        """The address of the worker this client last saw serving ``session`` (an id or
        a SessionInfo), or its first address. Asks nobody; raises nothing."""
        return self._aio.owner_of(session)

    # ------------------------------------------------------------------ sessions

    def create_session(
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
        return self._run(
            self._aio.create_session(
                model,
                session_id,
                snapshot_every=snapshot_every,
                max_snapshots=max_snapshots,
                history_window=history_window,
                guards=guards,
                durability=durability,
                idle_ttl_s=idle_ttl_s,
                labels=labels,
                snapshot_phase=snapshot_phase,
            )
        )

    def get_session(self, session: SessionRef) -> pb.SessionInfo:
        """The session (an id or a SessionInfo) as the cluster has it now.

        Returns a fresh SessionInfo: its step, model, input and output widths, config,
        snapshots, owner. Raises NotFound (no such session)."""
        return self._run(self._aio.get_session(session))

    def list_sessions(self, model: str = "", page_size: int = 0) -> list[pb.SessionInfo]:
        """Every session of the cluster (of ``model`` only, if given), all pages fetched
        ``page_size`` at a time (0: the worker's page size). Returns a list of
        SessionInfo. Raises InvalidArgument (a bad page size)."""
        return self._run(self._aio.list_sessions(model, page_size))

    def close_session(
        self, session: SessionRef, final_snapshot: bool = False
    ) -> pb.CloseSessionResponse:
        """Close the session (an id or a SessionInfo): it takes no more steps.

        ``final_snapshot``: snapshot it first, so it can still be exported. Returns the
        step it closed at and that snapshot's id. Raises NotFound (no such session)."""
        return self._run(self._aio.close_session(session, final_snapshot))

    # ------------------------------------------------------------------ steps

    def step(self, session: SessionRef, value: Any, step: int | None = None) -> StepOutput:
        """One step of the session (an id or a SessionInfo) on a stream of its own:
        simple, not fast (``stream_steps`` sends many).

        ``value``: a token id (int) or an input vector (anything numpy makes floats of);
        ``step``: its number (default: the session's next). Returns its StepOutput.
        Raises StepFailed (the step was answered with an error: a bad input, a guard),
        NotFound (no such session)."""
        return self._run(self._aio.step(session, value, step))

    def stream_steps(
        self,
        session: SessionRef,
        inputs: Iterable[Any] | AsyncIterable[Any],
        *,
        first_step: int | None = None,
        steps_per_message: int = 1,
        raise_on_error: bool = True,
        last_outputs_only: bool = False,
    ) -> Iterator[StepOutput]:
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
        return self._iterate(
            self._aio.stream_steps(
                session,
                inputs,
                first_step=first_step,
                steps_per_message=steps_per_message,
                raise_on_error=raise_on_error,
                last_outputs_only=last_outputs_only,
            )
        )

    def prefill(
        self,
        session: SessionRef,
        inputs: Sequence[Any],
        *,
        first_step: int | None = None,
        steps_per_message: int = PREFILL_STEPS_PER_MESSAGE,
    ) -> StepOutput:
        """Send ``inputs`` (a prompt's token ids, or vectors) as the session's next steps
        and return the last step's StepOutput: its output (next-token logits) is the only
        one computed and sent back (``stream_steps`` with ``last_outputs_only``, whole
        messages of ``steps_per_message`` steps, each prefilled by the worker at matrix
        speed). ``first_step`` as in ``stream_steps``; a cut stream resumes the same way.
        Raises ValueError for no inputs, and what ``stream_steps`` raises."""
        return self._run(
            self._aio.prefill(
                session, inputs, first_step=first_step, steps_per_message=steps_per_message
            )
        )

    # ------------------------------------------------------------------ snapshots, rollback

    def snapshot(self, session: SessionRef, label: str = "") -> pb.SnapshotInfo:
        """Snapshot the session (an id or a SessionInfo) at its current step, named
        ``label`` if given (``rollback(to_label=...)`` finds it). Returns the snapshot's
        SnapshotInfo. Raises NotFound (no such session), InvalidArgument (a bad label)."""
        return self._run(self._aio.snapshot(session, label))

    def list_snapshots(self, session: SessionRef) -> list[pb.SnapshotInfo]:
        """The kept snapshots of the session (an id or a SessionInfo), oldest first, as
        SnapshotInfo. Raises NotFound (no such session)."""
        return self._run(self._aio.list_snapshots(session))

    def rollback(
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
        return self._run(
            self._aio.rollback(
                session, to_step=to_step, to_snapshot=to_snapshot, to_label=to_label, back=back
            )
        )

    # ------------------------------------------------------------------ forecast, fork

    def forecast(
        self, session: SessionRef, horizon: int, *, at_step: int | None = None
    ) -> Forecast:
        """Run the model of the session (an id or a SessionInfo) ``horizon`` steps ahead
        on its own outputs, from its current step or from ``at_step``; the session is
        not changed.

        Returns a Forecast: the outputs (and token ids of a token model) of the steps
        after it, and ``stopped`` when a guard or a non-finite output ended it early.
        Raises InvalidArgument (a bad horizon, or a model that cannot feed its outputs
        back), NotFound, ResourceExhausted (too many forecasts at once)."""
        return self._run(self._aio.forecast(session, horizon, at_step=at_step))

    def history(self, session: SessionRef, from_step: int = 0, to_step: int = 0) -> SessionHistory:
        """What the session (an id or a SessionInfo) did over steps ``from_step`` ..
        ``to_step`` (0: from the oldest it can replay, to its current step).

        Returns a SessionHistory: the inputs, the outputs as they were answered, its
        snapshots and events (rollbacks, guards). Raises NotFound, FailedPrecondition
        (steps older than its kept snapshots reach)."""
        return self._run(self._aio.history(session, from_step, to_step))

    def fork(
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
        return self._run(
            self._aio.fork(
                session,
                at_step=at_step,
                at_snapshot=at_snapshot,
                at_label=at_label,
                new_session_id=new_session_id,
                target=target,
            )
        )

    # ------------------------------------------------------------------ export, import

    def export_checkpoint(
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
        return self._run(self._aio.export_checkpoint(session, snapshot_id, progress=progress))

    def import_checkpoint(
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
        return self._run(
            self._aio.import_checkpoint(
                blob, session_id, model=model, replace=replace, config=config, progress=progress
            )
        )


async def _end_tasks_left() -> None:
    """Cancel the tasks still on the loop and let them end, within ``_UNWIND_S``.

    A closed channel can leave gRPC's own per-call tasks (``_handle_status_once_received``)
    one loop turn from their end; a loop stopped then closes with them pending, and Python
    prints "Task was destroyed but it is pending!" at exit, after the CLI's last line."""
    left = asyncio.all_tasks() - {asyncio.current_task()}
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=_UNWIND_S)
    for task in left:  # an error it ended with is retrieved: Python prints none at exit
        if task.done() and not task.cancelled():
            task.exception()
    await asyncio.get_running_loop().shutdown_asyncgens()


async def _aclose(agen: AsyncIterator[Any]) -> None:
    """Close an async generator whose ``__anext__`` Ctrl-C may have cut: that call is
    cancelled and unwinds on the loop first (aclose() of a running generator raises)."""
    close = getattr(agen, "aclose", None)
    if close is None:
        return
    deadline = asyncio.get_running_loop().time() + _UNWIND_S
    while True:
        try:
            await close()
            return
        except RuntimeError:  # still running: its cancelled step is unwinding
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.01)
