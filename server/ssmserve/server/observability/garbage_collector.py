"""The cyclic garbage collector of a serving process: tuned for how a worker allocates,
and its pauses measured.

Why tune it. CPython starts a young collection whenever tracked allocations minus
deallocations pass a threshold (700). A worker keeps every in-flight step's objects alive
until the step is answered (its job, future, outcome and answer: ~24,000 steps in flight
with 3,000 sessions streaming 8-step messages), so with 700 those collections promote them
all, the oldest generation grows by a quarter again and again, and each time it is walked
whole. ``bench/bench_server_cpu.py`` at 3,000 sessions: 15 full collections of ~350,000
objects, 1.7 s of the server's ~7 s of CPU. Nearly all of those objects die by reference
counting, never in a cycle; a young threshold of 50,000 leaves 9 young collections and no
full one in the same run (0.1 s). Freezing what exists once the worker is ready (modules,
compiled kernels, protobuf descriptors: ~140,000 objects) takes them out of every later
full collection. Cyclic garbage still goes, at most 50,000 allocations later.

Every collection's pause goes to ``ssmserve_gc_pause_seconds`` (by generation): a pause is
time the event loop does not answer or renew leases.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

#: Python's own young-generation threshold, for reference.
PYTHON_DEFAULT_YOUNG = 700


@dataclass(frozen=True)
class GcSettings:
    # Net tracked allocations between young collections; 0 leaves Python's thresholds.
    young_threshold: int = 50_000
    # Move the objects that exist once the worker is ready out of later collections.
    freeze_when_ready: bool = True


class ServingGc:
    """Applies :class:`GcSettings` to this process while serving, and times collections.

    One per process (the collector is process-wide): ``main.serve`` starts it once the
    worker is ready and stops it on shutdown, which puts the thresholds back.
    """

    def __init__(self, settings: GcSettings, pause_histogram: Any) -> None:
        self.settings = settings
        self._pauses = pause_histogram  # observed only here: one collection at a time
        self._started_at = 0.0
        self._saved: tuple[int, int, int] | None = None

    def start(self) -> None:
        if self.settings.freeze_when_ready:
            gc.collect()  # what is garbage now should not be frozen
            gc.freeze()
        if self.settings.young_threshold > 0:
            self._saved = gc.get_threshold()
            _, older, oldest = self._saved
            gc.set_threshold(self.settings.young_threshold, older, oldest)
        for generation in range(3):  # the children exist before the first scrape
            self._pauses.labels(str(generation))
        gc.callbacks.append(self._on_collection)

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
        if self.settings.freeze_when_ready:
            gc.unfreeze()

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        # Runs inside the collector, on whichever thread allocated: keep it tiny.
        if phase == "start":
            self._started_at = time.perf_counter()
        else:
            pause = time.perf_counter() - self._started_at
            self._pauses.labels(str(info["generation"])).observe(pause)
