"""Drawing a token from a step's logits: greedy, or seeded sampling with filters.

Generate feeds every drawn token back as the session's next input, and a retry, a
replay or another worker must draw the same token again. So a draw depends on nothing
but ``(params, seed, step, logits)``:

- the float32 logits are widened to float64 and every filter works in float64, in this
  fixed order: the penalties and logit bias over the session's recent inputs
  (``logits.adjusted``, only when the request sets them), then temperature, top-k,
  softmax, top-p, min-p (see :func:`draw`);
- the uniform variate comes from a counter-based generator (Philox4x64-10) keyed by
  ``(seed, step)``, counter 0: nothing is carried from one draw to the next, so no
  generator state is checkpointed and any step can be drawn again on its own.

Temperature 0 is greedy: the argmax, the lowest id among equal maxima (what Forecast
feeds back), drawn with probability 1 (logprob 0).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from ssmserve.server.errors import ErrorKind, SsmserveError

MAX_TEMPERATURE = 100.0
MAX_PENALTY_LAST_N = 4096
DEFAULT_PENALTY_LAST_N = 64
REPETITION_PENALTY_RANGE = (0.01, 10.0)
MAX_PRESENCE_FREQUENCY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
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
    # Penalties over the session's last ``penalty_last_n`` inputs (``logits.adjusted``):
    # 1 / 0 / 0 turn them off.
    repetition_penalty: float = 1.0  # in [0.01, 10]
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N  # 0 .. 4096
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias in [-100, 100]), ids sorted

    def check(self) -> SamplingParams:
        """These parameters, or BadSamplingError naming the first one out of range."""
        self._check_penalties()
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

    def _check_penalties(self) -> None:
        low, high = REPETITION_PENALTY_RANGE
        r = self.repetition_penalty
        if not (math.isfinite(r) and low <= r <= high):
            raise BadSamplingError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1 or 0: off), got {r!r}"
            )
        m = MAX_PRESENCE_FREQUENCY
        for name, value in (
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ):
            if not (math.isfinite(value) and -m <= value <= m):
                raise BadSamplingError(f"{name} must be in [-{m:g}, {m:g}], got {value!r}")
        if not 0 <= self.penalty_last_n <= MAX_PENALTY_LAST_N:
            raise BadSamplingError(
                f"penalty_last_n must be in 0..{MAX_PENALTY_LAST_N}, got {self.penalty_last_n}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise BadSamplingError(
                f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                f"{len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise BadSamplingError(
                    f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {bias!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties or the bias change any logit (else the draw reads the
        float32 logits as they are)."""
        window = self.penalty_last_n > 0 and (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
        return window or bool(self.logit_bias)


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
    """The token ``params`` draw from ``logits`` (V,) float32 (or float64: adjusted by
    the penalties and bias, ``logits.adjusted``) at ``seed_step`` ``(seed, step)``. In
    float64, in this order:

    1. temperature 0: the argmax (lowest id on ties), logprob 0;
    2. ``z = logits / temperature``; ids ordered by z descending, ties by id ascending;
    3. top-k: the first k of that order;
    4. softmax over them, in that order (``exp(z - max)``, then each over their sum,
       numpy's pairwise sum of the array in that order), ids of probability 0 dropped;
    5. top-p: the shortest prefix whose cumulative probability (a running sum in that
       order) reaches top_p, renormalized by it;
    6. min-p: those with probability >= min_p x the first one's, renormalized;
    7. the token whose cumulative interval holds ``u = uniform(seed, step)`` (the first
       with cumulative sum > u x total).

    Every step above depends on the values in that order, not on which id holds them, so
    only the values are sorted (the float32 logits: dividing by the temperature keeps
    their order), and an id is looked up for the one position drawn (:func:`_id_at`); the
    running sum of top-p goes only as far as the cut (:func:`_top_p_head`). The arrays of
    the vocabulary's size live in per-thread buffers: fresh ones cost as much in page
    faults as the arithmetic.

    Raises LogitsNotFiniteError when a logit is NaN or +Inf (-Inf is probability 0), every
    one is -Inf, or the largest over the temperature overflows float64.
    """
    # float32 logits as the model gives them, or float64 ones the penalties adjusted
    # (``logits.adjusted``): their values are ranked as they are.
    z = np.asarray(logits)
    if z.dtype != np.float64:
        z = np.asarray(z, np.float32)
    top = z.max()  # NaN if one is, else +Inf if one is, else -Inf only if all are
    if not -np.inf < top < np.inf:
        step = seed_step[1]
        raise LogitsNotFiniteError(
            f"the logits of step {step} hold NaN or +Inf (or are all -Inf), so no token can "
            f"be drawn from them; a FINITE guard with action REJECT stops such a step"
        )
    if params.greedy:
        return Draw(int(np.argmax(z)), 0.0)  # argmax: the lowest id among equal maxima
    ranked, p, running = _ranked(z, params.top_k)  # z's values descending; float64 room
    np.copyto(p, ranked)
    with np.errstate(over="ignore"):  # an overflow is refused just below
        p /= params.temperature
    largest = float(p[0])
    if not math.isfinite(largest):
        raise LogitsNotFiniteError(
            f"the largest logit of step {seed_step[1]} over temperature "
            f"{params.temperature!r} is {largest} in float64, so no token can be drawn; "
            f"use a larger temperature (or 0: greedy)"
        )
    p -= largest
    np.exp(p, out=p)
    where: np.ndarray | None = None  # positions in `ranked` of p's entries; None: 0, 1, ...
    live = p > 0.0  # -Inf logits (and underflows) cannot be drawn
    if not live.all():
        where, p = np.flatnonzero(live), p[live]
    total = p.sum()
    if 0.0 < params.top_p < 1.0:
        n = _top_p_head(p, total, params.top_p, running)
        p = p[:n]
        p /= running[n - 1]
        where = None if where is None else where[:n]
    else:
        p /= total
    if params.min_p > 0.0:
        keep = p >= params.min_p * p[0]
        if not keep.all():
            where = np.flatnonzero(keep) if where is None else where[keep]
        p = p[keep]
        p /= p.sum()
    cumulative = np.cumsum(p, out=running[: len(p)])
    u = uniform(*seed_step) * cumulative[-1]
    i = min(int(np.searchsorted(cumulative, u, side="right")), len(p) - 1)
    position = i if where is None else int(where[i])
    return Draw(_id_at(z, ranked, position), float(np.log(p[i])))


class _Buffers(threading.local):
    """Per thread, per vocabulary size and logits' dtype (the few most recent): an array
    of that dtype and two float64 arrays of that size."""

    def __init__(self) -> None:
        self.by_size: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def get(self, size: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (size, dtype.str)
        found = self.by_size.pop(key, None)
        if found is None:
            found = (np.empty(size, dtype), *np.empty((2, size), np.float64))
            while len(self.by_size) >= _BUFFERED_SIZES:
                del self.by_size[next(iter(self.by_size))]  # the least recently used
        self.by_size[key] = found
        return found


_BUFFERED_SIZES = 4
_BUFFERS = _Buffers()


def _ranked(z: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The values of ``z`` descending (only the ``top_k`` largest when 0 < top_k < len(z)),
    and two float64 buffers of their length; all views of this thread's buffers."""
    values, wide, running = _BUFFERS.get(len(z), z.dtype)
    np.copyto(values, z)
    if 0 < top_k < len(z):
        values.partition(len(z) - top_k)
        values = values[len(z) - top_k :]
    values.sort()
    return values[::-1], wide[: len(values)], running[: len(values)]


def _top_p_head(p: np.ndarray, total: float, top_p: float, running: np.ndarray) -> int:
    """The length n of the shortest prefix of ``p / total`` whose running sum reaches
    ``top_p`` (all of it if none does). Leaves ``p[:n]`` divided by ``total`` and
    ``running[:n]`` its running sum, the one ``np.cumsum`` gives over the whole array (a
    left-to-right loop), computed in growing chunks, each carried on from the last."""
    start, size = 0, 256
    while start < len(p):
        end = min(start + size, len(p))
        chunk = p[start:end]
        chunk /= total
        running[start:end] = chunk
        carried = max(start - 1, 0)  # the chunk's sums start from the one before it
        np.add.accumulate(running[carried:end], out=running[carried:end])
        j = int(np.searchsorted(running[start:end], top_p, side="left"))
        if j < end - start:
            return start + j + 1
        start, size = end, size * 4
    return len(p)


def _id_at(z: np.ndarray, ranked: np.ndarray, position: int) -> int:
    """The id at ``position`` of the ids ordered by value descending, ties by id
    ascending: among the ids holding ``ranked[position]``, the one of its rank among the
    equal values before it. (Distinct float32 logits stay distinct over a temperature in
    (0, 100] except where they overflow to -Inf, and those have probability 0. Float64
    logits the penalties adjusted can meet after the division, rarely: such ids are
    ordered by their value before it, larger first.)"""
    value = ranked[position]
    first = int(np.count_nonzero(ranked[:position] > value))
    return int(np.flatnonzero(z == value)[position - first])
