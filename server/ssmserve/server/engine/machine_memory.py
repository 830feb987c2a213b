"""How much memory this process may still take: what a model's load is checked against
before a byte of its weights is read (``loader.check_memory``)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def available_memory() -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, or less where a
    cgroup v2 limit on this process's cgroup or any above it leaves less (its usage less
    the inactive page cache, which the kernel reclaims before it kills); None where
    neither can be read (not Linux)."""
    have: int | None = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) * 1024
    for left in _cgroup_room():
        have = left if have is None else min(have, left)
    return have


def _cgroup_room() -> list[int]:
    """Room under each cgroup v2 memory limit from this process's cgroup up to the root
    (``/proc/self/cgroup``'s ``0::PATH``; in a cgroup namespace that is ``/``)."""
    room: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::"))  # fmt: skip
        root = Path("/sys/fs/cgroup")
        here = (root / line[3:].lstrip("/")).resolve()
        for group in (here, *here.parents):
            if not group.is_relative_to(root):
                break
            with contextlib.suppress(OSError, ValueError):
                limit = (group / "memory.max").read_text().strip()
                if limit != "max":
                    used = int((group / "memory.current").read_text())
                    stat = dict(
                        ln.split() for ln in (group / "memory.stat").read_text().splitlines()
                    )
                    used -= int(stat.get("inactive_file", 0))
                    room.append(max(0, int(limit) - used))
    return room
