"""A lock per key that exists only while someone holds it or waits for it.

Why: some things are done one at a time per session (revalidating its lease, flushing its
log), but rarely, and a worker holds thousands of sessions. An ``asyncio.Lock`` kept in
each session costs it ~90 bytes for nothing almost all the time; here a session has a lock
only while it is in use.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable


class LocksWhileUsed:
    """``async with locks.hold(key)``: one holder per key at a time, in arrival order."""

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        # key -> [its lock, holders + waiters]; an entry lives while that count is > 0.
        self._locks: dict[Hashable, list] = {}

    def __len__(self) -> int:
        """Keys whose lock is held or waited for."""
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            # Also when cancelled while waiting: the last one out takes the entry away.
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[key]
