"""The order of work inside a resident session (``Session``): steps and control operations
through one queue; a session leaving memory answers everything that waits in it."""

from __future__ import annotations

import asyncio

import numpy as np

from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.sessions.config import SessionConfig
from ssmserve.server.sessions.session import Session, StepJob
from ssmserve.server.state.input_log import RecentSteps
from ssmserve.server.state.lease import SessionLease


class _Moved(SsmserveError):
    kind = ErrorKind.UNAVAILABLE


def test_a_control_operation_queued_behind_steps_is_answered_when_the_session_leaves(
    demo_model: MambaModel,
) -> None:
    """Found by a full run on a loaded machine: a Migrate waited behind steps the stepper
    had not taken yet, the lease was lost, the session left memory, and the Migrate's gate
    never opened (it hung until the client's deadline). Now it gets the session's error."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        s = Session(
            "s1", demo_model, "demo", SessionConfig(), demo_model.new_state(), 0, 0.0,
            RecentSteps(4, 4), SessionLease("s1", "x.1", "w1"), lambda _s: None,
        )  # fmt: skip
        value = np.zeros(demo_model.config.input_dim, np.float32)
        job = StepJob(1, value, value.tobytes(), loop.create_future())
        s.queue.append(job)  # queued, not yet taken by a stepper: the session is not busy

        async def control() -> None:
            async with s.exclusive():
                raise AssertionError("must not get the session once it left")

        waiter = asyncio.create_task(control())
        await asyncio.sleep(0)  # its gate is in the queue, behind the step
        assert not waiter.done() and not s.busy
        s.fail_queued(_Moved("moved to worker B"))
        try:
            await asyncio.wait_for(waiter, 5)  # a bound on the guarantee, not a guess
        except _Moved:
            pass
        else:
            raise AssertionError("the control operation should have failed")
        assert job.future.result().error is not None
        assert not s.queue and not s.busy

    asyncio.run(scenario())
