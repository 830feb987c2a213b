"""Heartbeats in a server-streaming reply (``api/heartbeats.py``), without a server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from ssmserve.server.api.heartbeats import with_heartbeats


def test_replies_come_in_order_with_heartbeats_while_one_is_slow():
    async def replies() -> AsyncIterator[str]:
        yield "a"
        await asyncio.sleep(0.5)  # a slow reply: heartbeats meanwhile
        yield "b"
        yield "c"

    async def main() -> list[str]:
        return [r async for r in with_heartbeats(replies(), 0.05, lambda: "beat")]

    got = asyncio.run(main())
    assert [r for r in got if r != "beat"] == ["a", "b", "c"]
    beats = got.index("b") - 1
    # 0.5 s at one every 0.05 s: at most 10; at least 1 however late the loop runs
    assert 1 <= beats <= 10 and got[0] == "a" and got[-2:] == ["b", "c"]


def test_a_heartbeat_does_not_interrupt_the_reply_being_made():
    made: list[str] = []

    async def replies() -> AsyncIterator[str]:
        for i in range(3):
            await asyncio.sleep(0.12)  # longer than a heartbeat interval
            made.append(f"r{i}")  # would be skipped if a heartbeat cancelled the sleep
            yield f"r{i}"

    async def main() -> list[str]:
        return [r async for r in with_heartbeats(replies(), 0.02, lambda: "beat")]

    got = asyncio.run(main())
    assert [r for r in got if r != "beat"] == made == ["r0", "r1", "r2"]


def test_an_error_of_the_replies_reaches_the_reader():
    async def replies() -> AsyncIterator[str]:
        yield "a"
        await asyncio.sleep(0.1)
        raise ValueError("the drain failed")

    async def main() -> list[str]:
        return [r async for r in with_heartbeats(replies(), 0.02, lambda: "beat")]

    with pytest.raises(ValueError, match="the drain failed"):
        asyncio.run(main())


def test_leaving_early_stops_the_reply_in_progress_and_closes_the_replies():
    events: list[str] = []

    async def replies() -> AsyncIterator[str]:
        try:
            yield "a"
            await asyncio.sleep(60)  # stopped by the close, not waited for
            yield "never"
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        finally:
            events.append("closed")

    async def main() -> list[str]:
        got: list[str] = []
        replies_with_beats = with_heartbeats(replies(), 0.02, lambda: "beat")
        async for r in replies_with_beats:
            got.append(r)
            if r == "beat":  # the slow reply is pending now
                break
        await replies_with_beats.aclose()
        return got

    started = time.monotonic()
    assert asyncio.run(main()) == ["a", "beat"]
    assert time.monotonic() - started < 30  # the reply's 60 s were not waited for
    assert events == ["cancelled", "closed"]


def test_a_reader_cancelled_while_a_reply_is_slow_stays_cancelled():
    async def replies() -> AsyncIterator[str]:
        yield "a"
        await asyncio.sleep(60)
        yield "never"

    async def read() -> None:
        async for _ in with_heartbeats(replies(), 0.02, lambda: "beat"):
            pass

    async def main() -> bool:
        task = asyncio.create_task(read())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.wait({task}, timeout=30)
        return task.cancelled()

    assert asyncio.run(main())
