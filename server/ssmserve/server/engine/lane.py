"""The engine lane: batched model steps of one model, on the event loop or off it.

Steps (``sessions.stepper``), forecasts (``sessions.forecaster``) and replays (rollback,
load, fork: ``sessions.replay.Replay.rebuild``) of a model share one lane, so their
engine calls take turns on one engine thread instead of competing for the cores. A call
of at least ``offload_min_flop`` FLOPs runs on that thread (BLAS and the numba kernels
release the GIL, so the loop goes on serving streams meanwhile); a smaller one runs
inline, where it costs less than the thread hop. Batch invariance makes the bits of a
row the same either way, whatever else shares the call.

A prefill (one session's run at matrix speed: a long run in a step batch, a replay) runs
on the same engine thread; its further runners (``prefill.py`` spreads a long run's chunks
over ``model.threads`` runners) run on the lane's own runner threads, one single-thread
executor each, registered with the allocator like the engine thread, so the free top of
their arenas goes back when idle too. One prefill at a time per lane (the engine thread
runs it), so a runner thread never waits for another prefill's turns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ssmserve.server.engine.allocator import allocates_engine_arrays, trim_own_arena
from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.prefill import OutputRows
from ssmserve.server.engine.recurrent_state import BatchState, SessionState


class EngineLane:
    def __init__(self, model: Engine, offload_min_flop: float) -> None:
        self.model = model
        self.offload_min_flop = offload_min_flop
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{model.name}")
        allocates_engine_arrays(self._thread)  # its arena's free top goes back when idle
        # Prefill runners 1, 2, ...: made on first use (most lanes never prefill a run).
        self._runners: list[ThreadPoolExecutor] | None = None
        self.prefilled_steps = 0  # steps computed by prefill (runs in batches, replays)

    async def step(
        self, states: Sequence[SessionState], values: Sequence[np.ndarray]
    ) -> tuple[BatchState, np.ndarray]:
        """One step of each state with its input: (new states, outputs ``(b, o)``)."""
        if len(states) * self.model.flops_per_step >= self.offload_min_flop:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self._call, states, values)
        return self._call(states, values)

    async def step_many(
        self, states: Sequence[SessionState], inputs: np.ndarray
    ) -> tuple[BatchState, np.ndarray]:
        """``T`` steps of each state in one call: inputs ``(b, T, i)``; returns (the states
        after the last step, outputs ``(b, T, o)``). The same engine steps, in the same
        order, as ``T`` calls of :meth:`step`, so the same bits."""
        if len(states) * inputs.shape[1] * self.model.flops_per_step >= self.offload_min_flop:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self._call_many, states, inputs)
        return self._call_many(states, inputs)

    async def run(self, inputs: np.ndarray, state: SessionState) -> tuple[np.ndarray, SessionState]:
        """One session stepped through ``inputs`` (a replay): (outputs ``(T, o)``, state)."""
        if len(inputs) * self.model.flops_per_step >= self.offload_min_flop:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self.model.run, inputs, state)
        return self.model.run(inputs, state)

    async def prefill(
        self, inputs: np.ndarray, state: SessionState, outputs: OutputRows = "all"
    ) -> tuple[np.ndarray, SessionState]:
        """One session through ``inputs`` at matrix speed (``Engine.prefill``, the bits
        of :meth:`run`): (the outputs ``outputs`` names ``(m, o)``, the state after)."""
        self.prefilled_steps += len(inputs)
        if len(inputs) * self.model.flops_per_step >= self.offload_min_flop:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self._prefill, inputs, state, outputs)
        return self._prefill(inputs, state, outputs)

    def _prefill(
        self, inputs: np.ndarray, state: SessionState, outputs: OutputRows
    ) -> tuple[np.ndarray, SessionState]:
        if self._runners is None:
            self._runners = []
            for r in range(1, self.model.threads):
                runner = ThreadPoolExecutor(1, thread_name_prefix=f"prefill-{self.model.name}-{r}")
                allocates_engine_arrays(runner)
                self._runners.append(runner)
        return self.model.prefill(inputs, state, outputs, self._runners)

    def _call(
        self, states: Sequence[SessionState], values: Sequence[np.ndarray]
    ) -> tuple[BatchState, np.ndarray]:
        batch = BatchState.stack(states)
        # np.array, not np.stack: the same copy, 5-10x less Python (7.7 -> 1.5 us at b=1,
        # 66 -> 22 us at b=64 here); every value has the same shape, checked at intake.
        inputs = np.array(values)  # (b,) ids or (b, i)
        return self.model.step(batch, inputs)  # (b, o)

    def _call_many(
        self, states: Sequence[SessionState], inputs: np.ndarray
    ) -> tuple[BatchState, np.ndarray]:
        batch = BatchState.stack(states)
        b, steps = inputs.shape[:2]
        outputs = np.empty((b, steps, self.model.config.output_dim), np.float32)  # (b, T, o)
        for t in range(steps):
            batch, outputs[:, t] = self.model.step(batch, inputs[:, t])  # (b, i) -> (b, o)
        return batch, outputs

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        for runner in self._runners or ():
            runner.shutdown(wait=True)

    async def warm_up_on_thread(self) -> float:
        """:meth:`warm_up` on this lane's thread (whose arena the idle trim knows), then the
        free top of that arena given back: a first compile frees tens of MB there. The
        rest of the heap is the caller's to trim (``return_freed_memory`` at start-up; a
        model loaded while sessions step leaves it to the idle check)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._warm_up_and_trim)

    def _warm_up_and_trim(self) -> float:
        seconds = self.warm_up()
        trim_own_arena()
        return seconds

    def warm_up(self) -> float:
        """Compile (or load from numba's on-disk cache) every kernel that steps, forecasts
        and replays use, so no request pays for it; returns the seconds it took.

        A worker calls this before it registers and reports SERVING: a first compile takes
        seconds, and on the event loop it would also hold up lease renewals.
        """
        started = time.perf_counter()
        c = self.model.config
        value = np.asarray(0, np.int64) if c.is_token_model else np.zeros(c.input_dim, np.float32)
        state = self.model.new_state()
        self._call([state], [value])  # batch of one
        self._call([state, state], [value, value])  # a batch
        self.model.run(np.stack([value, value]), state)  # stepped through a run
        self._prefill(np.stack([value] * 2), state, "last")  # a run prefilled
        return time.perf_counter() - started


def warm_demo_kernels() -> float:
    """Compile the engine's kernels with a tiny in-memory model (numba caches them on disk,
    keyed by types, not sizes); for images built ahead of time:
    ``python -m ssmserve.server.engine.lane``."""
    from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
    from ssmserve.server.engine.model_tensors import build_model

    config = demo_config(DemoSpec())
    model = build_model(config, random_tensors(config, 0), name="warm-up")
    return EngineLane(model, offload_min_flop=float("inf")).warm_up()


if __name__ == "__main__":
    print(f"ssmserve kernels compiled in {warm_demo_kernels():.2f} s")
