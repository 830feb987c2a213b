"""Constrained output and text monitors through a real worker: the client-side monitor
(the caller's check, the session's Rollback, the next attempt of the seed), the server's
constraint and text monitor, against an offline reference that draws the same tokens
(``tests/test_constraints.py`` tests the parts below the server)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from ssmserve.client import constraints
from ssmserve.client.monitored import (
    MonitorRejected,
    attempt_seed,
    generate_monitored,
    generate_monitored_sync,
)
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client
from ssmserve.server.engine.loader import load_model
from ssmserve.server.engine.tokenizer import TOKENIZER_FILE, ModelTokenizer
from ssmserve.server.sessions import text_monitor
from ssmserve.server.sessions.constraints import Constraint, GrammarTokenizers
from ssmserve.server.sessions.guided_output import OutputRules, Verdict, prepare_guide
from ssmserve.server.sessions.sampling import draw
from ssmserve.server.sessions.text_monitor import TextMonitor
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import token_config, write_model
from tests.harness import WorkerHarness
from tests.test_constraints import EOS, SCHEMA, VOCAB, train_tokenizer
from tests.test_generate import PARAMS, PROMPT, raw_generate, sampling
from tests.worker_process import WorkerProcess


def offline_monitored(model, prompt, n, check, params=PARAMS, retries_cap=100):
    """The tokens (and retries) a monitor with rollback_tokens 1 keeps: each step drawn
    with the seed of the rejections so far, a rejected draw never applied."""
    p = sampling(**params)
    outs, state = model.run(np.asarray(prompt, np.int64))
    out, step, tokens, retries = outs[-1], len(prompt), [], 0
    while len(tokens) < n:
        d = draw(p, (attempt_seed(p.seed, retries), step), out)
        if not check([*tokens, d.token]):
            retries += 1
            assert retries < retries_cap
            continue
        tokens.append(d.token)
        o, state = model.run(np.array([d.token]), state)
        out, step = o[0], step + 1
    return tokens, retries


def no_multiple_of_3(tokens):
    return tokens[-1].token_id % 3 != 0


def test_the_client_and_server_attempt_seeds_agree():
    for seed in (0, 77, 2**64 - 1):
        for attempt in range(6):
            assert attempt_seed(seed, attempt) == text_monitor.attempt_seed(seed, attempt)


def test_a_client_side_monitor_rolls_back_and_resamples_exactly(worker, served_models):
    c = worker.client
    a, b = (c.create_session("lm").session_id for _ in range(2))
    run = generate_monitored_sync(
        c, a, 40, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )
    ids = [t.token_id for t in run.tokens]
    assert all(i % 3 for i in ids) and len(ids) == 40 and run.retries > 3
    expected, retries = offline_monitored(
        served_models["lm"], PROMPT, 40, lambda ts: ts[-1] % 3 != 0
    )
    assert ids == expected and run.retries == retries
    assert [t.step for t in run.tokens] == list(range(len(PROMPT) + 1, len(PROMPT) + 41))
    np.testing.assert_array_equal(c.history(a, 1).inputs, [*PROMPT, *ids])  # what it holds
    again = generate_monitored_sync(
        c, b, 40, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )
    assert [t.token_id for t in again.tokens] == ids


def test_a_client_side_monitor_rolls_back_several_tokens_and_bounds_its_retries(worker):
    c = worker.client
    sid = c.create_session("lm").session_id

    def no_repeats(tokens):
        return len(tokens) < 2 or tokens[-1].token_id != tokens[-2].token_id

    run = generate_monitored_sync(
        c, sid, 30, no_repeats, rollback_tokens=3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )
    ids = [t.token_id for t in run.tokens]
    assert all(x != y for x, y in itertools.pairwise(ids)) and len(ids) == 30
    np.testing.assert_array_equal(c.history(sid, 1).inputs, [*PROMPT, *ids])
    never = c.create_session("lm").session_id
    with pytest.raises(MonitorRejected, match="3 times, over max_retries 2") as caught:
        generate_monitored_sync(
            c, never, 10, lambda ts: len(ts) < 4, max_retries=2, prompt_ids=PROMPT, **PARAMS
        )
    assert len(caught.value.tokens) == 3
    assert c.get_session(never).step == len(PROMPT) + 3  # left at the last accepted token


def test_the_async_client_side_monitor_gives_the_sync_ones_tokens(worker):
    from ssmserve.client.aio import AsyncClient

    c = worker.client
    a, b = (c.create_session("lm").session_id for _ in range(2))
    sync = generate_monitored_sync(
        c, a, 25, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
    )

    async def body() -> object:
        async with AsyncClient(worker.address) as ac:
            return await generate_monitored(
                ac, b, 25, no_multiple_of_3, max_retries=60, prompt_ids=PROMPT, **PARAMS
            )

    run = asyncio.run(asyncio.wait_for(body(), 60))
    assert [t.token_id for t in run.tokens] == [t.token_id for t in sync.tokens]
    assert run.retries == sync.retries


# ---------------------------------------------------------------------------- the server's


@pytest.fixture(scope="module")
def json_tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def guided_dirs(model_dirs, tmp_path_factory, json_tokenizer) -> dict[str, Path]:
    """ "lm" (no tokenizer) and "jm": a token model of VOCAB rows with the byte-level BPE
    of ``test_constraints`` beside it, its "<eos>" (id 0) the end-of-sequence id."""
    jm = tmp_path_factory.mktemp("guided") / "jm"
    write_model(jm, token_config(vocab_size=VOCAB), seed=11)
    json_tokenizer.save(str(jm / TOKENIZER_FILE))
    (jm / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return {"lm": model_dirs["lm"], "jm": jm}


@pytest.fixture(scope="module")
def jm_model(guided_dirs):
    return load_model(guided_dirs["jm"])


@pytest.fixture
def guided_worker(guided_dirs, redis_url):
    harness = WorkerHarness(guided_dirs, redis_url)
    yield harness
    harness.stop()


def offline_guided(model, tokenizer, prompt, n, rules, params, eos=frozenset({EOS})):
    """The tokens a guided generation keeps, and its retractions (step, retries): each
    drawn from the masked logits with the seed after the rejections so far; a rejected
    one (and those the monitor takes back) undone on the offline state."""
    p = sampling(**params)
    guide = asyncio.run(
        prepare_guide(
            rules, ModelTokenizer(tokenizer, "f"), VOCAB, "jm", p.temperature,
            GrammarTokenizers(),
        )
    )  # fmt: skip
    outs, state = model.run(np.asarray(prompt, np.int64))
    states, step, tokens, retractions = [(outs[-1], state)], len(prompt), [], []
    finish = "length"
    while len(tokens) < n:
        out, state = states[-1]
        z = guide.logits(out, eos)
        d = draw(p, (guide.seed(p.seed), step), z)
        verdict = guide.after(d.token, eos)
        if verdict is Verdict.REJECTED:
            back = guide.retract()
            del tokens[len(tokens) - (back - 1) :]
            del states[len(states) - (back - 1) :]
            step -= back - 1
            retractions.append((step, guide.retries))
            continue
        tokens.append(d.token)
        o, state = model.run(np.array([d.token]), state)
        states.append((o[0], state))
        step += 1
        if d.token in eos:
            finish = "eos"
            break
        if verdict is Verdict.COMPLETE:
            finish = "stop"
            break
    return tokens, retractions, finish


def kept_tokens(responses):
    """The tokens a client keeps from raw responses: a retraction drops those after its
    step received before, then the message's own tokens follow."""
    kept = []
    for r in responses:
        if r.HasField("retracted_after_step"):
            kept = [t for t in kept if t.step <= r.retracted_after_step]
        kept.extend(r.tokens)
    return kept


