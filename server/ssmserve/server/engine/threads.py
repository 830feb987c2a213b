"""The engine's helper threads, and how a step's work is cut for them.

A step can use several cores in two ways, both without changing a bit (every kernel treats
each row alike, and every output element of a product is summed in one fixed order,
``products.py``):

* **Row ranges** (:func:`row_ranges`): a batch big enough is cut into ranges of sessions,
  each stepped whole on its own thread (``MambaModel.step``).
* **Column ranges** (:func:`column_ranges`): a batch too small to cut by rows (one session
  of a language model) still has products too big for one core: at batch 1 a product reads
  its whole weight matrix once, and one core reads memory at about half the machine's
  bandwidth. Such a product's output columns are cut into ranges of weight panels, one per
  thread (``RowStableLinear.into``).

Every kernel releases the GIL, so the threads run at once. Helpers only ever run a range
and return: they wait for nothing, so a step queued behind another's range waits but
never deadlocks, whatever number of models and lanes share the pool.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ssmserve.server.engine.environment import env_int

#: Threads a step uses unless ``SSMSERVE_ENGINE_THREADS`` says otherwise.
DEFAULT_ENGINE_THREADS = 2
#: Fewest rows worth a thread of their own: below this the hand-off costs more than it saves.
MIN_ROWS_PER_THREAD = 4
#: Fewest FLOPs of products worth a thread of their own (~0.3-0.5 ms of step here): on a
#: busy machine a hand-off to a pool thread can cost a few hundred microseconds, and
#: smaller parts ran slower on 2 threads than on 1 (the demo model up to batch 64 in
#: one measurement beside two soaks; signal 256x4 gained from batch 16).
MIN_FLOP_PER_THREAD = 40e6
#: Smallest packed weight (bytes) whose product is cut into column ranges when the step
#: is not cut by rows. A hand-off costs ~60-90 us here and one core reads ~13 GB/s, so a
#: range must spare a core well over 1 MB of reading to pay for it. Measured on
#: mamba-130m shapes at batch 1 (in_proj 9.4 MB, out_proj 4.7 MB, head 154 MB): 37 ms a
#: step uncut, 27.9 with 8 MiB (in_proj and head cut), 26.7 with 4 MiB, 26.6 with 2 MiB.
COLUMN_SPLIT_MIN_BYTES = 4 << 20

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def engine_threads() -> int:
    """``$SSMSERVE_ENGINE_THREADS`` or :data:`DEFAULT_ENGINE_THREADS` (>= 1)."""
    return env_int("SSMSERVE_ENGINE_THREADS", DEFAULT_ENGINE_THREADS, 1, 64)


def engine_pool() -> ThreadPoolExecutor:
    """The process's helper threads for steps (created on first use; every model shares
    them; helpers run ranges and wait for nothing)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=max(1, engine_threads() - 1), thread_name_prefix="ssmserve-engine"
            )
        return _pool


def run_ranges(parts: Sequence[tuple[int, int]], work: Callable[[int, int], None]) -> None:
    """``work(lo, hi)`` for every range at once: the first on this thread, the others on
    the helpers; returns when all are done, raising the first error (after all are done:
    they write into the caller's arrays)."""
    if len(parts) == 1:
        work(*parts[0])
        return
    pool = engine_pool()
    helpers = [pool.submit(work, lo, hi) for lo, hi in parts[1:]]
    try:
        work(*parts[0])
    finally:
        for helper in helpers:  # wait for all before raising
            helper.exception()
    for helper in helpers:
        helper.result()


def row_ranges(batch: int, threads: int, flops_per_row: float = 0.0) -> list[tuple[int, int]]:
    """``batch`` rows cut into at most ``threads`` near-equal ranges, each of at least
    :data:`MIN_ROWS_PER_THREAD` rows and :data:`MIN_FLOP_PER_THREAD` of work
    (``flops_per_row`` each; 0: rows alone decide)."""
    parts = min(threads, batch // MIN_ROWS_PER_THREAD)
    if flops_per_row > 0 and MIN_FLOP_PER_THREAD > 0:
        parts = min(parts, int(batch * flops_per_row // MIN_FLOP_PER_THREAD))
    parts = max(1, parts)
    bounds = [batch * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def column_ranges(panels: int, panel_bytes: int, threads: int) -> list[tuple[int, int]]:
    """``panels`` weight panels of ``panel_bytes`` each cut into at most ``threads``
    near-equal ranges of at least :data:`COLUMN_SPLIT_MIN_BYTES` / 2 of weights each; one
    range when the whole weight is under :data:`COLUMN_SPLIT_MIN_BYTES`."""
    total = panels * panel_bytes
    if threads <= 1 or total < COLUMN_SPLIT_MIN_BYTES:
        return [(0, panels)]
    parts = min(threads, panels)
    if COLUMN_SPLIT_MIN_BYTES > 1:
        parts = min(parts, total // (COLUMN_SPLIT_MIN_BYTES // 2))
    parts = max(1, parts)
    bounds = [panels * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))
