"""A hand-off cut short while its reservation is being taken back: the source keeps no
session that the target may own (two real workers, one real Redis).

The target takes the session but its answer is lost (``Peers.adopt`` raises after the real
adoption); the source then takes the reservation back, and the Migrate's caller goes away
while that call waits on Redis. Whether the take-back landed is unknown, so the source
must leave the session's memory: a step sent there is redirected to the target (the
client follows), never answered from memory.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.test_service import stream

#: How long the take-back is held before the caller goes away: the cancel lands while it
#: waits (the wait is an Event, not this bound).
ENTERED_BOUND_S = 30


def test_a_cancel_during_the_take_back_leaves_no_session_on_the_source(
    start_worker, served_models
) -> None:
    model = served_models["demo"]
    x = random_inputs(model, 12, seed=1)
    a, b = start_worker(), start_worker()
    sid = a.client.create_session(
        "demo", snapshot_every=1 << 20, durability=pb.DURABILITY_SNAPSHOT
    ).session_id
    stream(a, sid, x[:8])
    migrator = a.worker.migrator
    real_adopt = migrator.peers.adopt

    async def adopt_answer_lost(address: str, session_id: str) -> Any:
        await real_adopt(address, session_id)  # the target takes it ...
        raise ConnectionError("the target's answer was lost")  # ... its answer does not come

    async def go() -> bool:
        entered = asyncio.Event()

        async def take_back_waiting(*_args: Any, **_kwargs: Any) -> None:
            entered.set()
            await asyncio.Event().wait()  # Redis does not answer before the caller leaves

        migrator.peers.adopt = adopt_answer_lost
        migrator.parts.store.cancel_handoff = take_back_waiting
        try:
            task = asyncio.get_running_loop().create_task(migrator.migrate(sid, b.address))
            await asyncio.wait_for(entered.wait(), ENTERED_BOUND_S)
            task.cancel()  # the Migrate's client goes away
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            del migrator.peers.adopt
            del migrator.parts.store.cancel_handoff
        return a.manager.resident(sid) is not None

    assert a.call(go()) is False, "the source kept a session its target may own"
    assert sid in b.manager.resident_ids()
    # A step sent to the source is redirected: the target applies it, once, and the
    # source does not take the session back.
    outs, _ = stream(a, sid, x[8:12], first_step=9)
    assert outs.shape[0] == 4
    assert a.manager.resident(sid) is None
    assert b.client.get_session(sid).step == 12
