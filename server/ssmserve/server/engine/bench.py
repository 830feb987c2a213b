"""``ssmserve model bench``: what this machine does with a model, one batched step at a time.

Users ask "how fast is my model on my hardware" before they size a deployment. This
times the engine alone (no gRPC, no Redis): ``batch`` fresh sessions, a few warm-up steps
(numba compiles its kernels on first use and the state leaves all-zeros), then ``steps``
timed steps, each on new deterministic random inputs. The served step adds the network,
the input log append and state bookkeeping on top (``bench/bench_service.py`` measures
it beside its parts).
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
