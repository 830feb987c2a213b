"""Heartbeats in a server-streaming reply: proof of life while the real replies are slow.

A client bounds each wait for the next reply of a stream (``RetryPolicy.stall_timeout_s``):
keepalive only tells a dead connection from a live one, not a worker that stopped sending
on a live one. Some streams rightly go quiet for long (a drain moving one large session),
so they send a heartbeat whenever ``every_s`` passed without a reply, and a client's stall
bound can be a small multiple of that instead of the longest a reply might take.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


async def with_heartbeats(
    replies: AsyncIterator[T], every_s: float, heartbeat: Callable[[], T]
) -> AsyncIterator[T]:
    """``replies``, and ``heartbeat()`` each time ``every_s`` passes without one.

    The next reply is awaited in a task of its own, so a heartbeat never interrupts the
    work behind it (``asyncio.wait_for`` would cancel it). Closing this iterator cancels
    that task and closes ``replies``."""
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(replies))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield heartbeat()
                continue
            finished, pending = pending, None
            try:
                reply = finished.result()
            except StopAsyncIteration:
                return
            yield reply
    finally:
        if pending is not None:
            pending.cancel()
            # How it ended is not ours to raise: we are leaving already, for the reason
            # that brought us here (asyncio.wait raises neither its error nor its
            # cancellation, only a cancellation of our own).
            await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()  # retrieved, so asyncio does not report it as lost
        aclose = getattr(replies, "aclose", None)
        if aclose is not None:
            await aclose()
