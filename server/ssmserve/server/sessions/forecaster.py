"""Forecasts: a session's model run ahead on its own outputs, batched across sessions.

A forecast starts from a state and the output of the step it is at, both taken by the
session manager between two steps (``SessionManager.forecast``). States are values, so
the session goes on stepping meanwhile and is never changed by its forecasts.

Each model's :class:`Forecaster` runs ticks like the stepper: one engine call over every
running forecast (up to ``max_batch``), each advancing one step, on the model's
:class:`EngineLane`, so forecast ticks take turns with step batches. A new
forecast joins at the next tick; a finished one leaves. Batch invariance makes each
row's bits independent of what else is in the call, so a forecast equals, bit for bit,
stepping a copy of the session with its own answers:

- the input of step t + 1 is the (guarded) output of step t: the vector itself for signal
  models (output_dim == input_dim), the argmax token for token models;
- the session's guards judge each output as they would a step's: CLAMP clips what is
  returned and fed back, REPORT adds events, REJECT and ROLLBACK end the forecast there
  (the step would not have been applied); guards that carry state (``stateful_guards``)
  start from the session's guard state at the forecast's first step, judge each fed-back
  input before its step (IMPUTE puts the previous output in, which is that input
  already) and advance as the session's would;
- an output with NaN or Inf ends the forecast after that step when another step needs it
  as input, as a client sending it would get INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import ErrorKind, SsmserveError, being_cancelled
from ssmserve.server.sessions.guards import (
    GuardAction,
    GuardEvent,
    GuardRule,
    GuardVerdict,
    check_output,
)
from ssmserve.server.sessions.memory import MemoryReservation
from ssmserve.server.sessions.session import (
    GuardRejectedError,
    GuardRolledBackError,
    SessionGoneError,
)
from ssmserve.server.sessions.stateful_guards import InputVerdict, judge_input, judge_step
from ssmserve.server.state.checkpoint import GuardState
from ssmserve.server.state.lease import SessionLease

log = logging.getLogger(__name__)


class ForecastUnsupportedError(SsmserveError):
    """The model's outputs cannot be fed back as its inputs (INVALID_ARGUMENT)."""


class BadHorizonError(SsmserveError):
    """A horizon of 0 steps (INVALID_ARGUMENT)."""