SCHEMA_TEXT = json.dumps(SCHEMA)
GUIDED_PARAMS = {"temperature": 1.0, "seed": 5}


def test_a_json_schema_constraint_gives_a_valid_document_exactly(
    guided_worker, jm_model, json_tokenizer
):
    c = guided_worker.client
    prompt = json_tokenizer.encode("hello").ids
    rules = OutputRules(constraint=Constraint("json_schema", SCHEMA_TEXT))
    for seed in (5, 6, 7):
        params = {**GUIDED_PARAMS, "seed": seed}
        sid = c.create_session("jm").session_id
        responses = raw_generate(
            guided_worker, session_id=sid, max_tokens=200, prompt_ids=prompt,
            sampling=pb.SamplingParams(**params),
            constraint=pb.Constraint(json_schema=SCHEMA_TEXT),
        )  # fmt: skip
        got = kept_tokens(responses)
        ids = [t.token_id for t in got]
        expected, _, finish = offline_guided(jm_model, json_tokenizer, prompt, 200, rules, params)
        assert ids == expected
        document = json.loads("".join(t.text for t in got))
        assert set(document) == {"a", "ok"} and isinstance(document["ok"], bool)
        reason = {"eos": pb.GenerateResponse.FINISH_EOS, "stop": pb.GenerateResponse.FINISH_STOP}
        assert responses[-1].finish_reason == reason[finish]


