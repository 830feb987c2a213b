"""StepIntake on its own (``sessions/intake.py``): made from a real loader and the
model lanes' real steppers on a real redis-server (``tests/session_parts.py``), no
manager, no gRPC. Through its public submits:

- a step for a session not in memory here loads it first (from Redis, where another
  worker left it), then is answered bit-equal to the offline engine;
- a session's queue holds at most ``max_queued_steps``: one more is refused with
  RESOURCE_EXHAUSTED before anything is queued, and the queued steps are still answered;
- a step for a session that does not exist is refused NOT_FOUND, naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
import pytest

from ssmserve.server.api.status import grpc_code
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.sessions.config import Durability, SessionConfig
from ssmserve.server.sessions.errors import CapacityError
from ssmserve.server.sessions.intake import StepIntake
from ssmserve.server.state.store_errors import SessionMissingError
from tests.conftest import random_inputs
from tests.session_parts import STEP_TIMEOUT_S, session_parts, step_through

A_ADDRESS = "127.0.0.1:7201"  # registered, never listening: nothing here calls a peer
B_ADDRESS = "127.0.0.1:7202"


def _run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_a_step_for_a_session_not_in_memory_loads_it_first(
    redis_url: str, demo_model: MambaModel
) -> None:
    x = random_inputs(demo_model, 6, seed=4201)
    expected, _ = demo_model.run(x)

    async def body() -> None:
        a = await session_parts(redis_url, {"demo": demo_model}, A_ADDRESS)
        b = await session_parts(redis_url, {"demo": demo_model}, B_ADDRESS)
        try:
            a_loader = a.loader()
            sid = await a.lifecycle(a_loader).create("demo", "", SessionConfig())
            a_intake = StepIntake(a_loader, a.lanes.steppers, max_queued_steps=64)
            a_intake.start()
            a.lanes.start()
            await step_through(a_intake, sid, 1, x[:5])
            await a_loader.park(sid, "test")  # in Redis only, released

            intake = StepIntake(b.loader(), b.lanes.steppers, max_queued_steps=64)
            intake.start()
            b.lanes.start()
            assert intake.submit_resident(sid, 6, x[5]) is None  # not in memory here
            assert b.residents.get(sid) is None
            outcome = await asyncio.wait_for(await intake.submit(sid, 6, x[5]), STEP_TIMEOUT_S)
            assert outcome.error is None, outcome.error
            np.testing.assert_array_equal(
                outcome.output.view(np.uint32), expected[5].view(np.uint32)
            )
            s = b.residents.get(sid)
            assert s is not None and s.step == 6
            holder = await b.store.lease_holder(sid)
            assert holder is not None and holder.owner_addr == B_ADDRESS
        finally:
            await b.close()
            await a.close()

    _run(body)


def test_a_full_queue_refuses_one_more_step_and_answers_the_queued(
    redis_url: str, demo_model: MambaModel
) -> None:
    x = random_inputs(demo_model, 3, seed=4202)
    expected, _ = demo_model.run(x)

    async def body() -> None:
        parts = await session_parts(redis_url, {"demo": demo_model}, A_ADDRESS)
        try:
            loader = parts.loader()
            logged = SessionConfig(durability=Durability.LOG)
            sid = await parts.lifecycle(loader).create("demo", "", logged)
            intake = StepIntake(loader, parts.lanes.steppers, max_queued_steps=2)
            intake.start()  # the steppers are not started: queued steps stay queued
            queued = [await intake.submit(sid, t, x[t - 1]) for t in (1, 2)]
            with pytest.raises(CapacityError, match="limit 2") as refused:
                await intake.submit(sid, 3, x[2])
            assert grpc_code(refused.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(CapacityError):
                intake.submit_resident(sid, 3, x[2])
            assert not any(f.done() for f in queued)

            parts.lanes.start()
            for t, future in zip((1, 2), queued, strict=True):
                outcome = await asyncio.wait_for(future, STEP_TIMEOUT_S)
                assert outcome.error is None and outcome.step == t, outcome.error
                np.testing.assert_array_equal(
                    outcome.output.view(np.uint32), expected[t - 1].view(np.uint32)
                )
            await step_through(intake, sid, 3, x[2:])  # room again: the refused step goes in
            s = parts.residents.get(sid)
            assert s is not None and s.step == 3
        finally:
            await parts.close()

    _run(body)


def test_a_step_for_an_unknown_session_is_not_found(redis_url: str, demo_model: MambaModel) -> None:
    x = random_inputs(demo_model, 1, seed=4203)

    async def body() -> None:
        parts = await session_parts(redis_url, {"demo": demo_model}, A_ADDRESS)
        try:
            intake = StepIntake(parts.loader(), parts.lanes.steppers, max_queued_steps=64)
            intake.start()
            parts.lanes.start()
            assert intake.submit_resident("nobody", 1, x[0]) is None
            with pytest.raises(SessionMissingError, match="'nobody' does not exist") as missing:
                await intake.submit("nobody", 1, x[0])
            assert grpc_code(missing.value) == grpc.StatusCode.NOT_FOUND
            assert parts.residents.get("nobody") is None
            assert await parts.store.lease_holder("nobody") is None  # nothing was made
        finally:
            await parts.close()

    _run(body)