class ForecastLimitError(SsmserveError):
    """A horizon or output size over the server's limits, or too many forecasts at once."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class OutputNotFiniteError(SsmserveError):
    """An output with NaN or Inf would have to be fed back as an input."""

    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class ForecastSettings:
    """Limits of forecasts on one worker (documented defaults)."""

    max_horizon: int = 1024  # steps per forecast; more is RESOURCE_EXHAUSTED
    # horizon x output_dim x 4 bytes per forecast: what one answer may hold in memory
    # (64 MiB is 333 steps of mamba-130m logits, or 4M steps of 4-channel signal).
    max_output_bytes: int = 64 << 20
    max_running: int = 256  # forecasts queued or running per model; more are refused
    max_batch: int = 256  # forecasts per engine call
    message_bytes: int = 1 << 20  # output bytes per response message (at least one step)


@dataclass(frozen=True)
class ForecastStep:
    step: int  # the step this output would belong to
    output: np.ndarray | None  # (o,); None when a guard stopped the forecast at this step
    token: int | None  # token models: argmax of ``output``, the next input
    guard_events: Sequence[GuardEvent] = ()


def feedback(model: Engine, step: int, output: np.ndarray) -> np.ndarray:
    """The input that follows ``output`` (of ``step``): its argmax token, or itself."""
    if model.config.is_token_model:
        return np.asarray(np.argmax(output), np.int64)  # () lowest id among equal maxima
    if not np.isfinite(output).all():
        raise OutputNotFiniteError(
            f"the output of step {step} contains NaN or Inf, so it cannot be fed back as the "
            f"input of step {step + 1}"
        )
    return output  # (o,) == (i,) float32: the bits a client would send back


@dataclass(eq=False)
class ForecastJob:
    """One forecast: where it is, and the steps it produced that nobody has read yet."""

    session_id: str
    guards: tuple[GuardRule, ...]
    from_step: int
    horizon: int
    state: SessionState  # at ``step``
    next_input: np.ndarray  # () int64 or (i,) float32
    step: int = 0  # the step ``state`` is at
    ready: list[ForecastStep] = field(default_factory=list)
    stopped: SsmserveError | None = None  # why it ended before ``horizon`` steps
    finished: bool = False
    cancelled: bool = False  # nobody reads it any more
    memory: MemoryReservation | None = None  # its bytes in the worker's memory budget
    message_bytes: int = 1 << 20  # output bytes per answer message (``ForecastSettings``)
    guard_state: GuardState | None = None  # at ``step``, when its guards carry state
    # The lease its starting point was read under: its answers leave only while it
    # surely runs (``api.answer_fence``); None: not checked.
    lease: SessionLease | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.step = self.from_step

    def emit(self, item: ForecastStep) -> None:
        self.ready.append(item)
        self._wake.set()

    def finish(self, stopped: SsmserveError | None = None) -> None:
        self.stopped = stopped
        self.finished = True
        self._wake.set()

    def close(self) -> None:
        """Nobody reads the forecast any more: stop computing it, give its memory back."""
        self.cancelled = True
        if self.memory is not None:
            self.memory.release()

    async def batches(self, max_bytes: int | None = None) -> AsyncIterator[list[ForecastStep]]:
        """The steps as they come, about ``max_bytes`` of outputs (at least one step;
        default ``message_bytes``) at a time, until the forecast finishes."""
        max_bytes = self.message_bytes if max_bytes is None else max_bytes
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.ready:
                size, n = 0, 0
                while n < len(self.ready) and (n == 0 or size < max_bytes):
                    output = self.ready[n].output
                    size += 0 if output is None else output.nbytes
                    n += 1
                batch, self.ready = self.ready[:n], self.ready[n:]
                yield batch
            if self.finished:
                return


class Forecaster:
    """The running forecasts of one model, stepped together."""

    def __init__(self, model: Engine, engine: EngineLane, settings: ForecastSettings) -> None:
        self.model = model
        self.engine = engine
        self.settings = settings
        self._jobs: list[ForecastJob] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0
        self.steps = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"forecaster[{self.model.name}]")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for job in self._jobs:
            job.finish(SessionGoneError("the worker stopped before the forecast was done"))
        self._jobs.clear()

    @property
    def running(self) -> int:
        return len(self._jobs)

    def check_room(self) -> None:
        """Raise ForecastLimitError when no further forecast may start now."""
        if len(self._jobs) >= self.settings.max_running:
            raise ForecastLimitError(
                f"this worker is already running {len(self._jobs)} forecasts of model "
                f"{self.model.name!r} (limit {self.settings.max_running}); retry later"
            )

    def submit(self, job: ForecastJob) -> None:
        self.check_room()
        self._jobs.append(job)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._jobs:
                batch = [j for j in self._jobs[: self.settings.max_batch] if not j.cancelled]
                try:
                    if batch:
                        await self._tick(batch)
                except (Exception, asyncio.CancelledError) as exc:
                    # A bug, or a task the tick awaited cancelled by someone else, must not
                    # end the forecaster (as in the stepper); stop() cancelling it must.
                    if isinstance(exc, asyncio.CancelledError) and being_cancelled():
                        raise
                    log.exception("forecast tick failed")
                    for job in batch:
                        job.finish(SessionGoneError(f"forecast failed: {exc!r}"))
                self._jobs = [j for j in self._jobs if not (j.finished or j.cancelled)]
                # An inline engine call does not yield: let the streams in between ticks.
                await asyncio.sleep(0)

    async def _tick(self, batch: list[ForecastJob]) -> None:
        judged: dict[int, InputVerdict] = {}  # by job id: its input rules' verdict
        running = []
        for job in batch:
            if job.guard_state is not None:
                before = judge_input(job.guards, job.guard_state, job.step + 1, job.next_input)
                if not before.applies_step:
                    assert before.action is not None
                    job.emit(ForecastStep(job.step + 1, None, None, before.events))
                    job.finish(_guard_stop(job.step + 1, before.action, before.events))
                    continue
                judged[id(job)] = before
            running.append(job)
        if not running:
            return
        new_batch, outputs = await self.engine.step(
            [j.state for j in running],
            [judged[id(j)].applied if id(j) in judged else j.next_input for j in running],
        )  # (b, o)
        self.ticks += 1
        self.steps += len(running)
        for row, job in enumerate(running):
            if job.cancelled:
                continue
            step = job.step + 1
            if job.guard_state is not None:
                both = judge_step(job.guards, job.guard_state, step, judged[id(job)], outputs[row])
                verdict = GuardVerdict(both.output.copy(), both.events, both.action)
                if both.applies_step:
                    job.guard_state = both.state
            else:
                verdict = check_output(job.guards, step, outputs[row].copy())  # (o,) own copy
            if not verdict.applies_step:
                job.emit(ForecastStep(step, None, None, verdict.events))
                job.finish(_guard_stop(step, verdict.action, verdict.events))
                continue
            output = verdict.output
            token = int(np.argmax(output)) if self.model.config.is_token_model else None
            job.emit(ForecastStep(step, output, token, verdict.events))
            job.step, job.state = step, new_batch.session(row)
            if step - job.from_step >= job.horizon:
                job.finish()
                continue
            try:
                job.next_input = feedback(self.model, step, output)
            except OutputNotFiniteError as exc:
                job.finish(exc)


def _guard_stop(step: int, action: GuardAction, events: Sequence[GuardEvent]) -> SsmserveError:
    breaking = next(e for e in events if e.action == action)
    what = "rejected" if action == GuardAction.REJECT else "asked for a rollback at"
    message = (
        f"guard {breaking.guard!r} {what} step {step} ({breaking.detail}); a session would not "
        f"apply that step, so the forecast ends before it"
    )
    if action == GuardAction.REJECT:
        return GuardRejectedError(message)
    return GuardRolledBackError(message)
