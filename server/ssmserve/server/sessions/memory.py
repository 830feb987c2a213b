"""WorkerMemory: one memory budget for everything large a worker holds.

Three things hold memory in proportion to what clients ask for, and all count against
the same budget (``ManagerSettings.memory_budget_bytes``):

- resident sessions, each at its bound: state, input history, recorded outputs and
  unflushed inputs (``SessionLoader.footprint``; ``ResidentSessions`` keeps the sum in
  :attr:`WorkerMemory.resident_bytes`);
- running forecasts: a copy of the state and the answer they may buffer until it is read
  (``horizon x output_dim x 4`` bytes);
- imports being decoded: the checkpoint's bytes, read back from their Redis staging
  whole, from decoding to the new session's creation.

Each is checked *before* it is held, so past the budget a call is refused with
RESOURCE_EXHAUSTED naming the budget and the use, and nothing already running notices.
Checks are against bounds, not measured use: a worker can never be pushed past its budget
by clients, only refuse them early. The worker makes the budget (``Worker``) and hands it
to the session manager and the API (imports).
"""

from __future__ import annotations

import os
from collections import Counter

from ssmserve.server.sessions.errors import CapacityError


class WorkerMemory:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        # What resident sessions may hold, all together (``ResidentSessions`` keeps it).
        self.resident_bytes = 0
        self.held_by: Counter[str] = Counter()  # reservations that are not sessions, by kind

    @property
    def held(self) -> int:
        """Bytes this worker may hold now: resident sessions and every reservation."""
        return self.resident_bytes + sum(self.held_by.values())

    def check(self, need: int, what: str) -> None:
        """Raise CapacityError (RESOURCE_EXHAUSTED) unless ``need`` more bytes fit."""
        held = self.held
        if held + need > self.budget_bytes:
            taken = ", ".join(f"{kind} {n:,}" for kind, n in sorted(self.held_by.items()) if n)
            raise CapacityError(
                f"{what} needs {need:,} bytes and this worker may hold {held:,} already "
                f"(sessions {self.resident_bytes:,}{', ' + taken if taken else ''}): its "
                f"memory budget is {self.budget_bytes:,} bytes; retry later, close or evict "
                f"sessions here, or use another worker"
            )

    def reserve(self, kind: str, nbytes: int, what: str) -> MemoryReservation:
        """Hold ``nbytes`` under ``kind`` ('forecasts', 'imports') until released."""
        self.check(nbytes, what)
        self.held_by[kind] += nbytes
        return MemoryReservation(self, kind, nbytes)


class MemoryReservation:
    """Bytes held against the budget; ``release`` (or leaving ``with``) gives them back,
    once, however often it is called."""

    def __init__(self, memory: WorkerMemory, kind: str, nbytes: int) -> None:
        self.memory, self.kind, self.nbytes = memory, kind, nbytes

    def release(self) -> None:
        if self.nbytes:
            self.memory.held_by[self.kind] -= self.nbytes
            self.nbytes = 0

    def __enter__(self) -> MemoryReservation:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def default_memory_budget() -> int:
    """Three quarters of the machine's memory (the rest for the engine, gRPC, Python)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4)
    except (ValueError, OSError):
        return 1 << 62  # unknown: no memory budget beyond max_sessions
