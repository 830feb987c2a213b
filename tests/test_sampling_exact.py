"""The sampler draws what its reference draws, bit for bit: the same token id and the
same logprob bits for the same (logits, params, seed, step). Generate's exactness promise
rests on it: a generation resumed on another worker, or served by an older and a newer
worker during a rolling upgrade, goes on with the same tokens.

``reference_draw`` is the sampler as first specified (a full stable argsort of the
vocabulary, every filter over the sorted arrays), kept here verbatim as the definition;
``draw`` must agree with it on ties, -Inf, huge ranges, exact top-p and min-p boundaries,
tiny vocabularies and the 50,280 ids of the released Mamba checkpoints."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssmserve.server.sessions.sampling import (
    Draw,
    LogitsNotFiniteError,
    SamplingParams,
    draw,
    uniform,
)

VOCAB = 50_280  # the released Mamba checkpoints' vocabulary
F32_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------- the reference (verbatim)


def reference_draw(
    params: SamplingParams, seed_step: tuple[int, int], logits: np.ndarray, wide: bool = False
) -> Draw:
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
    # wide: float64 logits the penalties adjusted, taken as they are
    z = np.array(logits, np.float64) if wide else np.asarray(logits, np.float32).astype(np.float64)
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


# ----------------------------------------------------------------- comparing


def assert_same_draw(params: SamplingParams, seed_step: tuple[int, int], logits) -> None:
    """Both draw the same id with the same logprob bits, or both refuse the logits (the
    reference fails with an IndexError where logits / temperature overflows float64;
    ``draw`` names it)."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # the reference's overflow
            want = reference_draw(params, seed_step, logits)
    except (LogitsNotFiniteError, IndexError):
        with pytest.raises(LogitsNotFiniteError):
            draw(params, seed_step, logits)
        return
    got = draw(params, seed_step, logits)
    assert (got.token, bits(got.logprob)) == (want.token, bits(want.logprob)), (
        params,
        seed_step,
        got,
        want,
    )


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


# ----------------------------------------------------------------- strategies

# Few distinct values, so ties are common; the edges of float32 and -Inf among them.
SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, F32_MAX, -F32_MAX, -np.inf, 30.0, -30.0]


def _logits(rng: np.random.Generator, vocab: int, shape: str) -> np.ndarray:
    """Logits of one of several shapes: a model's (normal, scale 1 to 10), heavy ties
    (small integers), a huge range, some -Inf, a few ids far above the rest."""
    if shape == "normal":
        x = rng.standard_normal(vocab) * rng.uniform(0.5, 10.0)
    elif shape == "ties":
        x = rng.integers(-3, 4, vocab).astype(np.float64)
    elif shape == "huge":
        x = rng.uniform(-F32_MAX, F32_MAX, vocab)
    elif shape == "spread":
        x = rng.standard_normal(vocab) * 10.0 ** rng.uniform(-3, 3)
    else:  # "peaked": a few ids far above a flat tail
        x = rng.standard_normal(vocab)
        x[rng.integers(0, vocab, 3)] += rng.uniform(5.0, 800.0)
    neg_inf = rng.random(vocab) < rng.choice([0.0, 0.0, 0.3, 0.95])
    x[neg_inf] = -np.inf
    special = rng.random(vocab) < 0.02
    x[special] = rng.choice(SPECIAL, int(special.sum()))
    logits = x.astype(np.float32)
    if np.isneginf(logits).all():
        logits[rng.integers(0, vocab)] = 0.0
    return logits


temperatures = st.one_of(
    st.sampled_from([0.0, 1.0, 0.7, 100.0, 1e-3, 1e-300, 5e-324]),
    st.floats(min_value=1e-6, max_value=100.0),
)
probabilities = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, 0.9, 0.95, 0.05, 5e-324, 1.0 - 2**-53]),
    st.floats(min_value=0.0, max_value=1.0),
)


@st.composite
def sampling_params(draw_: st.DrawFn, vocab: int) -> SamplingParams:
    top_k = draw_(
        st.one_of(st.just(0), st.integers(1, min(vocab + 2, 64)), st.integers(0, vocab + 2))
    )
    return SamplingParams(
        temperature=draw_(temperatures),
        top_k=top_k,
        top_p=draw_(probabilities),
        min_p=draw_(probabilities),
        seed=draw_(st.integers(0, 2**64 - 1)),
    )


steps = st.integers(0, 2**64 - 1)
SHAPES = ["normal", "ties", "huge", "spread", "peaked"]