def test_regex_and_grammar_constraints_through_the_client_options(guided_worker, json_tokenizer):
    c = guided_worker.client
    prompt = json_tokenizer.encode("hello").ids
    for constraint, pattern in [
        (pb.Constraint(regex=r"(ab|x)+c"), r"(ab|x)+c"),
        (
            pb.Constraint(lark_grammar='start: "[" N ("," N)* "]"\nN: /[0-9]{1,2}/'),
            r"\[\d{1,2}(,\d{1,2})*\]",
        ),
        (pb.Constraint(json_object=True), r"\{.*\}"),
    ]:
        sid = c.create_session("jm").session_id
        responses = raw_generate(
            guided_worker, session_id=sid, max_tokens=300, prompt_ids=prompt,
            sampling=pb.SamplingParams(**GUIDED_PARAMS), constraint=constraint,
        )  # fmt: skip
        text = "".join(t.text for t in kept_tokens(responses))
        assert re.fullmatch(pattern, text, re.DOTALL), text


def test_a_resumed_constrained_generation_gives_the_same_tokens(guided_worker, json_tokenizer):
    """Cut after k tokens and resumed (at_step, generated_before): the matcher rebuilt
    from the session's log draws what the undisturbed call drew."""
    c = guided_worker.client
    prompt = json_tokenizer.encode("hello").ids
    whole_sid, cut_sid = (c.create_session("jm").session_id for _ in range(2))
    fields = {
        "max_tokens": 200,
        "sampling": pb.SamplingParams(**GUIDED_PARAMS),
        "constraint": pb.Constraint(json_schema=SCHEMA_TEXT),
    }
    whole = kept_tokens(
        raw_generate(guided_worker, session_id=whole_sid, prompt_ids=prompt, **fields)
    )
    assert len(whole) > 6
    first = kept_tokens(
        raw_generate(
            guided_worker, session_id=cut_sid, prompt_ids=prompt, **{**fields, "max_tokens": 5}
        )
    )
    rest = kept_tokens(
        raw_generate(
            guided_worker, session_id=cut_sid, at_step=first[-1].step, generated_before=5, **fields
        )
    )
    assert [t.token_id for t in first + rest] == [t.token_id for t in whole]
    assert "".join(t.text for t in first + rest) == "".join(t.text for t in whole)
    # resumed from an earlier step: the tokens past it answered again, checked
    again = kept_tokens(
        raw_generate(
            guided_worker, session_id=cut_sid, at_step=first[1].step, generated_before=2, **fields
        )
    )
    assert [t.token_id for t in again] == [t.token_id for t in whole[2:]]


def test_the_server_monitor_retracts_and_resamples_exactly(guided_worker, jm_model, json_tokenizer):
    c = guided_worker.client
    prompt = json_tokenizer.encode("hello").ids
    regex = r"[^0-9]*"  # no digit (nor an invalid UTF-8 sequence)
    monitor = pb.TextMonitor(regex=regex, rollback_tokens=2, max_retries=64)
    rules = OutputRules(monitor=TextMonitor(Constraint("regex", regex), 2, 64))
    sid = c.create_session("jm").session_id
    responses = raw_generate(
        guided_worker, session_id=sid, max_tokens=16, prompt_ids=prompt,
        sampling=pb.SamplingParams(**GUIDED_PARAMS), monitor=monitor,
    )  # fmt: skip
    expected, retractions, _ = offline_guided(
        jm_model, json_tokenizer, prompt, 16, rules, GUIDED_PARAMS
    )
    got = kept_tokens(responses)
    assert [t.token_id for t in got] == expected and len(expected) == 16
    seen = [
        (r.retracted_after_step, r.monitor_retries)
        for r in responses
        if r.HasField("retracted_after_step")
    ]
    assert seen == retractions and len(seen) > 3
    assert re.fullmatch(regex, "".join(t.text for t in got))
    np.testing.assert_array_equal(c.history(sid, 1).inputs, [*prompt, *expected])
    assert responses[-1].finish_reason == pb.GenerateResponse.FINISH_LENGTH


