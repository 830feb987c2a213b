"""The C heap under the engine's arrays: keep freed pages for the next step, give them back
when idle (glibc's ``mallopt`` and ``malloc_trim``; elsewhere nothing).

Why this module exists. States are values: every step allocates new state arrays and frees
the previous ones (numpy takes them from the C heap). glibc's defaults return freed memory
to the system as soon as the free space at the top of the heap passes a trim threshold that
follows the largest recent mmap (~2x one array), so the next step touches fresh pages
again: a step of signal 256x4 at batch 64 (8 MiB of state) took 1,264 page faults and 2 ms
of system time, ~30% of the step (``bench/bench_engine.py``; BENCHMARKS.md, "Issue 19").

So the engine fixes both thresholds when it loads a model (:func:`keep_freed_pages`): arrays
up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap, and up to
``SSMSERVE_KEEP_FREED_MB`` (default 1024) of freed heap stays in the process for the next
steps. The idle check gives it back (:func:`return_freed_memory`) once sessions stop
stepping (their states get arrays of their own) or the background snapshot writes under
way have ended, so a worker's RSS does not stay at its peak. ``SSMSERVE_KEEP_FREED_MB=0`` keeps
glibc's own behaviour.
"""

from __future__ import annotations

import ctypes

from ssmserve.server.engine.environment import env_int

#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``).
_MMAP_THRESHOLD_MAX = 32 << 20
#: Freed heap kept for the next steps unless ``SSMSERVE_KEEP_FREED_MB`` says otherwise.
DEFAULT_KEEP_FREED_MB = 1024


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only: musl and macOS have none)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()
_kept: int | None = None  # bytes keep_freed_pages set, once per process


def keep_freed_mb() -> int:
    """``$SSMSERVE_KEEP_FREED_MB`` or :data:`DEFAULT_KEEP_FREED_MB` (0: glibc's defaults)."""
    return env_int("SSMSERVE_KEEP_FREED_MB", DEFAULT_KEEP_FREED_MB, 0, 1 << 20)


def keep_freed_pages() -> int:
    """Set the heap's thresholds as the module says (once per process); returns the bytes
    of freed heap kept (0 where nothing was set)."""
    global _kept
    if _kept is None:
        keep = keep_freed_mb() << 20
        _kept = 0
        # mallopt returns 1 on success; fixing either threshold also stops glibc's dynamic
        # adjustment of both.
        if (
            _LIBC is not None
            and keep
            and _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
            and _LIBC.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(keep, (1 << 31) - 1)))
        ):
            _kept = keep
    return _kept


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere
    nothing): engine batches are large arrays from the C heap, freed once their sessions
    have arrays of their own or have left memory."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
