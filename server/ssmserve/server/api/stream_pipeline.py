"""The Stream pipeline: requests read ahead, their steps queued, answers in order.

:class:`StreamReader` reads one Stream's requests (up to ``max_inflight_messages`` ahead
of their answers) and queues each message's steps: consecutive steps of one session as
one run, answered as a whole, the others one by one (each a run of one, answered with its
own StepOutcome). A message with ``last_outputs_only`` answers only the last step of each
such run with its output: its runs are queued ``last_only`` (a prefill then computes just
that output), and the steps of a run that had to go one by one (its inputs did not fit the
session's queue, or failed their checks) are answered without theirs but the last. The
handler awaits each message's futures in request
order and writes them with :func:`answer_responses`, split to stay below the message
limit (:func:`split_results`). Every problem of a step, a redirect included, is answered
in its StepResult: ending a bidi call while the client still writes can reach the client
as INTERNAL with the real status lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import numpy as np

from ssmserve.server.api.conversions import (
    PackedInputs,
    fill_result,
    fill_run_results,
    step_value,
    vector_value,
)
from ssmserve.server.api.imports import RequestError
from ssmserve.server.api.tenancy import TenantScope
from ssmserve.server.errors import ErrorKind, SsmserveError, being_cancelled, clip
from ssmserve.server.sessions.intake import StepIntake
from ssmserve.server.sessions.session import SessionGoneError, StepOutcome, StepRun
from ssmserve.v1 import ssmserve_pb2 as pb


class StreamLimitError(SsmserveError):
    """A stream message carries more steps than a message may."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class StreamReader:
    """Reads one Stream's requests and queues the futures of their steps.

    The queue is unbounded; ``slots`` bounds how many messages are read ahead of their
    answers, so cancelling the stream (the client went away) never leaves the reader
    blocked on a full queue.
    """

    def __init__(
        self,
        intake: StepIntake,
        scope: TenantScope,
        max_steps_per_message: int,
        max_inflight_messages: int,
        refusal: Callable[[], SsmserveError | None] = lambda: None,
    ) -> None:
        self.intake = intake
        self.scope = scope
        self.max_steps_per_message = max_steps_per_message
        self.refusal = refusal  # set: every step is answered with it, none is applied
        # Per message: when it arrived, the futures of its steps (one per step or run),
        # whether it asked for packed outputs, how many steps it has, and which futures
        # (lone steps, by index) are answered without their output (last_outputs_only).
        self.answers: asyncio.Queue[
            tuple[float, list[_Answer], bool, int, frozenset[int]] | None
        ] = asyncio.Queue()
        self.slots = asyncio.Semaphore(max_inflight_messages)
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
                silent: set[int] = set()
                futures = await self._submit(request, silent)
                self.answers.put_nowait(
                    (received, futures, request.packed_outputs, len(request.steps),
                     frozenset(silent))
                )  # fmt: skip
        except SsmserveError as exc:
            self.failure = exc
        finally:
            self.answers.put_nowait(None)

    async def _submit(self, request: pb.StreamRequest, silent: set[int]) -> list[_Answer]:
        """The futures of ``request``'s steps; ``silent`` gets the indices of those
        answered without their output (``last_outputs_only``: a lone step not last in its
        run of the message)."""
        loop = asyncio.get_running_loop()
        last_only = request.last_outputs_only
        futures: list[_Answer] = []
        if (refusal := self.refusal()) is not None:
            for step in request.steps:
                future = loop.create_future()
                future.set_result(StepOutcome(step.session_id, step.step, error=refusal))
                futures.append(future)
            return futures
        limit = self.max_steps_per_message
        steps = request.steps
        too_many = len(steps) > limit
        packed = None if too_many else PackedInputs.of(steps)
        i = 0
        stepwise = 0  # steps before this index go one by one (their run was refused)
        while i < len(steps):
            step = steps[i]
            if not too_many and i >= stepwise and (end := run_end(steps, i)) - i > 1:
                try:
                    run = await self._submit_run(steps, packed, i, end, last_only)
                except SsmserveError as exc:  # the session cannot be loaded: each step says so
                    for step in steps[i:end]:
                        future = loop.create_future()
                        future.set_result(StepOutcome(step.session_id, step.step, error=exc))
                        futures.append(future)
                    i = end
                    continue
                if run is not None:
                    futures.append(run)
                    i = end
                    continue
                stepwise = end
                if last_only:  # answered one by one: all but the run's last without output
                    silent.update(range(len(futures), len(futures) + end - i - 1))
            try:
                if too_many:
                    raise StreamLimitError(
                        f"a message may carry at most {limit} steps, this one has "
                        f"{len(request.steps)}; none of them was applied"
                    )
                sid = self.scope.stored(step.session_id)
                finite = packed is not None
                value = packed.value(i) if packed is not None else step_value(step)
                future = self.intake.submit_resident(sid, step.step, value, finite)
                if future is None:  # not in memory: load it first
                    future = await self.intake.submit(sid, step.step, value, finite)
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

    async def _submit_run(
        self,
        steps: Sequence[pb.StepInput],
        packed: PackedInputs | None,
        lo: int,
        hi: int,
        last_only: bool,
    ) -> asyncio.Future[StepRun] | None:
        """Steps ``lo:hi`` of a message (one session, consecutive step numbers) queued as
        one run, the session loaded first if it is not in memory; None when they go step
        by step (then each step's checks answer it). Raises what keeps the session from
        loading."""
        values = run_values(steps, packed, lo, hi)
        if values is None:
            return None
        try:
            sid = self.scope.stored(steps[lo].session_id)
        except SsmserveError:
            return None
        future = self.intake.submit_run_resident(sid, steps[lo].step, values, last_only)
        if future is None:
            future = await self.intake.submit_run(sid, steps[lo].step, values, last_only)
        return future


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


def answer_responses(
    outcomes: Sequence[StepOutcome | StepRun],
    scope: TenantScope,
    packed: bool,
    budget: int,
    silent: frozenset[int] = frozenset(),
) -> Iterator[pb.StreamResponse]:
    """The answers to one request: built in place in one response (each StepResult added
    to it, its size computed once, in C), split by :func:`split_results` only when they
    exceed ``budget``. Building each result alone and copying it in cost ~2x the CPU.
    ``silent``: indices of lone steps answered without their output."""
    response = pb.StreamResponse()
    add = response.results.add
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, StepRun):
            fill_run_results(add, outcome, scope, packed)
        else:
            fill_result(add(), outcome, scope, packed, i not in silent)
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
