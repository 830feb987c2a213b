"""Penalties, logit bias and logprobs through a real worker, exact under replay.

The reference is written here from the definitions (HF's repetition penalty, OpenAI's
presence and frequency penalties, llama.cpp's window of the last ``penalty_last_n``
inputs, prompt and generated alike), a loop per seen id in float64, and fed to the
sampler's draw; the offline engine gives the logits. A served generation must give the
same tokens, and logprobs equal to a log-softmax of the same adjusted logits, across a
fork, a rollback and a resumed call.
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import grpc
import numpy as np
import pytest

from ssmserve.client.errors import InvalidArgument
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.sessions.logits import adjusted, logprobs
from ssmserve.server.sessions.sampling import SamplingParams, draw
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.test_generate import PARAMS, PROMPT, raw_generate, sampling
from tests.worker_process import WorkerProcess

PENALTIES = {
    "repetition_penalty": 1.3,
    "presence_penalty": 0.4,
    "frequency_penalty": 0.25,
    "penalty_last_n": 12,
}
BIAS = {5: 2.5, 7: -100.0}


def reference_adjusted(logits, window, rep, presence, frequency, bias):
    z = [float(x) for x in np.asarray(logits, np.float32)]
    counts: dict[int, int] = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    for t, n in counts.items():
        z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
        z[t] -= presence + frequency * n
    for t, b in bias.items():
        z[t] += b
    return np.asarray(z, np.float64)


def params_of(penalties=PENALTIES, bias=BIAS) -> SamplingParams:
    f32 = {k: float(np.float32(v)) if k.endswith("penalty") else v for k, v in penalties.items()}
    biases = tuple(sorted((t, float(np.float32(b))) for t, b in bias.items()))
    return replace(sampling(**PARAMS), **f32, logit_bias=biases)


def offline_penalized(model, prompt, n, penalties=PENALTIES, bias=BIAS, top_n=3):
    """(tokens, unfiltered logprobs, top lists) of ``n`` draws after ``prompt``."""
    p = params_of(penalties, bias)
    last_n = penalties["penalty_last_n"]
    inputs = list(prompt)
    outs, state = model.run(np.asarray(prompt, np.int64))
    out = outs[-1]
    tokens, chosen, tops = [], [], []
    for _ in range(n):
        window = inputs[-last_n:] if last_n else []
        z = reference_adjusted(
            out, window, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            dict(p.logit_bias),
        )  # fmt: skip
        d = draw(p, (p.seed, len(inputs)), z)
        log_total = z.max() + math.log(np.exp(z - z.max()).sum())
        order = sorted(range(len(z)), key=lambda i: (-z[i], i))[:top_n]
        tokens.append(d.token)
        chosen.append(z[d.token] - log_total)
        tops.append([(i, z[i] - log_total) for i in order])
        inputs.append(d.token)
        o, state = model.run(np.array([d.token]), state)
        out = o[0]
    return tokens, chosen, tops


def test_adjusted_follows_the_definitions_in_float64():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, 50).astype(np.float32)
    window = [1, 4, 4, 9, 1, 4, 30]
    p = params_of()
    got = adjusted(logits, p, window)
    want = reference_adjusted(logits, window, p.repetition_penalty, p.presence_penalty,
                              p.frequency_penalty, dict(p.logit_bias))  # fmt: skip
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float64
    lp = logprobs(got, 4, 5)
    assert [i for i, _ in lp.top] == sorted(range(50), key=lambda i: (-got[i], i))[:5]
    assert math.isclose(sum(math.exp(x) for x in got - np.log(np.exp(got).sum())), 1.0)
    # penalties off and no bias: the float32 logits as they are
    assert not SamplingParams(temperature=1.0).penalized
    assert SamplingParams(logit_bias=((1, 0.5),)).penalized


def test_served_penalties_and_logprobs_are_the_reference_and_exact_on_replay(worker, served_models):
    model = served_models["lm"]
    c = worker.client
    n = 40
    tokens, chosen, tops = offline_penalized(model, PROMPT, n)
    plain = [t for t in _served(c, c.create_session("lm").session_id, n, penalties=False)]
    assert [t.token_id for t in plain] != tokens  # the penalties change the draws
    sid = c.create_session("lm", snapshot_every=8).session_id
    got = _served(c, sid, n)
    assert [t.token_id for t in got] == tokens
    np.testing.assert_allclose([t.unfiltered_logprob for t in got], chosen, rtol=1e-6)
    for t, top in zip(got, tops, strict=True):
        assert [x.token_id for x in t.top_logprobs] == [i for i, _ in top]
        np.testing.assert_allclose([x.logprob for x in t.top_logprobs], [v for _, v in top],
                                   rtol=1e-6)  # fmt: skip
    assert 7 not in tokens  # biased by -100
    # a fork at the prompt, a rollback into the generation, a resumed raw call: the same
    start = len(PROMPT)
    fork = c.fork(sid, at_step=start).session.session_id
    assert [t.token_id for t in _served(c, fork, n, prompt=False)] == tokens
    assert c.rollback(sid, to_step=start + 15).step == start + 15
    again = _served(c, sid, n - 15, prompt=False)
    assert [t.token_id for t in again] == tokens[15:]
    assert [t.unfiltered_logprob for t in again] == [t.unfiltered_logprob for t in got[15:]]
    replies = raw_generate(
        worker, session_id=sid, at_step=start + 20, generated_before=20, max_tokens=n,
        sampling=pb.SamplingParams(**PARAMS, **PENALTIES, logit_bias=BIAS), top_logprobs=3,
    )  # fmt: skip
    resent = [t for r in replies for t in r.tokens]
    assert [t.token_id for t in resent] == tokens[20:]
    assert [t.unfiltered_logprob for t in resent] == [
        np.float32(t.unfiltered_logprob) for t in got[20:]
    ]


def _served(c, sid, n, prompt=True, penalties=True):
    extra = {**PENALTIES, "logit_bias": BIAS} if penalties else {}
    ids = PROMPT if prompt else None
    return list(c.generate(sid, n, prompt_ids=ids, top_logprobs=3, **PARAMS, **extra))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"repetition_penalty": 11.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"penalty_last_n": 4097}, "penalty_last_n"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
        ({"logit_bias": {37: 1.0}}, "logit_bias"),
    ],
)
def test_bad_penalties_are_invalid_argument_naming_the_field(worker, change, field):
    c = worker.client
    sid = c.create_session("lm").session_id
    with pytest.raises(InvalidArgument, match=field):
        next(c.generate(sid, 5, prompt_ids=PROMPT, **{**PARAMS, **change}))
    assert c.get_session(sid).step == 0


def test_a_greedy_draw_takes_the_argmax_of_the_adjusted_logits(worker, served_models):
    c = worker.client
    sid = c.create_session("lm").session_id
    got = list(c.generate(sid, 20, prompt_ids=PROMPT, temperature=0.0, logprobs=True,
                          repetition_penalty=2.0, penalty_last_n=64))  # fmt: skip
    model = served_models["lm"]
    p = SamplingParams(repetition_penalty=2.0, penalty_last_n=64)
    inputs = list(PROMPT)
    outs, state = model.run(np.asarray(PROMPT, np.int64))
    out = outs[-1]
    for t in got:
        z = reference_adjusted(out, inputs[-64:], 2.0, 0.0, 0.0, {})
        assert t.token_id == int(np.argmax(z)) == draw(p, (0, len(inputs)), z).token
        assert t.top_logprobs == [] and t.unfiltered_logprob is not None
        inputs.append(t.token_id)
        o, state = model.run(np.array([t.token_id]), state)
        out = o[0]
    with pytest.raises(grpc.RpcError):
        raw_generate(worker, session_id=sid, max_tokens=3, top_logprobs=21)


def test_a_migration_mid_generation_changes_no_penalized_token_or_logprob(
    start_worker, served_models
):
    """The session moves to another worker after 50 tokens: the penalties' window there
    comes from the session's carried history, so the tokens and logprobs go on the same."""
    a, b = start_worker(), start_worker()
    sid = a.client.create_session("lm", snapshot_every=64).session_id
    n = 400
    tokens, chosen, _ = offline_penalized(served_models["lm"], PROMPT, n)
    got, moved = [], []
    with Client([a.address, b.address]) as client:
        extra = {**PENALTIES, "logit_bias": BIAS}
        for t in client.generate(sid, n, prompt_ids=PROMPT, logprobs=True, **PARAMS, **extra):
            got.append(t)
            if len(got) == 50:
                moved.append(a.client.migrate(sid, b.address))
        assert client.get_session(sid).owner == b.address
    assert len(PROMPT) + 50 <= moved[0].step < len(PROMPT) + n  # it moved mid-generation
    assert [t.token_id for t in got] == tokens
    np.testing.assert_allclose([t.unfiltered_logprob for t in got], chosen, rtol=1e-6)


