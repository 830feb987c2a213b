"""A session's stream of steps that survives moves and faults: ``ResumableStream``.

The stream follows the session: when it is cut (the session moved, its worker died or
froze, the store was briefly away), it reconnects to the owner and resends every input
not yet answered. Steps are numbered, so a resend of an applied step is answered with its
recorded output and never applied twice; each step is yielded exactly once, in order.
At most ``RetryPolicy.window`` steps (or one message) are outstanding.

A session can come back *behind* steps that were answered: ``snapshot`` and ``none``
durability keep the steps since the last flush in memory only, and a crash loses them
(or a store loses writes). The worker then answers SESSION_REWOUND (or STEP_GAP) with the
step the session is at; the stream sends the inputs again from there if it still holds
them (the last ``RetryPolicy.rewind_window`` answered ones), without yielding those
steps a second time, and raises :class:`SessionRewound` if it does not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import grpc

from ssmserve.client.errors import (
    GAP_REASONS,
    SessionRewound,
    SsmserveClientError,
    StepFailed,
    Unavailable,
    from_rpc_error,
    step_redirect,
)
from ssmserve.client.retry import Backoff
from ssmserve.client.routing import TRANSIENT_NUMBERS, WorkerRouter, session_metadata
from ssmserve.client.step_values import StepOutput, step_input
from ssmserve.v1 import ssmserve_pb2 as pb

_LOST_STATUS = "Internal error from Core"
_END = object()


class ResumableStream:
    """Send ``inputs`` as steps ``first_step``, ``first_step + 1``, ... of one session;
    iterate to get each answer once, in order, wherever the session is served."""

    def __init__(
        self,
        router: WorkerRouter,
        session_id: str,
        inputs: Iterable[Any] | AsyncIterable[Any],
        first_step: int,
        steps_per_message: int = 1,
        raise_on_error: bool = True,
        last_outputs_only: bool = False,
    ) -> None:
        self.router = router
        self.session_id = session_id
        self.inputs = inputs
        self.first_step = first_step
        self.steps_per_message = steps_per_message
        self.raise_on_error = raise_on_error
        self.last_outputs_only = last_outputs_only  # every message, resent ones included

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        router, session_id = self.router, self.session_id
        steps_per_message = self.steps_per_message
        # At least one message's worth may be outstanding, or a message would never fill.
        window = max(router.retry.window, steps_per_message)
        feed = _StepFeed(
            session_id, _aiter(self.inputs), self.first_step, window, router.retry.rewind_window
        )
        backoff = Backoff(router.retry)
        address = router.owner_of(session_id)
        try:
            while True:
                call = router.worker(address).sessions.Stream(
                    feed.requests(steps_per_message, self.last_outputs_only),
                    metadata=session_metadata(session_id),
                )
                try:
                    async for result in self._answers(call, feed):
                        backoff.progress()
                        router.served(session_id, address)
                        if self.raise_on_error and result.HasField("error"):
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
                    address = await router.locate(session_id, address)
                    continue
                address = await router.next_address(address, error, backoff, session_id)
        finally:
            await feed.close()

    async def _answers(
        self, call: grpc.aio.StreamStreamCall, feed: _StepFeed
    ) -> AsyncIterator[pb.StepResult]:
        """The stream's answers, each once and in step order; _Retry when it must resume."""
        stall = self.router.retry.stall_timeout_s
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
                if result.step <= feed.yielded and not result.HasField("error"):
                    feed.ack(result.step)  # answered before the session rewound: again
                    continue
                if result.step != feed.lo:
                    raise SsmserveClientError(
                        f"session {feed.session_id!r}: the answer to step {result.step} came "
                        f"before the answer to step {feed.lo}"
                    )
                if result.HasField("error") and feed.behind(result.error):
                    # The session is behind steps this stream was answered: send the
                    # inputs again from where it is (their answers are not yielded again).
                    raise _Retry(feed.rewind(result.error.session_step, result.error.message))
                if result.HasField("error") and result.error.code in TRANSIENT_NUMBERS:
                    # Not applied: the session moved (go to its owner), or the store or the
                    # session is briefly away (retry). Resume from this step.
                    raise _Retry(
                        step_redirect(result.error)
                        or Unavailable(result.error.message, result.error.reason)
                    )
                feed.ack(result.step)
                yield result


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
        self,
        session_id: str,
        source: AsyncIterator[Any],
        first_step: int,
        window: int,
        rewind_window: int = 0,
    ) -> None:
        self.session_id = session_id
        self.lo = first_step  # the first unanswered step
        self.hi = first_step  # the next step number to draw from the source
        self.yielded = first_step - 1  # the last step whose answer was yielded
        self.answered_here = False  # a step of this stream was answered
        self.exhausted = False
        self._values: dict[int, Any] = {}
        # Answered inputs kept for a rewind: step -> value, the newest rewind_window.
        self._answered: dict[int, Any] = {}
        self._rewind_window = rewind_window
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
        value = self._values.pop(step, _END)
        if self._rewind_window and value is not _END:
            self._answered[step] = value
            self._answered.pop(step - self._rewind_window, None)
        self.lo = step + 1
        self.yielded = max(self.yielded, step)
        self.answered_here = True
        self._quiet_since = time.monotonic()
        self._room.set()

    def behind(self, error: pb.StepError) -> bool:
        """Whether ``error`` says the session is behind steps answered to this stream:
        SESSION_REWOUND (it came back from the store) behind the steps this stream
        started after or was answered, or a STEP_GAP behind a step this very stream was
        answered (a gap past what it was answered is the caller's own, and stays one)."""
        if error.reason not in GAP_REASONS or not error.HasField("session_step"):
            return False
        if error.reason == "SESSION_REWOUND":
            return error.session_step < self.lo - 1
        return self.answered_here and error.session_step < self.lo - 1

    def rewind(self, session_step: int, why: str) -> SsmserveClientError:
        """The session is at ``session_step``, behind answered steps: put their inputs
        back to be sent again from ``session_step + 1`` (their answers are not yielded a
        second time). Returns the error to resume with; SessionRewound if the inputs
        from there are no longer kept."""
        first = session_step + 1
        if any(step not in self._answered for step in range(first, self.lo)):
            raise SessionRewound(
                f"session {self.session_id!r} came back at step {session_step}, behind step "
                f"{self.lo - 1} that was answered, and this stream no longer holds the "
                f"inputs from step {first} on (it keeps the last "
                f"{self._rewind_window} answered): send them again from step {first} "
                f"({why})",
                self.session_id,
                session_step,
                self.lo - 1,
            )
        for step in range(first, self.lo):
            self._values[step] = self._answered.pop(step)
        self.lo = first
        return Unavailable(
            f"session {self.session_id!r} came back at step {session_step}: resending from "
            f"step {first}",
            "SESSION_REWOUND",
        )

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

    async def requests(
        self, per_message: int, last_outputs_only: bool = False
    ) -> AsyncIterator[pb.StreamRequest]:
        """This attempt's messages, from the first unanswered step; each asks for only its
        last output when ``last_outputs_only`` (a resumed stream's too)."""
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
                yield pb.StreamRequest(
                    steps=group, packed_outputs=True, last_outputs_only=last_outputs_only
                )
            if len(group) < per_message:
                return

    async def close(self) -> None:
        self._pump.cancel()
        await asyncio.gather(self._pump, return_exceptions=True)


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
