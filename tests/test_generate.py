"""Generate end to end: real workers on a real redis-server, the token fixture model.

The reference for every generation is the offline engine fed the prompt and then its own
draws (``sampling.draw`` keyed by (seed, step)): a served generation must give exactly
those tokens, whatever happened to the session on the way (rollback, fork, migration,
kill -9 of its worker), each token once.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from ssmserve.client.errors import FailedPrecondition, InvalidArgument, StepFailed
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.sessions.sampling import SamplingParams, draw
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.cluster_helpers import wait_for
from tests.tcp_proxy import TcpProxy
from tests.test_service import stub
from tests.worker_process import WorkerProcess

PARAMS = {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "min_p": 0.02, "seed": 77}
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def sampling(**params: float) -> SamplingParams:
    """What the worker makes of these parameters (float32 on the wire)."""
    f32 = {k: float(np.float32(v)) if k in ("temperature", "top_p", "min_p") else v
           for k, v in params.items()}  # fmt: skip
    return SamplingParams(**f32)


def offline(model, prompt, n, params=PARAMS, history=()):
    """(tokens, logprobs, logits of each step from the prompt's last on) of ``n`` draws
    after feeding ``history`` then ``prompt`` to a fresh state."""
    fed = np.asarray([*history, *prompt], np.int64)
    outs, state = model.run(fed)
    out, step, p = outs[-1], len(fed), sampling(**params)
    tokens, logprobs, logits = [], [], [out]
    for _ in range(n):
        d = draw(p, (p.seed, step), out)
        tokens.append(d.token)
        logprobs.append(d.logprob)
        o, state = model.run(np.array([d.token]), state)
        out, step = o[0], step + 1
        logits.append(out)
    return tokens, logprobs, logits


def generate(client, sid, n, **kw):
    return list(client.generate(sid, n, **{**PARAMS, **kw}))


def raw_generate(worker, **fields):
    """Every response of one Generate call made with the raw stub (no client retries)."""
    request = pb.GenerateRequest(**fields)
    return list(stub(worker).Generate(request, timeout=30))


# ---------------------------------------------------------------------------- exactness


def test_the_same_seed_gives_the_same_tokens_as_the_offline_engine(worker, served_models):
    model = served_models["lm"]
    c = worker.client
    a, b = (c.create_session("lm").session_id for _ in range(2))
    got_a, got_b = generate(c, a, 40, prompt_ids=PROMPT), generate(c, b, 40, prompt_ids=PROMPT)
    tokens, logprobs, _ = offline(model, PROMPT, 40)
    assert [t.token_id for t in got_a] == [t.token_id for t in got_b] == tokens
    assert [t.step for t in got_a] == list(range(len(PROMPT) + 1, len(PROMPT) + 41))
    np.testing.assert_allclose([t.logprob for t in got_a], logprobs, rtol=1e-6)
    assert len(set(tokens)) > 5  # it samples, not a constant
    # every token is logged as the session's input
    np.testing.assert_array_equal(c.history(a, 1).inputs, [*PROMPT, *tokens])
    assert c.get_session(a).step == len(PROMPT) + 40
    # another seed, another sequence
    other = c.create_session("lm").session_id
    assert [t.token_id for t in generate(c, other, 40, prompt_ids=PROMPT, seed=78)] != tokens


def test_greedy_generation_is_what_forecast_feeds_back(worker):
    c = worker.client
    sid = c.create_session("lm").session_id
    list(c.stream_steps(sid, PROMPT))
    fc = c.forecast(sid, 20)
    got = list(c.generate(sid, 21, temperature=0.0, seed=5))
    # the forecast's tokens are the argmaxes of its outputs: the generated tokens after
    # the first (the argmax of the prompt's last logits)
    assert [t.token_id for t in got[1:]] == fc.tokens.tolist()
    assert all(t.logprob == 0.0 for t in got)


def test_rollback_and_fork_at_the_start_generate_the_same_tokens(worker, served_models):
    model = served_models["lm"]
    c = worker.client
    sid = c.create_session("lm", snapshot_every=8).session_id
    list(c.stream_steps(sid, PROMPT))
    start = len(PROMPT)
    first = [t.token_id for t in generate(c, sid, 30)]
    assert first == offline(model, PROMPT, 30)[0]
    assert c.rollback(sid, to_step=start).step == start
    assert [t.token_id for t in generate(c, sid, 30)] == first
    fork = c.fork(sid, at_step=start).session.session_id
    assert [t.token_id for t in generate(c, fork, 30)] == first
    # after a generation, generating on from its end continues the same sequence
    assert c.rollback(sid, to_step=start + 10).step == start + 10
    assert [t.token_id for t in generate(c, sid, 20)] == first[10:]


def test_a_cut_off_answer_is_answered_again_from_the_log(worker, served_models):
    """The session generated past what the client received: a retry from the last step it
    got (and the tokens it has) is answered those tokens from the log, then goes on."""
    model = served_models["lm"]
    c = worker.client
    sid = c.create_session("lm", snapshot_every=4).session_id
    list(c.generate(sid, 30, prompt_ids=PROMPT, **PARAMS))
    tokens = offline(model, PROMPT, 45)[0]
    start = len(PROMPT)
    sampling_pb = pb.SamplingParams(**PARAMS)
    replies = raw_generate(
        worker, session_id=sid, at_step=start + 10, max_tokens=45, sampling=sampling_pb,
        generated_before=10,
    )  # fmt: skip
    again = [t for r in replies for t in r.tokens]
    assert [t.step for t in again] == list(range(start + 11, start + 46))
    assert [t.token_id for t in again] == tokens[10:]
    assert replies[-1].finish_reason == pb.GenerateResponse.FINISH_LENGTH
    assert replies[-1].session_step == start + 45
    # nothing received: the same request again, prompt and all, answers every token
    sid2 = c.create_session("lm").session_id
    list(c.generate(sid2, 12, prompt_ids=PROMPT, **PARAMS))
    replies = raw_generate(
        worker, session_id=sid2, at_step=0, prompt_ids=PROMPT, max_tokens=12,
        sampling=sampling_pb,
    )  # fmt: skip
    assert [t.token_id for r in replies for t in r.tokens] == tokens[:12]
    assert c.get_session(sid2).step == start + 12  # nothing was fed twice
    # a resumed generation whose logged tokens are not its draws is refused
    replies = raw_generate(
        worker, session_id=sid, at_step=start + 10, max_tokens=45,
        sampling=pb.SamplingParams(**{**PARAMS, "seed": 1}), generated_before=10,
    )  # fmt: skip
    (last,) = replies
    assert last.stopped.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert last.stopped.session_step == last.session_step == start + 45


# ---------------------------------------------------------------------------- endings


def test_a_stop_token_ends_the_generation_after_it(worker, served_models):
    model = served_models["lm"]
    tokens = offline(model, PROMPT, 60)[0]
    k = next(i for i in range(5, 60) if tokens[i] not in tokens[:i])
    sid = worker.client.create_session("lm").session_id
    replies = raw_generate(
        worker, session_id=sid, prompt_ids=PROMPT, max_tokens=60,
        sampling=pb.SamplingParams(**PARAMS), stop_token_ids=[tokens[k]],
    )  # fmt: skip
    got = [t.token_id for r in replies for t in r.tokens]
    assert got == tokens[: k + 1]
    assert replies[-1].finish_reason == pb.GenerateResponse.FINISH_STOP
    assert not replies[-1].HasField("stopped")
    assert worker.client.get_session(sid).step == len(PROMPT) + k + 1
    # the client ends there too
    sid = worker.client.create_session("lm").session_id
    got = generate(worker.client, sid, 60, prompt_ids=PROMPT, stop_token_ids=[tokens[k]])
    assert [t.token_id for t in got] == tokens[: k + 1]


def test_a_guard_that_rejects_ends_the_generation(worker, served_models):
    """A RANGE guard on one logit, set just below where the reference first passes it
    after a few tokens: generation ends there with FINISH_GUARD, the step not applied."""
    model = served_models["lm"]
    _tokens, _lp, logits = offline(model, PROMPT, 40)
    prompt_outs = model.run(np.asarray(PROMPT))[0]
    k, dim, bound = _first_crossing(np.concatenate([prompt_outs[:-1], np.stack(logits)]),
                                    len(PROMPT) - 1 + 3)  # fmt: skip
    k -= len(PROMPT) - 1  # index into logits: the output of step len(PROMPT) + k
    rule = pb.GuardRule(
        name="cap", check=pb.GuardRule.CHECK_RANGE, max=bound, dims=[dim],
        action=pb.GuardRule.ACTION_REJECT,
    )  # fmt: skip
    c = worker.client
    sid = c.create_session("lm", guards=[rule]).session_id
    replies = raw_generate(
        worker, session_id=sid, prompt_ids=PROMPT, max_tokens=40,
        sampling=pb.SamplingParams(**PARAMS),
    )  # fmt: skip
    got = [t.token_id for r in replies for t in r.tokens]
    assert got == _tokens[: k - 1]  # the k-th token's step was rejected
    last = replies[-1]
    assert last.finish_reason == pb.GenerateResponse.FINISH_GUARD
    assert last.stopped.reason == "GUARD_REJECTED"
    assert c.get_session(sid).step == len(PROMPT) + k - 1 == last.session_step
    sid = c.create_session("lm", guards=[rule]).session_id
    seen = []
    with pytest.raises(StepFailed) as failed:
        for t in c.generate(sid, 40, prompt_ids=PROMPT, **PARAMS):
            seen.append(t.token_id)
    assert seen == got and failed.value.reason == "GUARD_REJECTED"


def _first_crossing(outs: np.ndarray, after: int) -> tuple[int, int, float]:
    """(row r > after, dim, bound): outs[r, dim] is the first value of that dim above the
    bound, every row before r is at or below it."""
    for r in range(after + 1, len(outs)):
        for dim in np.argsort(-outs[r]):
            bound = float(outs[:r, dim].max())
            if outs[r, dim] > bound:
                return r, int(dim), bound
    raise AssertionError("no crossing in the reference")


# ---------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    "change, what",
    [
        ({"sampling": {"temperature": -1.0}}, "temperature"),
        ({"sampling": {"temperature": float("nan")}}, "temperature"),
        ({"sampling": {"top_p": 1.5}}, "top_p"),
        ({"sampling": {"min_p": -0.1}}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"generated_before": 10}, "generated_before"),
        ({"prompt_ids": [1, 37]}, "token id 37"),
        ({"stop_token_ids": [-1]}, "token id -1"),
        ({"prompt_text": "hello", "prompt_ids": []}, "no tokenizer"),
        ({"prompt_text": "hello"}, "not both"),
    ],
)
def test_bad_requests_are_invalid_argument_and_leave_the_session_alone(worker, change, what):
    c = worker.client
    sid = c.create_session("lm").session_id
    list(c.stream_steps(sid, PROMPT))
    fields = {"session_id": sid, "max_tokens": 10, "prompt_ids": [2, 3]}
    sampling_fields = {**PARAMS, **change.pop("sampling", {})}
    fields.update(change)
    with pytest.raises(grpc.RpcError) as raised:
        raw_generate(worker, sampling=pb.SamplingParams(**sampling_fields), **fields)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert what in raised.value.details()
    info = c.get_session(sid)
    assert info.step == len(PROMPT)
    np.testing.assert_array_equal(c.history(sid, 1).inputs, PROMPT)
    with pytest.raises(InvalidArgument):
        c.generate(sid, 10, temperature=-1.0).__next__()
    assert c.get_session(sid).step == len(PROMPT)


def test_a_signal_model_or_a_session_not_at_at_step_is_failed_precondition(worker):
    c = worker.client
    signal = c.create_session("demo").session_id
    with pytest.raises(FailedPrecondition, match="token model"):
        next(c.generate(signal, 5, prompt_ids=[1]))
    sid = c.create_session("lm").session_id
    with pytest.raises(StepFailed, match="step 0") as failed:  # no logits yet, no prompt
        next(c.generate(sid, 5))
    assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
    list(c.stream_steps(sid, PROMPT))
    with pytest.raises(StepFailed, match="behind at_step") as failed:
        next(c.generate(sid, 5, at_step=len(PROMPT) + 3))
    assert failed.value.result.error.session_step == len(PROMPT)
    assert c.get_session(sid).step == len(PROMPT)


# ---------------------------------------------------------------------------- faults


def test_a_migration_mid_generation_changes_no_token(start_worker, served_models):
    model = served_models["lm"]
    a, b = start_worker(), start_worker()
    sid = a.client.create_session("lm", snapshot_every=64).session_id
    n = 3000
    tokens = offline(model, PROMPT, n)[0]
    got, moved = [], []
    with Client([a.address, b.address]) as client:
        for t in client.generate(sid, n, prompt_ids=PROMPT, **PARAMS):
            got.append(t)
            if len(got) == 50:
                moved.append(a.client.migrate(sid, b.address))
        assert client.get_session(sid).owner == b.address
    assert len(PROMPT) + 50 <= moved[0].step < len(PROMPT) + n  # it moved mid-generation
    assert [t.step for t in got] == list(range(len(PROMPT) + 1, len(PROMPT) + n + 1))
    assert [t.token_id for t in got] == tokens


def test_a_client_cut_off_mid_generation_gets_the_tokens_it_missed_once(
    start_worker, served_models
):
    """The client's network black-holes after 50 tokens while the worker goes on
    generating (and logging) tokens nobody receives; the client notices by keepalive and
    asks again, directly: the tokens it missed come from the log, none twice, then the
    generation goes on. (The cut-off call keeps generating until the worker notices
    too: its steps and the retry's are the same tokens, so either may take a step.)"""
    model = served_models["lm"]
    w = start_worker(keepalive_time_s=0.5, keepalive_timeout_s=0.5)
    sid = w.client.create_session("lm", snapshot_every=64).session_id
    n = 3000
    tokens = offline(model, PROMPT, n)[0]
    host, port = w.address.rsplit(":", 1)
    got = []
    policy = RetryPolicy(keepalive_time_s=0.5, keepalive_timeout_s=0.5, call_timeout_s=5.0)
    with TcpProxy(host, int(port)).start() as proxy:
        with Client([proxy.address, w.address], retry=policy, discover=False) as client:
            # at_step given: no GetSession first (whose answer names the worker itself)
            for t in client.generate(sid, n, prompt_ids=PROMPT, at_step=0, **PARAMS):
                got.append(t)
                if len(got) == 50:
                    assert client.owner_of(sid) == proxy.address
                    proxy.black_hole()
                    # the worker is ahead of what the client received
                    wait_for(
                        lambda: w.manager.resident(sid).step >= len(PROMPT) + len(got) + 100,
                        [], 10, "the worker generating on",
                    )  # fmt: skip
        proxy.heal(deliver=False)
    assert [t.step for t in got] == list(range(len(PROMPT) + 1, len(PROMPT) + n + 1))
    assert [t.token_id for t in got] == tokens
    assert w.client.get_session(sid).step == len(PROMPT) + n


@pytest.mark.slow
def test_kill_9_of_the_owner_mid_generation_changes_no_token(
    model_dirs, served_models, redis_url, tmp_path
):
    """The owner is killed after 100 tokens; the other worker takes the session over and
    the generation goes on there: the same tokens as undisturbed, none lost or doubled."""
    model = served_models["lm"]
    workers = [
        WorkerProcess({"lm": model_dirs["lm"]}, redis_url, tmp_path / f"w{i}", lease_ttl_s=1.0)
        for i in range(2)
    ]
    threads = [threading.Thread(target=w.start) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert all(w.alive for w in workers)
        addresses = [w.address for w in workers]
        sid = Client(addresses[0]).create_session("lm", snapshot_every=32).session_id
        n = 3000
        tokens = offline(model, PROMPT, n)[0]
        got = []
        policy = RetryPolicy(keepalive_time_s=0.5, keepalive_timeout_s=0.5, call_timeout_s=5.0)
        started = time.monotonic()
        with Client(addresses, retry=policy) as client:
            for t in client.generate(sid, n, prompt_ids=PROMPT, **PARAMS):
                got.append(t)
                if len(got) == 100:
                    workers[0].kill()
            info = client.get_session(sid)
        assert time.monotonic() - started < 60
        assert info.owner == addresses[1] and info.step == len(PROMPT) + n
        assert [t.step for t in got] == list(range(len(PROMPT) + 1, len(PROMPT) + n + 1))
        assert [t.token_id for t in got] == tokens
    finally:
        for w in workers:
            w.kill()


# ---------------------------------------------------------------------------- CLI


def test_the_cli_prints_the_tokens_and_writes_them(worker, served_models, tmp_path, capsys):
    from ssmserve.client.cli import main

    sid = worker.client.create_session("lm").session_id
    np.save(tmp_path / "prompt.npy", np.asarray(PROMPT))
    out = tmp_path / "ids.npy"
    prompt = str(tmp_path / "prompt.npy")
    flags = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.02",
             "--seed", "77", "--prompt-ids", prompt, "--output", str(out)]  # fmt: skip
    args = ["--server", worker.address, "generate", sid, "--max-tokens", "12", *flags]
    assert main(args) == 0
    tokens = offline(served_models["lm"], PROMPT, 12)[0]
    printed = capsys.readouterr()
    assert printed.out.split() == [str(t) for t in tokens]
    assert "generated 12 tokens (steps 9..20" in printed.err
    np.testing.assert_array_equal(np.load(out), tokens)
    assert main(["--server", worker.address, "generate", sid, "--max-tokens", "3",
                 "--temperature", "-1"]) == 2  # fmt: skip
    assert "INVALID_ARGUMENT (BAD_SAMPLING): temperature" in capsys.readouterr().err
    assert worker.client.get_session(sid).step == len(PROMPT) + 12
