"""Migrator on its own (``sessions/migration.py``): its methods called directly on the
source worker's loop, not through the Migrate RPC. Two real in-process workers
(``tests/harness.py``) on one redis-server: the target adopts over real gRPC
(``Peers.adopt``), as a hand-off does.

- a migrated session has exactly one owner afterwards, in Redis and in memory: the
  target, its state bit-equal to the offline engine's;
- a target that refuses the session leaves the source owning it, in Redis and in
  memory, and serving it on from where it was.
"""

from __future__ import annotations

import numpy as np
import pytest

from ssmserve.server.sessions.errors import HandOffError
from ssmserve.server.sessions.manager import ManagerSettings
from tests.conftest import random_inputs
from tests.harness import WorkerHarness
from tests.session_parts import state_bits
from tests.test_service import assert_bit_equal, reference, stream


def _owners(w: WorkerHarness, sid: str) -> tuple[str, str, str]:
    """(the lease's holder address, the meta's owner id, its token) as Redis has them."""

    async def read() -> tuple[str, str, str]:
        meta = await w.store.get_meta(sid)
        holder = await w.store.lease_holder(sid)
        assert meta is not None and holder is not None
        return holder.owner_addr, meta.owner, meta.token

    return w.call(read())


def _resident_state(w: WorkerHarness, sid: str) -> np.ndarray | None:
    """The bits of ``sid``'s state in ``w``'s memory (read on its loop), or None."""

    async def read() -> np.ndarray | None:
        s = w.manager.resident(sid)
        return None if s is None else state_bits(s.state)

    return w.call(read())


def test_a_migrated_session_has_one_owner_and_the_same_state(start_worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 20, seed=4301)
    a, b = start_worker(), start_worker()
    sid = a.client.create_session("demo", snapshot_every=4).session_id
    stream(a, sid, x[:10])
    assert _owners(a, sid)[0] == a.address

    moved = a.call(a.worker.migrator.migrate(sid, b.address))

    assert (moved.source, moved.target, moved.step) == (a.address, b.address, 10)
    assert moved.snapshot_id  # it moved at a snapshot of step 10, written for the move
    addr, owner, token = _owners(b, sid)
    assert (addr, owner) == (b.address, b.worker.worker_id)
    assert a.manager.resident(sid) is None and a.manager.resident_ids() == []
    assert b.manager.resident_ids() == [sid]
    assert b.call(_token(b, sid)) == token  # B holds the lease Redis fences with
    _, expected = model.run(x[:10])
    np.testing.assert_array_equal(_resident_state(b, sid), state_bits(expected))
    got, _ = stream(b, sid, x[10:], first_step=11)
    assert_bit_equal(got, reference(model, x)[10:])


async def _token(w: WorkerHarness, sid: str) -> str:
    s = w.manager.resident(sid)
    assert s is not None
    return s.lease.token


def test_a_target_that_refuses_leaves_the_source_owning_it(start_worker, served_models):
    model = served_models["demo"]
    x = random_inputs(model, 16, seed=4302)
    a = start_worker()
    full = start_worker(manager=ManagerSettings(max_sessions=0))  # refuses every load
    sid = a.client.create_session("demo").session_id
    stream(a, sid, x[:8])
    before = _owners(a, sid)
    state_before = _resident_state(a, sid)

    with pytest.raises(HandOffError, match=f"did not take session '{sid}'"):
        a.call(a.worker.migrator.migrate(sid, full.address))

    assert _owners(a, sid) == before  # the reservation was taken back: A's lease, A's token
    assert full.manager.resident_ids() == []
    np.testing.assert_array_equal(_resident_state(a, sid), state_before)
    got, _ = stream(a, sid, x[8:], first_step=9)  # served on from where it was
    assert_bit_equal(got, reference(model, x)[8:])
    assert _owners(a, sid)[:2] == (a.address, a.worker.worker_id)