@pytest.mark.slow
def test_kill_9_of_the_owner_mid_generation_changes_no_penalized_token(
    model_dirs, served_models, redis_url, tmp_path
):
    """The owner is killed after 100 penalized tokens; the other worker takes over (the
    session rebuilt from its snapshot and log) and the generation goes on the same."""
    workers = [
        WorkerProcess({"lm": model_dirs["lm"]}, redis_url, tmp_path / f"w{i}", lease_ttl_s=1.0)
        for i in range(2)
    ]
    threads = [threading.Thread(target=w.start) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert all(w.alive for w in workers)
        addresses = [w.address for w in workers]
        sid = Client(addresses[0]).create_session("lm", snapshot_every=32).session_id
        n = 600
        tokens = offline_penalized(served_models["lm"], PROMPT, n)[0]
        got = []
        policy = RetryPolicy(keepalive_time_s=0.5, keepalive_timeout_s=0.5, call_timeout_s=5.0)
        extra = {**PENALTIES, "logit_bias": BIAS}
        with Client(addresses, retry=policy) as client:
            for t in client.generate(sid, n, prompt_ids=PROMPT, **PARAMS, **extra):
                got.append(t)
                if len(got) == 100:
                    workers[0].kill()
            info = client.get_session(sid)
        assert info.owner == addresses[1] and info.step == len(PROMPT) + n
        assert [t.token_id for t in got] == tokens
    finally:
        for w in workers:
            w.kill()


def test_the_top_logprobs_leave_out_ids_of_probability_zero():
    """A constraint's mask (or a -Inf logit) leaves fewer finite ids than asked for: the
    top list holds only those (a -Inf entry is no token anyone could get, and no number
    JSON carries)."""
    z = np.array([0.0, -np.inf, 1.0, -np.inf], np.float64)
    lp = logprobs(z, 2, 4)
    assert [i for i, _ in lp.top] == [2, 0]
    assert all(np.isfinite(p) for _, p in lp.top) and np.isfinite(lp.chosen)
