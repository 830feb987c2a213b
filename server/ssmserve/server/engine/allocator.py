"""The C heap under the engine's arrays: keep freed pages for the next step, give them back
when idle (glibc's ``mallopt`` and ``malloc_trim``; elsewhere nothing).

Why this module exists. States are values: every step allocates new state arrays and frees
the previous ones (numpy takes them from the C heap). glibc's defaults return freed memory
to the system as soon as the free space at the top of the heap passes a trim threshold that
follows the largest recent mmap (~2x one array), so the next step touches fresh pages
again: a step of signal 256x4 at batch 64 (8 MiB of state) takes 1,264 page faults and 2 ms
of system time that way, ~30% of the step (``bench/bench_engine.py``).

So the engine fixes both thresholds when it loads a model (:func:`keep_freed_pages`): arrays
up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap, and up to
``SSMSERVE_KEEP_FREED_MB`` (default 1024) of freed heap stays in the process for the next
steps. The idle check gives it back (:func:`return_freed_memory`) once sessions stop
stepping (their states get arrays of their own) or the background snapshot writes under
way have ended, so a worker's RSS does not stay at its peak. ``SSMSERVE_KEEP_FREED_MB=0`` keeps
glibc's own behaviour.

``malloc_trim`` alone does not give it all back. Arrays made on an engine thread come from
that thread's glibc arena, and of such an arena ``malloc_trim`` returns the free pages
between live blocks but not its *top* (the free end of its newest heap): glibc shrinks that
only inside ``free``, when a block of at least 64 KiB is freed while the top exceeds
``M_TRIM_THRESHOLD``, which is exactly what ``keep_freed_pages`` prevents. A worker whose
last batches end high in the engine thread's arena keeps ~12 MB of freed state resident
that way (4 KiB per demo session at 3,000 sessions, in about half the runs of
``bench/bench_served_memory.py``). So threads that make engine arrays register
(:func:`allocates_engine_arrays`), and :func:`return_freed_memory` has each of them free
one large block with the threshold lowered for that moment (a large free on any other
thread in that moment trims its arena too: glibc's default behaviour, harmless). Threads
that are not registered keep their arena's top: asyncio's default executor, which encodes
checkpoints of 1 MiB or more, holds at most a few such buffers' worth.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import weakref
from concurrent.futures import Executor

from ssmserve.server.engine.environment import env_int

#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``).
_MMAP_THRESHOLD_MAX = 32 << 20
#: Freed heap kept for the next steps unless ``SSMSERVE_KEEP_FREED_MB`` says otherwise.
DEFAULT_KEEP_FREED_MB = 1024
#: A block this big, freed, makes glibc try to trim its arena's top (its
#: ``FASTBIN_CONSOLIDATION_THRESHOLD`` is 64 KiB).
_TRIM_PROBE_BYTES = 256 << 10

log = logging.getLogger(__name__)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only: musl and macOS have none)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


_LIBC = _glibc()
_kept: int | None = None  # bytes keep_freed_pages set, once per process
# Threads (single-thread executors) whose arenas hold engine arrays; a lane's goes when it does.
_engine_threads: weakref.WeakSet[Executor] = weakref.WeakSet()
# mallopt is process-wide: one thread at a time lowers the trim threshold and restores it.
_threshold_lock = threading.Lock()


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


def allocates_engine_arrays(thread: Executor) -> None:
    """Register a single-thread executor that makes engine arrays (an engine lane's), so
    :func:`return_freed_memory` also gives back the free top of that thread's arena."""
    _engine_threads.add(thread)


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere
    nothing): engine batches are large arrays from the C heap, freed once their sessions
    have arrays of their own or have left memory. Does not wait for the registered engine
    threads: each trims its own arena when it is next free (after the step it runs)."""
    if _LIBC is None:
        return
    _LIBC.malloc_trim(0)
    if not _kept:
        return  # glibc's own thresholds: its frees trim every arena's top already
    for thread in list(_engine_threads):
        with contextlib.suppress(RuntimeError):  # shut down meanwhile (its lane is closing)
            thread.submit(trim_own_arena)


def trim_own_arena() -> None:
    """Give back the free top of the calling thread's glibc arena (see the module's doc):
    free one block of :data:`_TRIM_PROBE_BYTES` while the trim threshold is 0."""
    if _LIBC is None or not _kept:
        return
    with _threshold_lock:
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 0)
        try:
            probe = _LIBC.malloc(_TRIM_PROBE_BYTES)
            if probe:
                _LIBC.free(probe)
        finally:
            if not _LIBC.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(_kept, (1 << 31) - 1))):
                log.warning("could not restore M_TRIM_THRESHOLD: freed heap goes back sooner")
