"""A generation's tokens, handed to its client one at a time; a cancelled call's last
step taken back.

Generate takes a step only once the token before it was handed to gRPC (the sender says
so: :meth:`HandOver.hand`), so a call the client cancels has at most one step taken
whose token was not handed: the one drawn while the last token went out. That step is
taken back through the session's rollback path (``Replay.resolve`` and
``Replay.restore_to``, as the Rollback RPC does; recorded as a rollback with cause
``cancel``), so a cancelled generation leaves the session at the step of the last token
handed over. A token whose write was under way when the call was cancelled may have
reached the client (:meth:`HandOver.offer`): its step is never taken back.

What gRPC was handed may still be on its way: a client that stops reading after token
``k`` while token ``k + 1`` is in flight has the session at ``k + 1``. The Python client
closes that gap itself: a generation closed early rolls the session back to the step of
the last token it yielded (``ssmserve.client.generation``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.events import record as record_events
from ssmserve.server.sessions.records import RollbackTarget
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.session import Session

log = logging.getLogger(__name__)

#: How long a generation waits for its client to take a token (gRPC's flow control
#: holds the sender while the client does not read), and for a take-back: then it ends.
HANDOVER_BOUND_S = 300.0


class HandOver:
    """The session step of the last response the sender handed to gRPC (a retraction's
    goes back)."""

    def __init__(self) -> None:
        self.last = -1
        # The session step of the last response given to gRPC, its write maybe not done:
        # the client may have it, so a cancel never takes its step back.
        self.offered = -1
        self._moved = asyncio.Event()

    def offer(self, step: int) -> None:
        self.offered = step

    def hand(self, step: int) -> None:
        self.last = step
        self._moved.set()

    async def handed(self, step: int, bound_s: float) -> bool:
        """Wait until the token of ``step`` was handed over: False if ``bound_s`` passes
        first."""
        deadline = time.monotonic() + bound_s
        while self.last < step:
            self._moved.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await self._moved.wait()
            except TimeoutError:
                return False
        return True


async def take_back(replay: Replay, s: Session, step: int, token: int) -> bool:
    """Roll ``s`` back to ``step - 1`` if it is at ``step`` with ``token`` as its input
    (a cancelled generation's step whose token the client was not handed); whether it
    did. Anything else (the step never landed, the session moved on) is left as it is."""
    async with replay.residents.hold(s):
        if s.step != step or s.recent.input_at(step) != s.codec.encode(np.int64(token)):
            return False
        target, record = await replay.resolve(s, RollbackTarget(step=step - 1), "take back")
        before = s.step
        await replay.restore_to(s, target, record)
        replay.store.metrics.rollbacks.labels("cancel").inc()
        await record_events(
            replay.store, s.lease, [SessionEvent.rollback(before, target, "cancel")]
        )
        log.info(
            "session %s: step %d of a cancelled generation taken back", s.id, step,
            extra={"session_id": s.id, "step": target, "event": "rolled_back", "cause": "cancel"},
        )  # fmt: skip
        return True
