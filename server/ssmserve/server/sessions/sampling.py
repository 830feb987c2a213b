"""Drawing a token from a step's logits: greedy, or seeded sampling with filters.

Generate feeds every drawn token back as the session's next input, and a retry, a
replay or another worker must draw the same token again. So a draw depends on nothing
but ``(params, seed, step, logits)``:

- the float32 logits are widened to float64 and every filter works in float64, in this
  fixed order: temperature, top-k, softmax, top-p, min-p (see :func:`draw`);
- the uniform variate comes from a counter-based generator (Philox4x64-10) keyed by
  ``(seed, step)``, counter 0: nothing is carried from one draw to the next, so no
  generator state is checkpointed and any step can be drawn again on its own.

Temperature 0 is greedy: the argmax, the lowest id among equal maxima (what Forecast
feeds back), drawn with probability 1 (logprob 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ssmserve.server.errors import ErrorKind, SsmserveError

MAX_TEMPERATURE = 100.0
_U64 = (1 << 64) - 1
_TWO_POW_MINUS_53 = 2.0**-53


class BadSamplingError(SsmserveError):
    """Sampling parameters out of range (INVALID_ARGUMENT)."""


class LogitsNotFiniteError(SsmserveError):
    """A step's logits hold NaN or +Inf, so no distribution can be drawn from them."""

    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn (``SamplingParams`` of the proto). 0 / 0 / 1 / 0 turn
    temperature, top-k, top-p and min-p off (greedy at temperature 0)."""

    temperature: float = 0.0  # 0: greedy, else in (0, MAX_TEMPERATURE]
    top_k: int = 0  # keep the k most likely (ties: lower ids first); 0 or >= vocab: all
    top_p: float = 1.0  # keep the smallest head with probability >= top_p; 0 or 1: all
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    seed: int = 0  # 0 .. 2**64 - 1

    def check(self) -> SamplingParams:
        """These parameters, or BadSamplingError naming the first one out of range."""
        t = self.temperature
        if not (math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
            raise BadSamplingError(
                f"temperature must be 0 (greedy) or in (0, {MAX_TEMPERATURE:g}], got {t!r}"
            )
        for name, value in (("top_p", self.top_p), ("min_p", self.min_p)):
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise BadSamplingError(f"{name} must be in [0, 1], got {value!r}")
        if self.top_k < 0:
            raise BadSamplingError(f"top_k must be >= 0 (0: all tokens), got {self.top_k}")
        if not 0 <= self.seed <= _U64:
            raise BadSamplingError(f"seed must be in [0, 2**64), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Draw:
    token: int
    logprob: float  # log-probability under the filtered distribution it was drawn from


def uniform(seed: int, step: int) -> float:
    """The variate of ``(seed, step)`` in [0, 1): the first 64-bit output of Philox4x64-10
    keyed by the two words (counter 0), its top 53 bits scaled by 2**-53."""
    key = np.array([seed & _U64, step & _U64], np.uint64)
    raw = int(np.random.Philox(key=key).random_raw())
    return (raw >> 11) * _TWO_POW_MINUS_53


def draw(params: SamplingParams, seed_step: tuple[int, int], logits: np.ndarray) -> Draw:
    """The token ``params`` draw from ``logits`` (V,) float32 at ``seed_step``
    ``(seed, step)``. In float64, in this order:

    1. temperature 0: the argmax (lowest id on ties), logprob 0;
    2. ``z = logits / temperature``; ids ordered by z descending, ties by id ascending;
    3. top-k: the first k of that order;
    4. softmax over them (``exp(z - max)`` over its sum), ids of probability 0 dropped;
    5. top-p: the shortest prefix whose cumulative probability reaches top_p, renormalized;
    6. min-p: those with probability >= min_p x the first one's, renormalized;
    7. the token whose cumulative interval holds ``u = uniform(seed, step)`` (the first
       with cumulative sum > u x total).

    Raises LogitsNotFiniteError when a logit is NaN or +Inf (-Inf is probability 0), or
    every one is -Inf.
    """
    z = np.asarray(logits, np.float32).astype(np.float64)
    if np.isnan(z).any() or np.isposinf(z).any() or np.isneginf(z).all():
        step = seed_step[1]
        raise LogitsNotFiniteError(
            f"the logits of step {step} hold NaN or +Inf (or are all -Inf), so no token can "
            f"be drawn from them; a FINITE guard with action REJECT stops such a step"
        )
    if params.greedy:
        return Draw(int(np.argmax(z)), 0.0)  # argmax: the lowest id among equal maxima
    z /= params.temperature
    order = _descending(z, params.top_k)
    kept = z[order]
    p = np.exp(kept - kept[0])  # kept[0] is the maximum
    order, p = order[p > 0.0], p[p > 0.0]  # -Inf logits (and underflows) cannot be drawn
    p /= p.sum()
    if 0.0 < params.top_p < 1.0:
        cumulative = np.cumsum(p)
        n = min(int(np.searchsorted(cumulative, params.top_p, side="left")) + 1, len(p))
        order, p = order[:n], p[:n] / cumulative[n - 1]
    if params.min_p > 0.0:
        keep = p >= params.min_p * p[0]
        order, p = order[keep], p[keep]
        p /= p.sum()
    cumulative = np.cumsum(p)
    u = uniform(*seed_step) * cumulative[-1]
    i = min(int(np.searchsorted(cumulative, u, side="right")), len(p) - 1)
    return Draw(int(order[i]), float(np.log(p[i])))


def _descending(z: np.ndarray, top_k: int) -> np.ndarray:
    """Ids by ``z`` descending, ties by id ascending; only the first ``top_k`` when
    0 < top_k < len(z). A top-k of a large vocabulary sorts only the ids at or above the
    k-th largest value (all of its ties, so the cut is the full sort's)."""
    if 0 < top_k < len(z):
        kth = np.partition(z, len(z) - top_k)[len(z) - top_k]  # the k-th largest value
        candidates = np.flatnonzero(z >= kth)  # ascending ids
        order = candidates[np.argsort(-z[candidates], kind="stable")]
        return order[:top_k]
    return np.argsort(-z, kind="stable")  # stable: lower ids first among equal values
