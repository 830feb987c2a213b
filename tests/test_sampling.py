"""The sampler Generate draws tokens with: a function of (params, seed, step, logits) only,
each filter doing what it says, greedy ties to the lowest id, and draws that follow the
filtered distribution (a chi-square bound over many steps: the generator is keyed, so the
counts are the same on every run and the bound is checked, not hoped for)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ssmserve.server.sessions.sampling import (
    BadSamplingError,
    LogitsNotFiniteError,
    SamplingParams,
    draw,
    uniform,
)

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.25, 0.2], np.float32))  # p = these at T=1


def counts(params: SamplingParams, logits: np.ndarray, n: int, seed: int = 7) -> np.ndarray:
    out = np.zeros(len(logits), np.int64)
    for step in range(n):
        out[draw(params, (seed, step), logits).token] += 1
    return out


def test_a_draw_depends_only_on_params_seed_step_and_logits():
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.95, min_p=0.01, seed=11)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    first = [draw(params, (11, s), logits) for s in range(200)]
    # interleaved with other draws, in another order: the same tokens and logprobs
    for s in reversed(range(200)):
        draw(params, (12, s), logits)
        assert draw(params, (11, s), logits) == first[s]
    assert len({d.token for d in first}) > 1  # it does sample
    assert uniform(1, 2) == uniform(1, 2) != uniform(2, 1)


def test_another_seed_or_step_draws_otherwise():
    params = SamplingParams(temperature=1.0)
    logits = np.zeros(1000, np.float32)
    a = [draw(params, (1, s), logits).token for s in range(50)]
    b = [draw(params, (2, s), logits).token for s in range(50)]
    c = [draw(params, (1, s + 1), logits).token for s in range(50)]
    assert a != b and a != c


def test_greedy_is_the_argmax_with_the_lowest_id_on_ties():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 2.0], np.float32)
    for step in range(20):
        d = draw(SamplingParams(temperature=0.0, seed=step), (step, step), logits)
        assert (d.token, d.logprob) == (1, 0.0)


def test_top_k_keeps_the_k_most_likely_and_cuts_ties_by_id():
    assert set(np.flatnonzero(counts(SamplingParams(1.0, top_k=2), LOGITS, 400))) == {1, 3}
    tied = np.array([1.0, 3.0, 3.0, 3.0, 0.0], np.float32)
    assert set(np.flatnonzero(counts(SamplingParams(1.0, top_k=2), tied, 400))) == {1, 2}
    # top_k past the vocabulary keeps them all
    assert (counts(SamplingParams(1.0, top_k=99), LOGITS, 2000) > 0).all()


def test_top_p_keeps_the_shortest_head_reaching_p():
    # sorted: 0.4 (1), 0.25 (3), 0.2 (4), 0.1 (2), 0.05 (0); 0.4 + 0.25 = 0.65 >= 0.6
    assert set(np.flatnonzero(counts(SamplingParams(1.0, top_p=0.6), LOGITS, 400))) == {1, 3}
    assert set(np.flatnonzero(counts(SamplingParams(1.0, top_p=0.66), LOGITS, 400))) == {1, 3, 4}
    d = draw(SamplingParams(1.0, top_p=0.3), (0, 0), LOGITS)  # only the first one
    assert (d.token, d.logprob) == (1, 0.0)


def test_min_p_drops_tokens_below_a_share_of_the_top_one():
    # 0.4 x 0.45 = 0.18: ids 1 (0.4), 3 (0.25) and 4 (0.2) stay
    got = counts(SamplingParams(1.0, min_p=0.45), LOGITS, 600)
    assert set(np.flatnonzero(got)) == {1, 3, 4}
    assert set(np.flatnonzero(counts(SamplingParams(1.0, min_p=0.7), LOGITS, 400))) == {1}


def test_draws_follow_the_filtered_distribution():
    """Chi-square over 20,000 draws: 4 degrees of freedom, bound 30 (p ~ 5e-6 for a true
    sampler); the logprob each draw reports is the log of the probability it had."""
    n = 20_000
    for params, p in [
        (SamplingParams(1.0), np.array([0.05, 0.4, 0.1, 0.25, 0.2])),
        (SamplingParams(2.0), _softmax(LOGITS.astype(np.float64) / 2.0)),
        (SamplingParams(1.0, top_k=3), np.array([0, 0.4, 0, 0.25, 0.2]) / 0.85),
    ]:
        got = counts(params, LOGITS, n, seed=3)
        expected = n * p
        live = expected > 0
        assert (got[~live] == 0).all()
        chi2 = float((((got - expected) ** 2)[live] / expected[live]).sum())
        assert chi2 < 30.0, (params, got, expected, chi2)
        d = draw(params, (3, 0), LOGITS)
        assert math.isclose(d.logprob, math.log(p[d.token]), rel_tol=1e-6)


def test_a_temperature_near_zero_is_almost_greedy_and_high_is_almost_uniform():
    assert counts(SamplingParams(0.01), LOGITS, 300)[1] == 300
    flat = counts(SamplingParams(100.0), LOGITS, 5000)
    assert flat.min() > 800


@pytest.mark.parametrize(
    "params, what",
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(temperature=100.5), "temperature"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_p=-0.01), "top_p"),
        (SamplingParams(top_p=float("nan")), "top_p"),
        (SamplingParams(min_p=1.01), "min_p"),
        (SamplingParams(min_p=float("nan")), "min_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(seed=-1), "seed"),
    ],
)
def test_bad_parameters_are_refused_by_name(params, what):
    with pytest.raises(BadSamplingError, match=what):
        params.check()


def test_good_edges_are_accepted():
    for params in [
        SamplingParams(0.0),
        SamplingParams(100.0),
        SamplingParams(1.0, top_p=0.0, min_p=1.0, top_k=10**9, seed=2**64 - 1),
    ]:
        assert params.check() is params


def test_logits_that_cannot_be_drawn_from_are_an_error():
    for bad in (np.nan, np.inf):
        logits = LOGITS.copy()
        logits[2] = bad
        with pytest.raises(LogitsNotFiniteError):
            draw(SamplingParams(1.0), (0, 4), logits)
    with pytest.raises(LogitsNotFiniteError):
        draw(SamplingParams(0.0), (0, 4), np.full(5, -np.inf, np.float32))
    # -Inf is probability 0: never drawn
    logits = LOGITS.copy()
    logits[1] = -np.inf
    assert counts(SamplingParams(1.0), logits, 500)[1] == 0


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()
