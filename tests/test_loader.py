"""SessionLoader on its own (``sessions/loading.py``): made from real parts on a real
redis-server (``tests/session_parts.py``), no manager, no gRPC. Two sets of parts on one
Redis are two workers: A stores a session, B loads it.

- a session whose owner crashed is acquired and rebuilt at its durable step, its state
  bit-equal to the offline engine's (newest snapshot plus the logged steps replayed);
- a session whose lease another live worker holds is refused with ``LeaseHeldError``
  naming that worker, and nothing changes in Redis;
- unload and park snapshot the session, release its lease and free its memory: another
  worker loads it at once, bit-equal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.sessions.config import Durability, SessionConfig
from ssmserve.server.sessions.intake import StepIntake
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.session import Session
from ssmserve.server.state.store_errors import LeaseHeldError
from tests.conftest import random_inputs
from tests.session_parts import SessionParts, session_parts, state_bits, step_through

A_ADDRESS = "127.0.0.1:7101"  # registered, never listening: nothing here calls a peer
B_ADDRESS = "127.0.0.1:7102"
LEASE_TTL_S = 1.0  # a takeover waits this long on B's clock after its first refusal
STEPS = 10
#: Snapshots at steps 4 and 8; steps 9 and 10 are only in the log, so a rebuild at step
#: 10 replays them.
LOGGED = SessionConfig(snapshot_every=4, durability=Durability.LOG)


def _run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


async def _stored(parts: SessionParts, loader: SessionLoader, inputs: np.ndarray) -> str:
    """A new demo session, made by ``parts``' lifecycle and stepped through ``inputs``."""
    sid = await parts.lifecycle(loader).create("demo", "", LOGGED)
    intake = StepIntake(loader, parts.lanes.steppers, max_queued_steps=64)
    intake.start()
    if not parts.lanes.started:
        parts.lanes.start()
    await step_through(intake, sid, 1, inputs)
    return sid


async def _load_once_taken_over(loader: SessionLoader, sid: str, bound_s: float) -> Session:
    """``loader.session(sid)`` once the takeover's watch of the crashed owner's lease is
    over; the first try must be refused (a lease is never taken on sight)."""
    with pytest.raises(LeaseHeldError):
        await loader.session(sid)
    deadline = time.monotonic() + bound_s
    while True:
        try:
            return await loader.session(sid)
        except LeaseHeldError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_a_crashed_owners_session_is_rebuilt_at_its_step_bit_equal(
    redis_url: str, demo_model: MambaModel
) -> None:
    x = random_inputs(demo_model, STEPS, seed=4101)
    _, expected = demo_model.run(x)
    # The rebuild replays the logged steps as a prefill: its kernels are compiled here, so
    # a cold numba cache (tens of seconds on a loaded machine) is not spent inside the
    # takeover's bound below.
    demo_model.prefill(x, outputs="none")

    async def body() -> None:
        a = await session_parts(redis_url, {"demo": demo_model}, A_ADDRESS, LEASE_TTL_S)
        sid = await _stored(a, a.loader(), x)
        await a.close(release=False)  # a crash: A's lease stays, unrenewed
        b = await session_parts(redis_url, {"demo": demo_model}, B_ADDRESS, LEASE_TTL_S)
        try:
            newest = await b.store.snapshot_at_or_before(sid, STEPS)
            assert newest is not None and newest.step < STEPS  # the rest is replayed
            # The watch runs a TTL from the first refusal; twice that bounds it here.
            s = await _load_once_taken_over(b.loader(), sid, 2 * LEASE_TTL_S + 5)
            assert s.step == STEPS
            np.testing.assert_array_equal(state_bits(s.state), state_bits(expected))
            assert b.residents.get(sid) is s
            meta = await b.store.get_meta(sid)
            holder = await b.store.lease_holder(sid)
            assert meta is not None and meta.owner == b.ownership.worker_id
            assert holder is not None and holder.owner_addr == B_ADDRESS
            assert meta.token == s.lease.token
        finally:
            await b.close()

    _run(body)


def test_a_session_held_by_a_live_worker_is_refused_with_its_owner(
    redis_url: str, demo_model: MambaModel
) -> None:
    x = random_inputs(demo_model, 3, seed=4102)

    async def body() -> None:
        a = await session_parts(redis_url, {"demo": demo_model}, A_ADDRESS)
        b = await session_parts(redis_url, {"demo": demo_model}, B_ADDRESS)
        try:
            sid = await _stored(a, a.loader(), x)
            before = await a.store.get_meta(sid)
            with pytest.raises(LeaseHeldError) as refused:
                await b.loader().session(sid)
            assert refused.value.owner == A_ADDRESS  # the redirect names the holder
            assert refused.value.retry_after_ms > 0
            assert b.residents.get(sid) is None and b.memory.resident_bytes == 0
            after = await a.store.get_meta(sid)
            assert after == before  # same owner, same token: nothing was taken
            assert a.residents.get(sid) is not None
        finally:
            await b.close()
            await a.close()

    _run(body)


@pytest.mark.parametrize("how", ["unload", "park"])
def test_unload_and_park_free_the_session_for_any_worker(
    redis_url: str, demo_model: MambaModel, how: str
) -> None:
    x = random_inputs(demo_model, 6, seed=4103)  # not at a snapshot: unloading writes one
    _, expected = demo_model.run(x)

    async def body() -> None:
        a = await session_parts(redis_url, {"demo": demo_model}, A_ADDRESS)
        b = await session_parts(redis_url, {"demo": demo_model}, B_ADDRESS)
        try:
            loader = a.loader()
            sid = await _stored(a, loader, x)
            s = a.residents.get(sid)
            assert s is not None and a.memory.resident_bytes > 0
            if how == "unload":
                await loader.unload(s, "test")
            else:
                await loader.park(sid, "test")
            assert a.residents.get(sid) is None and s.gone is not None
            assert a.memory.resident_bytes == 0
            assert await a.store.lease_holder(sid) is None
            snapshot = await a.store.snapshot_at_or_before(sid, len(x))
            assert snapshot is not None and snapshot.step == len(x)
            # Released, not crashed: B loads it on its first try, no takeover wait.
            loaded = await b.loader().session(sid)
            assert loaded.step == len(x)
            np.testing.assert_array_equal(state_bits(loaded.state), state_bits(expected))
        finally:
            await b.close()
            await a.close()

    _run(body)
