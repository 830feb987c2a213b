"""Step intake: a stream's steps checked and queued on their sessions' steppers.

Every step a worker takes comes in here and is queued as a
:class:`~ssmserve.server.sessions.session.StepRun`: one at a time, a run of one answered
with its StepOutcome (:meth:`StepIntake.submit`, with the load of a session that is not
in memory), or a message's consecutive steps of one resident session as one run
(:meth:`StepIntake.submit_run_resident`, or :meth:`StepIntake.submit_run`, which loads
the session first). What is wrong with a step (its number, its
input, a full queue) is raised here, before anything is queued, so the session is
untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from ssmserve.server.engine.config import MambaConfig
from ssmserve.server.sessions.errors import BadStepInputError, CapacityError, StepRangeError
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.session import Session, StepOutcome, StepRun
from ssmserve.server.sessions.stepper import Stepper
from ssmserve.server.state.store_layout import MAX_STEP


class StepIntake:
    def __init__(
        self, loader: SessionLoader, steppers: Mapping[str, Stepper], max_queued_steps: int
    ) -> None:
        self.loader = loader
        self.steppers = steppers  # by model key (``ModelLanes.steppers``, shared)
        self.max_queued_steps = max_queued_steps  # per session, waiting for the stepper
        self.loop: asyncio.AbstractEventLoop | None = None  # the worker's, from start()

    def start(self) -> None:
        """Remember the running loop: asking for it costs a getpid() per step on 3.11."""
        self.loop = asyncio.get_running_loop()

    async def submit(
        self, session_id: str, step: int, value: object, finite: bool = False
    ) -> asyncio.Future[StepOutcome]:
        """Queue one step; the future resolves when it is answered (errors in the outcome).

        Raises for problems found before queueing (unknown session, bad input); the session
        is untouched then. ``finite``: the caller checked that a vector ``value`` is
        finite (a whole message at once), so it is not checked again.
        """
        future = self.submit_resident(session_id, step, value, finite)
        if future is None:  # not in memory: load it (or learn why not)
            future = self._submit(await self.loader.session(session_id), step, value, finite)
        return future

    def submit_resident(
        self, session_id: str, step: int, value: object, finite: bool = False
    ) -> asyncio.Future[StepOutcome] | None:
        """:meth:`submit` without a coroutine, for a session in memory; None if it is not.

        A stream calls this for every step it reads, so the common case makes no
        coroutine and no task switch."""
        if step > MAX_STEP:
            raise StepRangeError(
                f"step {step} is beyond the last step a session can take ({MAX_STEP})"
            )
        s = self.loader.residents.get(session_id)
        return None if s is None else self._submit(s, step, value, finite)

    async def submit_run(
        self, session_id: str, first: int, values: np.ndarray, last_only: bool = False
    ) -> asyncio.Future[StepRun] | None:
        """:meth:`submit_run_resident`, loading the session first if it is not in memory
        (a prompt to a session that was evicted or whose worker died still goes as one
        run, so it can be prefilled). None when the steps must go one by one."""
        future = self.submit_run_resident(session_id, first, values, last_only)
        if future is None and self.loader.residents.get(session_id) is None:
            await self.loader.session(session_id)  # raises what keeps it from loading
            future = self.submit_run_resident(session_id, first, values, last_only)
        return future

    def submit_run_resident(
        self, session_id: str, first: int, values: np.ndarray, last_only: bool = False
    ) -> asyncio.Future[StepRun] | None:
        """Queue the steps ``first, first + 1, ...`` of a session in memory as one
        :class:`StepRun`: ``values`` token ids (T,) int64 or vectors (T, i) float32
        checked finite. None when they must go step by step instead (:meth:`submit`): the
        session is not in memory, the steps do not fit its queue, or the inputs are not
        for its model (each step's own check then says which is wrong). ``last_only``:
        only the last step is answered with its output (``StepRun.last_only``).
        """
        s = self.loader.residents.get(session_id)
        count = values.shape[0]
        if (
            s is None
            or first + count - 1 > MAX_STEP
            or s.queued_steps + count > self.max_queued_steps
            or not run_fits_model(s.model.config, values)
        ):
            return None
        loop = self.loop or asyncio.get_running_loop()
        future: asyncio.Future[StepRun] = loop.create_future()
        run = StepRun(
            s.id, first, values, s.codec.encode(values), s.model.config.output_dim, future,
            last_only,
        )  # fmt: skip
        self.steppers[s.model_name].submit(s, run)
        return future

    def _submit(
        self, s: Session, step: int, value: object, finite: bool
    ) -> asyncio.Future[StepOutcome]:
        arr = check_step_input(s, value, finite)
        if s.queued_steps >= self.max_queued_steps:
            raise CapacityError(
                f"session {s.id!r} already has {s.queued_steps} steps queued "
                f"(limit {self.max_queued_steps}); wait for answers before sending more"
            )
        loop = self.loop or asyncio.get_running_loop()  # the call costs a getpid() on 3.11
        future: asyncio.Future[StepOutcome] = loop.create_future()
        run = StepRun.one(s.id, step, arr, s.codec.encode(arr), future)
        self.steppers[s.model_name].submit(s, run)
        return future


def run_fits_model(c: MambaConfig, values: np.ndarray) -> bool:
    """Whether a run's inputs (already checked finite) are valid steps of this model."""
    if c.is_token_model:
        return (
            values.ndim == 1
            and values.dtype == np.int64
            and bool((values >= 0).all() and (values < c.vocab_size).all())
        )
    return values.ndim == 2 and values.dtype == np.float32 and values.shape[1] == c.input_dim


def check_step_input(s: Session, value: object, finite: bool) -> np.ndarray:
    """A step's input for ``s``'s model, or BadStepInputError saying what is wrong.
    ``finite``: the caller already checked that a vector is finite (a whole message)."""
    c = s.model.config
    if c.is_token_model:
        if not isinstance(value, int):
            raise BadStepInputError(
                f"model {s.model_name!r} takes token ids, not a vector of floats"
            )
        if not 0 <= value < c.vocab_size:
            raise BadStepInputError(f"token id {value} is outside [0, {c.vocab_size})")
        return np.asarray(value, np.int64)
    if isinstance(value, int):
        raise BadStepInputError(f"model {s.model_name!r} takes float vectors, not token ids")
    arr = np.asarray(value, np.float32)
    if arr.shape != (c.input_dim,):
        raise BadStepInputError(
            f"model {s.model_name!r} takes vectors of {c.input_dim} values, got {arr.size}"
        )
    if not finite and not np.isfinite(arr).all():
        raise BadStepInputError("input vector contains NaN or Inf")
    return arr
