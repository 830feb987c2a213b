"""A server-streaming call's replies, each within a bound of the one before: used by the
client (forecasts, histories, exports, drains) and by a worker relaying another's drain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

#: How a stall's error begins: the call was made (a worker took it) and then sent nothing.
NO_REPLY = "no reply for"


async def replies_within(
    call: Any, stall_s: float, setting: str = "RetryPolicy.stall_timeout_s"
) -> AsyncIterator[Any]:
    """The replies of a server-streaming call (a forecast, a history, an export, a drain),
    each within ``stall_s`` of the one before.

    Why: such a call has no deadline of its own (a long forecast or a large export may
    rightly take minutes), and keepalive notices only a dead connection, not a worker
    that stopped sending on a live one (a stuck forecaster). A stall cancels the call and
    raises DEADLINE_EXCEEDED, which the client's ``Router.call`` retries like any transient
    error until the policy gives up (not for a drain). ``setting`` names where ``stall_s``
    comes from, for the error message."""
    while True:
        try:
            reply = await asyncio.wait_for(call.read(), stall_s)
        except TimeoutError:
            call.cancel()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"{NO_REPLY} {stall_s:g} s ({setting})",
            ) from None
        if reply is grpc.aio.EOF:
            return
        yield reply
