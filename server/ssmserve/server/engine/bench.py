"""``ssmserve model bench``: what this machine does with a model, one batched step at a time,
and with ``--prefill T`` a T-input prompt's prefill beside the decode step after it.

Users ask "how fast is my model on my hardware" before they size a deployment. This
times the engine alone (no gRPC, no Redis): ``batch`` fresh sessions, a few warm-up steps
(numba compiles its kernels on first use and the state leaves all-zeros), then ``steps``
timed steps, each on new deterministic random inputs. The served step adds the network,
the input log append and state bookkeeping on top (``bench/bench_service.py`` measures
it beside its parts).

A prefill (``MambaModel.prefill``) is timed as a served prompt would use it: one session
from a fresh state, the outputs of the last input only; each round then times decode
steps of that session (batch 1) from the state the prefill left, so both figures come
from the same minutes of the same machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.numerics import numerics_signature
from ssmserve.server.engine.recurrent_state import BatchState
from ssmserve.server.errors import ModelInputError

#: Largest batch ``model bench`` takes (sessions stepped together).
MAX_BATCH = 4096
#: Largest number of timed steps.
MAX_STEPS = 1_000_000
#: Longest prompt ``model bench --prefill`` takes (inputs).
MAX_PREFILL = 1 << 20
#: Most prefill rounds.
MAX_ROUNDS = 1000
#: Share of the machine's RAM the batch's states (old + new) may take.
MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class BenchResult:
    """One ``model bench`` run. Times are wall-clock microseconds per batched step."""

    model: str
    fingerprint: str
    batch: int
    steps: int
    warmup: int
    step_us_median: float
    step_us_p10: float
    step_us_p90: float
    steps_per_s: float  # session-steps per second at the median: batch / median step time
    state_bytes_per_session: int
    numerics: str  # numerics_signature(): equal signatures, equal bits

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def check_fits(model: MambaModel, batch: int) -> None:
    """Refuse a batch whose states (the old and the new one of a step) would take more
    than :data:`MEMORY_SHARE` of this machine's RAM."""
    need = 2 * batch * model.config.state_bytes
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not every platform tells
        return
    if need > MEMORY_SHARE * ram:
        raise ModelInputError(
            f"batch {batch} needs {need / 2**30:.1f} GiB of state, more than "
            f"{MEMORY_SHARE:.0%} of this machine's {ram / 2**30:.1f} GiB; use a smaller --batch"
        )


def bench_model(model: MambaModel, batch: int, steps: int, warmup: int = 5) -> BenchResult:
    """Time ``steps`` batched steps of ``batch`` fresh sessions after ``warmup`` steps."""
    if not 1 <= batch <= MAX_BATCH:
        raise ModelInputError(f"batch must be in [1, {MAX_BATCH}], got {batch}")
    if not 1 <= steps <= MAX_STEPS:
        raise ModelInputError(f"steps must be in [1, {MAX_STEPS}], got {steps}")
    check_fits(model, batch)
    rng = np.random.default_rng(0)
    c = model.config

    def inputs() -> np.ndarray:
        if c.is_token_model:
            return rng.integers(0, c.vocab_size, batch)  # (b,)
        return rng.standard_normal((batch, c.input_dim)).astype(np.float32)  # (b, i)

    state = BatchState.stack([model.new_state()] * batch)
    for _ in range(max(1, warmup)):
        state, _ = model.step(state, inputs())
    seconds = np.empty(steps)
    for i in range(steps):
        x = inputs()
        start = time.perf_counter()
        state, _ = model.step(state, x)
        seconds[i] = time.perf_counter() - start
    p10, median, p90 = np.percentile(seconds * 1e6, [10, 50, 90])
    return BenchResult(
        model=model.name,
        fingerprint=model.fingerprint,
        batch=batch,
        steps=steps,
        warmup=max(1, warmup),
        step_us_median=float(median),
        step_us_p10=float(p10),
        step_us_p90=float(p90),
        steps_per_s=float(batch / (median / 1e6)),
        state_bytes_per_session=c.state_bytes,
        numerics=numerics_signature(),
    )


@dataclass(frozen=True)
class PrefillBenchResult:
    """One ``model bench --prefill`` run: a prompt's prefill (milliseconds, the median of
    ``rounds``) and batch-1 decode steps (microseconds) timed in the same rounds."""

    model: str
    fingerprint: str
    prefill_steps: int  # T, inputs in the prompt
    rounds: int
    steps: int  # timed decode steps, over all rounds
    prefill_ms: float  # median over the rounds: T inputs, the last one's outputs
    prefill_ms_min: float
    prefill_us_per_input: float  # prefill_ms / T
    step_us_median: float  # one decode step of one session
    step_us_p10: float
    step_us_p90: float
    prefill_per_input_over_step: float  # prefill_us_per_input / step_us_median
    numerics: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def bench_prefill(
    model: MambaModel, prefill_steps: int, rounds: int, steps: int, warmup: int = 5
) -> PrefillBenchResult:
    """Time ``rounds`` prefills of one ``prefill_steps``-input prompt from a fresh state
    (last outputs only), each followed by its share of ``steps`` decode steps of that
    session, after one untimed prefill and ``warmup`` untimed decode steps."""
    if not 1 <= prefill_steps <= MAX_PREFILL:
        raise ModelInputError(f"prefill must be in [1, {MAX_PREFILL}] inputs, got {prefill_steps}")
    if not 1 <= rounds <= MAX_ROUNDS:
        raise ModelInputError(f"rounds must be in [1, {MAX_ROUNDS}], got {rounds}")
    if not 1 <= steps <= MAX_STEPS:
        raise ModelInputError(f"steps must be in [1, {MAX_STEPS}], got {steps}")
    rng = np.random.default_rng(0)
    c = model.config

    def inputs(count: int) -> np.ndarray:
        if c.is_token_model:
            return rng.integers(0, c.vocab_size, count)  # (T,)
        return rng.standard_normal((count, c.input_dim)).astype(np.float32)  # (T, i)

    prompt = inputs(prefill_steps)
    _, state = model.prefill(prompt, outputs="last")  # compiles, allocates
    batch = BatchState.stack([state])
    for _ in range(max(1, warmup)):
        batch, _ = model.step(batch, inputs(1))
    prefill_s = np.empty(rounds)
    step_s = np.empty(steps)
    done = 0
    for r in range(rounds):
        start = time.perf_counter()
        _, state = model.prefill(prompt, outputs="last")
        prefill_s[r] = time.perf_counter() - start
        batch = BatchState.stack([state])
        for i in range(done, steps * (r + 1) // rounds):
            x = inputs(1)
            start = time.perf_counter()
            batch, _ = model.step(batch, x)
            step_s[i] = time.perf_counter() - start
        done = steps * (r + 1) // rounds
    prefill_ms = float(np.median(prefill_s) * 1e3)
    p10, median, p90 = np.percentile(step_s * 1e6, [10, 50, 90])
    per_input = prefill_ms * 1e3 / prefill_steps
    return PrefillBenchResult(
        model=model.name,
        fingerprint=model.fingerprint,
        prefill_steps=prefill_steps,
        rounds=rounds,
        steps=steps,
        prefill_ms=prefill_ms,
        prefill_ms_min=float(prefill_s.min() * 1e3),
        prefill_us_per_input=per_input,
        step_us_median=float(median),
        step_us_p10=float(p10),
        step_us_p90=float(p90),
        prefill_per_input_over_step=float(per_input / median),
        numerics=numerics_signature(),
    )