def test_past_max_retries_the_generation_ends_with_finish_monitor(guided_worker, json_tokenizer):
    c = guided_worker.client
    prompt = json_tokenizer.encode("hello").ids
    sid = c.create_session("jm").session_id
    responses = raw_generate(
        guided_worker, session_id=sid, max_tokens=50, prompt_ids=prompt,
        sampling=pb.SamplingParams(**GUIDED_PARAMS),
        monitor=pb.TextMonitor(regex="q", max_retries=2),
    )  # fmt: skip
    last = responses[-1]
    assert last.finish_reason == pb.GenerateResponse.FINISH_MONITOR
    assert (
        last.stopped.reason == "MONITOR_REJECTED" and "over max_retries 2" in last.stopped.message
    )
    assert kept_tokens(responses) == [] and c.get_session(sid).step == len(prompt)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"constraint": pb.Constraint(regex="a(b")}, "unclosed group"),
        ({"constraint": pb.Constraint(json_schema='{"type": "frob"}')}, "frob"),
        ({"constraint": pb.Constraint(lark_grammar="start: foo")}, "unknown name"),
        ({"constraint": pb.Constraint()}, "empty"),
        ({"monitor": pb.TextMonitor(regex="a", max_retries=1000)}, "max_retries"),
        (
            {"monitor": pb.TextMonitor(regex="a"), "sampling": pb.SamplingParams()},
            "temperature > 0",
        ),
    ],
)
def test_bad_rules_are_invalid_argument_before_anything_is_queued(guided_worker, fields, message):
    c = guided_worker.client
    sid = c.create_session("jm").session_id
    request = {"session_id": sid, "max_tokens": 5, "prompt_ids": [3, 4],
               "sampling": pb.SamplingParams(**GUIDED_PARAMS), **fields}  # fmt: skip
    with pytest.raises(grpc.RpcError) as caught:
        raw_generate(guided_worker, **request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details() and len(caught.value.details()) < 700
    assert c.get_session(sid).step == 0  # nothing fed


def test_a_model_without_tokenizer_refuses_rules(guided_worker):
    sid = guided_worker.client.create_session("lm").session_id
    with pytest.raises(grpc.RpcError) as caught:
        raw_generate(guided_worker, session_id=sid, max_tokens=5, prompt_ids=[1, 2],
                     constraint=pb.Constraint(regex="a+"))  # fmt: skip
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no tokenizer.json" in caught.value.details()


# ---------------------------------------------------------------------------- the client's


def client_kept(tokens):
    """What a caller keeps of the client's tokens: a retraction drops the later ones."""
    kept = []
    for t in tokens:
        if t.retracted_after_step is not None:
            kept = [k for k in kept if k.step <= t.retracted_after_step]
        kept.append(t)
    return kept


MONITOR_REGEX = r"[^0-9]*"  # no digit (nor an invalid UTF-8 sequence)


def test_the_client_takes_a_constraint_and_a_monitor(guided_worker, jm_model, json_tokenizer):
    c = guided_worker.client
    prompt = json_tokenizer.encode("hello").ids
    a, b, m = (c.create_session("jm").session_id for _ in range(3))
    text = c.generate_text(
        a, 200, prompt_ids=prompt, constraint=constraints.json_schema(SCHEMA), **GUIDED_PARAMS
    )
    assert set(json.loads(text)) == {"a", "ok"}
    schema = constraints.json_schema(SCHEMA)
    tokens = list(c.generate(b, 200, prompt_ids=prompt, constraint=schema, **GUIDED_PARAMS))
    assert "".join(t.text for t in tokens) == text and tokens[-1].finish_reason in ("stop", "eos")
    monitor = constraints.text_monitor(regex=MONITOR_REGEX, rollback_tokens=2, max_retries=64)
    got = list(c.generate(m, 16, prompt_ids=prompt, monitor=monitor, **GUIDED_PARAMS))
    rules = OutputRules(monitor=TextMonitor(Constraint("regex", MONITOR_REGEX), 2, 64))
    expected, retractions, _ = offline_guided(
        jm_model, json_tokenizer, prompt, 16, rules, GUIDED_PARAMS
    )
    assert [t.token_id for t in client_kept(got)] == expected
    # several retractions before one token reach the caller as one, at the earliest step
    said = [t.retracted_after_step for t in got if t.retracted_after_step is not None]
    assert set(said) <= {step for step, _ in retractions} and len(said) > 3
    again = c.create_session("jm").session_id
    assert c.generate_text(again, 16, prompt_ids=prompt, monitor=monitor, **GUIDED_PARAMS) == (
        "".join(t.text for t in client_kept(got))
    )
    with pytest.raises(ValueError, match="exactly one"):
        constraints.text_monitor()


@pytest.mark.slow
def test_kill_9_mid_guided_generation_changes_no_token(
    guided_dirs, jm_model, json_tokenizer, redis_url, tmp_path
):
    """A constrained and monitored generation whose owner is killed after 60 tokens goes
    on on the other worker: the matcher rebuilt from the log, the monitor's retries from
    the client, the same tokens as the offline reference."""
    models = {"jm": guided_dirs["jm"]}
    workers = [
        WorkerProcess(models, redis_url, tmp_path / f"w{i}", lease_ttl_s=1.0) for i in range(2)
    ]
    threads = [threading.Thread(target=w.start) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    prompt = json_tokenizer.encode("hello").ids
    n, constraint = 300, r"[a-z ,.]*"
    monitor = constraints.text_monitor(regex=r"[^a]*", rollback_tokens=2, max_retries=64)
    rules = OutputRules(
        Constraint("regex", constraint), TextMonitor(Constraint("regex", r"[^a]*"), 2, 64)
    )
    try:
        assert all(w.alive for w in workers)
        addresses = [w.address for w in workers]
        sid = Client(addresses[0]).create_session("jm", snapshot_every=32).session_id
        expected, retractions, _ = offline_guided(
            jm_model, json_tokenizer, prompt, n, rules, GUIDED_PARAMS, eos=frozenset()
        )
        assert len(retractions) > 3 and len(expected) == n  # the monitor has work to do
        got = []
        policy = RetryPolicy(keepalive_time_s=0.5, keepalive_timeout_s=0.5, call_timeout_s=5.0)
        with Client(addresses, retry=policy) as client:
            for t in client.generate(
                sid, n, prompt_ids=prompt, constraint=constraints.regex(constraint),
                monitor=monitor, ignore_eos=True, **GUIDED_PARAMS,
            ):  # fmt: skip
                got.append(t)
                if len(got) == 60:
                    workers[0].kill()
            info = client.get_session(sid)
        assert info.owner == addresses[1]
        assert [t.token_id for t in client_kept(got)] == expected
        assert info.step == len(prompt) + len(expected)
    finally:
        for w in workers:
            w.kill()


def test_the_cli_generates_constrained_and_monitored_text(
    guided_worker, json_tokenizer, capsys, tmp_path
):
    from ssmserve.client.cli import main

    c = guided_worker.client
    (tmp_path / "schema.json").write_text(SCHEMA_TEXT)
    flags = ["--temperature", "1", "--seed", "5", "--prompt", "hello"]
    sid = c.create_session("jm").session_id
    args = ["--server", guided_worker.address, "generate", sid, "--max-tokens", "200"]
    assert main([*args, *flags, "--json-schema", str(tmp_path / "schema.json")]) == 0
    printed = capsys.readouterr().out
    assert set(json.loads(printed)) == {"a", "ok"}
    reference = c.create_session("jm").session_id
    assert printed == c.generate_text(
        reference, 200, prompt_text="hello", constraint=constraints.json_schema(SCHEMA),
        **GUIDED_PARAMS,
    ) + "\n"  # fmt: skip
    # a monitor: the text printed is the text kept, the ids in --output those kept
    sid = c.create_session("jm").session_id
    out = tmp_path / "ids.npy"
    monitored = ["--monitor-regex", MONITOR_REGEX, "--monitor-rollback", "2",
                 "--monitor-retries", "64", "--output", str(out)]  # fmt: skip
    argv = ["--server", guided_worker.address, "generate", sid, "--max-tokens", "16"]
    assert main([*argv, *flags, *monitored]) == 0
    printed = capsys.readouterr().out
    reference = c.create_session("jm").session_id
    monitor = constraints.text_monitor(regex=MONITOR_REGEX, rollback_tokens=2, max_retries=64)
    kept = client_kept(
        list(c.generate(reference, 16, prompt_text="hello", monitor=monitor, **GUIDED_PARAMS))
    )
    assert printed == "".join(t.text for t in kept) + "\n"
    assert np.load(out).tolist() == [t.token_id for t in kept]
    assert main([*args, *flags, "--regex", "a(b"]) == 2
    assert "unclosed group" in capsys.readouterr().err


def test_a_fork_mid_constrained_generation_goes_on_as_the_source(guided_worker, json_tokenizer):
    """Forked after 5 constrained tokens, the fork goes on (at_step, generated_before and
    the tokens received, generated_ids) as the undisturbed generation."""
    c = guided_worker.client
    prompt = json_tokenizer.encode("hello").ids
    whole_sid, src = (c.create_session("jm").session_id for _ in range(2))
    fields = {
        "max_tokens": 200,
        "sampling": pb.SamplingParams(**GUIDED_PARAMS),
        "constraint": pb.Constraint(json_schema=SCHEMA_TEXT),
    }
    whole = kept_tokens(
        raw_generate(guided_worker, session_id=whole_sid, prompt_ids=prompt, **fields)
    )
    first = kept_tokens(
        raw_generate(
            guided_worker, session_id=src, prompt_ids=prompt, **{**fields, "max_tokens": 5}
        )
    )
    fork = c.fork(src, at_step=first[-1].step).session.session_id
    resume = {"session_id": fork, "at_step": first[-1].step, "generated_before": 5, **fields}
    # the fork's log starts at the fork: without the tokens, the matcher cannot be rebuilt
    refused = raw_generate(guided_worker, **resume)
    assert [r.stopped.reason for r in refused] == ["GENERATE_AT_STEP"]
    ids = [t.token_id for t in first]
    rest = kept_tokens(raw_generate(guided_worker, generated_ids=ids, **resume))
    assert [t.token_id for t in first + rest] == [t.token_id for t in whole]


def test_a_migration_mid_guided_generation_changes_no_token(
    guided_dirs, jm_model, json_tokenizer, redis_url
):
    """The session moves to another worker after 40 constrained and monitored tokens:
    the matcher there is rebuilt from the carried log, the same tokens go on."""
    a, b = WorkerHarness(guided_dirs, redis_url), WorkerHarness(guided_dirs, redis_url)
    try:
        prompt = json_tokenizer.encode("hello").ids
        sid = a.client.create_session("jm", snapshot_every=16).session_id
        n, shape = 200, r"[a-z ,.]*"
        rules = OutputRules(
            Constraint("regex", shape), TextMonitor(Constraint("regex", r"[^a]*"), 2, 64)
        )
        expected, retractions, _ = offline_guided(
            jm_model, json_tokenizer, prompt, n, rules, GUIDED_PARAMS, eos=frozenset()
        )
        assert retractions
        monitor = constraints.text_monitor(regex=r"[^a]*", rollback_tokens=2, max_retries=64)
        got, moved = [], []
        with Client([a.address, b.address]) as client:
            for t in client.generate(
                sid, n, prompt_ids=prompt, constraint=constraints.regex(shape),
                monitor=monitor, ignore_eos=True, **GUIDED_PARAMS,
            ):  # fmt: skip
                got.append(t)
                if len(got) == 40:
                    moved.append(a.client.migrate(sid, b.address))
            assert client.get_session(sid).owner == b.address
        assert len(prompt) < moved[0].step < len(prompt) + n  # it moved mid-generation
        assert [t.token_id for t in client_kept(got)] == expected
    finally:
        a.stop()
        b.stop()