def exact(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


# ----------------------------------------------------------------- the properties


@exact(400)
@given(data=st.data(), vocab=st.integers(1, 300), shape=st.sampled_from(SHAPES))
def test_small_vocabularies_draw_what_the_reference_draws(data, vocab, shape):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32), label="logits seed"))
    logits = _logits(rng, vocab, shape)
    params = data.draw(sampling_params(vocab))
    for step in data.draw(st.lists(steps, min_size=1, max_size=8), label="steps"):
        assert_same_draw(params, (params.seed, step), logits)


@exact(300)
@given(
    values=st.lists(st.sampled_from([*SPECIAL, 2.0, 0.5]), min_size=1, max_size=40),
    params=sampling_params(40),
    step=steps,
)
def test_lists_of_few_values_draw_what_the_reference_draws(values, params, step):
    """Hypothesis shrinks these to the fewest ids and values that disagree."""
    logits = np.array(values, np.float32)
    if np.isneginf(logits).all():
        logits[0] = 0.0
    assert_same_draw(params, (params.seed, step), logits)


@exact(40)
@given(data=st.data(), shape=st.sampled_from(SHAPES))
def test_a_full_vocabulary_draws_what_the_reference_draws(data, shape):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32), label="logits seed"))
    logits = _logits(rng, VOCAB, shape)
    params = data.draw(sampling_params(VOCAB))
    for step in data.draw(st.lists(steps, min_size=1, max_size=4), label="steps"):
        assert_same_draw(params, (params.seed, step), logits)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02),
    ],
)
def test_the_common_settings_over_a_full_vocabulary_draw_what_the_reference_draws(params):
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(VOCAB) * 2.5).astype(np.float32)
    for step in range(60):
        logits[rng.integers(0, VOCAB, 20)] += 4.0  # a different head each step
        assert_same_draw(params, (9, step), logits)


@exact(300)
@given(data=st.data(), vocab=st.integers(1, 200), shape=st.sampled_from(SHAPES))
def test_top_p_and_min_p_exactly_at_a_boundary_draw_what_the_reference_draws(data, vocab, shape):
    """top_p equal to a running sum (top-p is inclusive: that prefix, no more) and min_p
    putting a probability exactly on its threshold, and their neighbouring floats."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32), label="logits seed"))
    logits = _logits(rng, vocab, shape)
    temperature = data.draw(st.sampled_from([1.0, 0.5, 3.0]))
    z = np.sort(logits.astype(np.float64) / temperature)[::-1]
    p = np.exp(z - z[0])
    p = p[p > 0.0]
    p /= p.sum()
    cumulative = np.cumsum(p)
    j = data.draw(st.integers(0, len(p) - 1))
    nudge = data.draw(st.sampled_from([0.0, -np.inf, np.inf]))
    top_p = float(np.nextafter(cumulative[j], nudge)) if nudge else float(cumulative[j])
    min_p = float(np.nextafter(p[j] / p[0], data.draw(st.sampled_from([0.0, 2.0]))))
    for top_p_, min_p_ in [(top_p, 0.0), (0.0, float(p[j] / p[0])), (1.0, min_p)]:
        if not (0.0 <= top_p_ <= 1.0 and 0.0 <= min_p_ <= 1.0):
            continue
        params = SamplingParams(temperature, top_p=top_p_, min_p=min_p_, seed=3)
        for step in range(4):
            assert_same_draw(params, (3, step), logits)


def test_logits_over_a_tiny_temperature_that_overflow_are_refused_by_name():
    logits = np.array([1.0, 2.0, -1.0], np.float32)
    with pytest.raises(LogitsNotFiniteError, match="temperature"):
        draw(SamplingParams(temperature=1e-310), (0, 0), logits)
    with pytest.raises(IndexError), np.errstate(over="ignore", invalid="ignore"):
        reference_draw(SamplingParams(temperature=1e-310), (0, 0), logits)  # what it did


def test_logits_the_penalties_adjust_draw_what_the_reference_draws_in_float64():
    """``draw`` takes the float64 logits ``logits.adjusted`` gives as they are: the same
    id and logprob bits as the reference over the same float64 values (50,280 ids, every
    filter, penalties over a window of ids that repeat)."""
    from ssmserve.server.sessions.logits import adjusted

    rng = np.random.default_rng(50)
    for case in range(12):
        logits = (rng.standard_normal(VOCAB) * rng.uniform(1.0, 8.0)).astype(np.float32)
        window = rng.integers(0, 400, 64).tolist()
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])), top_k=int(rng.choice([0, 40])),
            top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.05])),
            seed=case, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
            logit_bias=((7, 5.0), (11, -100.0)),
        )  # fmt: skip
        z = adjusted(logits, params, window)
        for step in rng.integers(0, 2**63, 4).tolist():
            want = reference_draw(params, (params.seed, step), z, wide=True)
            got = draw(params, (params.seed, step), z)
            assert (got.token, bits(got.logprob)) == (want.token, bits(want.logprob))
