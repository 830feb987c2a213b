"""Generate's stop rules end to end: the model's end-of-sequence ids, stop strings matched
across token boundaries with the text that may begin one held back, and finish reasons.

The served models are the token fixture model "lm" (no tokenizer) and "lme": the same
weights with the byte-level BPE tokenizer of ``test_generate_text`` and a
``generation_config.json`` naming an end-of-sequence id the seeded generation draws. The
reference is the undisturbed generation with ``ignore_eos`` and no stop strings (itself
checked against the offline engine in ``test_generate``): a stop rule only cuts it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from ssmserve.client.errors import InvalidArgument
from ssmserve.server.engine.tokenizer import TOKENIZER_FILE, read_eos_ids
from ssmserve.server.errors import ModelFormatError
from ssmserve.server.sessions.stopping import StopStrings
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.harness import WorkerHarness
from tests.test_generate import PARAMS, PROMPT, offline, raw_generate
from tests.test_generate_text import train_tokenizer
from tests.test_service import stub


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot():
    stops = StopStrings(("abc", "xyz"))
    assert stops.push("hello a").text == "hello "  # "a" may begin "abc"
    assert stops.push("b").text == ""  # "ab" still may
    released = stops.push("d more")
    assert (released.text, released.stop_string) == ("abd more", "")
    released = stops.push("zz xy")
    assert released.text == "zz " and stops.held == "xy"
    released = stops.push("zq")
    assert (released.text, released.stop_string) == ("", "xyz")  # the match ends it
    assert StopStrings(("lo",)).push("hello").text == "hel"


def test_the_earliest_match_wins_and_at_one_place_the_first_listed():
    assert StopStrings(("c", "ab")).push("xabc").stop_string == "ab"
    assert StopStrings(("ab", "abc")).push("xabc").stop_string == "ab"
    released = StopStrings(("abc", "ab")).push("xabc")
    assert (released.text, released.stop_string) == ("x", "abc")


def test_eos_ids_come_from_generation_config_then_config_json(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert read_eos_ids(tmp_path, 37) == (3,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 4, 9]}))
    assert read_eos_ids(tmp_path, 37) == (4, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 40}))
    with pytest.raises(ModelFormatError, match="eos_token_id"):
        read_eos_ids(tmp_path, 37)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert read_eos_ids(tmp_path, 37) == (3,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    assert read_eos_ids(tmp_path, 37) == ()


# ------------------------------------------------------------------------------ served


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def reference(served_models):
    """The undisturbed generation's tokens (60 of them from PROMPT with PARAMS)."""
    return offline(served_models["lm"], PROMPT, 60)[0]


@pytest.fixture(scope="module")
def eos_at(reference) -> int:
    """The index of the generation's token that is the end-of-sequence id: the first
    from the 10th on that was not drawn before."""
    return next(k for k in range(10, 60) if reference[k] not in reference[:k])


@pytest.fixture(scope="module")
def eos_id(reference, eos_at) -> int:
    return reference[eos_at]


@pytest.fixture(scope="module")
def stop_dirs(model_dirs, tmp_path_factory, tokenizer, eos_id) -> dict[str, Path]:
    lme = tmp_path_factory.mktemp("eos-model") / "lme"
    shutil.copytree(model_dirs["lm"], lme)
    tokenizer.save(str(lme / TOKENIZER_FILE))
    (lme / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return {"lm": model_dirs["lm"], "lme": lme}


@pytest.fixture
def stop_worker(stop_dirs, redis_url):
    harness = WorkerHarness(stop_dirs, redis_url)
    yield harness
    harness.stop()


def call(worker, sid, max_tokens=60, **fields):
    """The responses of one raw Generate call from the session's step."""
    return raw_generate(
        worker, session_id=sid, max_tokens=max_tokens, sampling=pb.SamplingParams(**PARAMS),
        **fields,
    )  # fmt: skip


def tokens_of(replies):
    return [t for r in replies for t in r.tokens]


def test_generation_stops_on_the_models_eos_unless_told_to_ignore_it(
    stop_worker, reference, eos_id, eos_at, tokenizer
):
    c = stop_worker.client
    listed = {m.key: m for m in c.list_models().models}
    assert list(listed["lme"].eos_token_ids) == [eos_id] and listed["lme"].has_tokenizer
    assert list(listed["lm"].eos_token_ids) == [] and not listed["lm"].has_tokenizer
    sid = c.create_session("lme").session_id
    replies = call(stop_worker, sid, prompt_ids=PROMPT)
    got = tokens_of(replies)
    assert [t.token_id for t in got] == reference[: eos_at + 1]
    assert replies[-1].finish_reason == pb.GenerateResponse.FINISH_EOS
    assert got[-1].text == ""  # the EOS token has no text of its own
    assert "".join(t.text for t in got) == tokenizer.decode(reference[:eos_at]).rstrip("\ufffd")
    assert c.get_session(sid).step == len(PROMPT) + eos_at + 1
    # a retry from the EOS token (its finish was cut off) ends there, generating nothing
    end = len(PROMPT) + eos_at + 1
    again = call(stop_worker, sid, at_step=end, generated_before=eos_at + 1)
    assert not tokens_of(again) and again[-1].finish_reason == pb.GenerateResponse.FINISH_EOS
    assert c.get_session(sid).step == end
    other = c.create_session("lme").session_id
    replies = call(stop_worker, other, prompt_ids=PROMPT, ignore_eos=True)
    assert [t.token_id for t in tokens_of(replies)] == reference
    assert replies[-1].finish_reason == pb.GenerateResponse.FINISH_LENGTH


def _stop_string(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A stop string that spans a token boundary of the generation's text, and the index
    of the token whose text completes it (its first occurrence)."""
    texts, ids = [], []
    for k, token in enumerate(tokens):
        ids.append(token)
        texts.append(tokenizer.decode(ids).rstrip("\ufffd"))
        whole = texts[-1]
        if k >= 3 and len(whole) >= len(texts[k - 1]) + 1 and len(texts[k - 1]) >= 3:
            candidate = whole[len(texts[k - 1]) - 2 : len(texts[k - 1]) + 1]
            if whole.find(candidate) == len(texts[k - 1]) - 2 and candidate.strip():
                return candidate, k
    raise AssertionError("no stop string spans a token boundary in this generation")


def test_a_stop_string_ends_the_generation_without_being_sent(
    stop_worker, reference, tokenizer, eos_at
):
    c = stop_worker.client
    stop, k = _stop_string(tokenizer, reference[:eos_at])
    sid = c.create_session("lme").session_id
    replies = call(stop_worker, sid, prompt_ids=PROMPT, stop=["never there", stop])
    got = tokens_of(replies)
    assert [t.token_id for t in got] == reference[: k + 1]
    whole = tokenizer.decode(reference[: k + 1])
    assert "".join(t.text for t in got) == whole[: whole.find(stop)]
    assert replies[-1].finish_reason == pb.GenerateResponse.FINISH_STOP
    assert replies[-1].stop_string == stop
    assert c.get_session(sid).step == got[-1].step
    # a text that holds back: some token's text is released by a later one
    held = [i for i, t in enumerate(got[:-1]) if t.text != _fresh_text(tokenizer, reference, i)]
    assert held, "no token's text was held back: the stop string does not test holding"


def _fresh_text(tokenizer, tokens, i):
    return tokenizer.decode(tokens[: i + 1]).rstrip("\ufffd")[
        len(tokenizer.decode(tokens[:i]).rstrip("\ufffd")) :
    ]


def test_a_resumed_call_sends_the_texts_the_undisturbed_one_would(
    stop_worker, reference, tokenizer, eos_at
):
    """Cut after every token: the retry (at_step, generated_before) rebuilds the held-back
    text from the session's log and sends the same texts, ending at the same match."""
    c = stop_worker.client
    stop, k = _stop_string(tokenizer, reference[:eos_at])
    sid = c.create_session("lme", snapshot_every=4).session_id
    whole = call(stop_worker, sid, prompt_ids=PROMPT, stop=[stop])
    texts = [t.text for t in tokens_of(whole)]
    start = len(PROMPT)
    for cut in range(1, k + 1):
        assert c.rollback(sid, to_step=start + k + 1).step == start + k + 1
        replies = call(stop_worker, sid, at_step=start + cut, generated_before=cut, stop=[stop])
        again = tokens_of(replies)
        assert [t.token_id for t in again] == reference[cut : k + 1]
        assert [t.text for t in again] == texts[cut:], cut
        assert replies[-1].stop_string == stop
    # a retry from the token that completed the match ends there
    replies = call(stop_worker, sid, at_step=start + k + 1, generated_before=k + 1, stop=[stop])
    assert not tokens_of(replies) and replies[-1].stop_string == stop
    assert c.get_session(sid).step == start + k + 1
    # and the session rolled back into the generation goes on to the same end
    assert c.rollback(sid, to_step=start + 2).step == start + 2
    replies = call(stop_worker, sid, at_step=start + 2, generated_before=2, stop=[stop])
    assert [t.text for t in tokens_of(replies)] == texts[2:]


def test_length_releases_the_held_text_with_the_last_token(
    stop_worker, reference, tokenizer, eos_at
):
    c = stop_worker.client
    stop, k = _stop_string(tokenizer, reference[:eos_at])
    sid = c.create_session("lme").session_id
    replies = call(stop_worker, sid, max_tokens=k, prompt_ids=PROMPT, stop=[stop])
    got = tokens_of(replies)
    assert replies[-1].finish_reason == pb.GenerateResponse.FINISH_LENGTH
    assert "".join(t.text for t in got) == tokenizer.decode(reference[:k]).rstrip("\ufffd")


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"stop": ["x"] * 17}, "at most 16 stop strings"),
        ({"stop": [""]}, "1..256 characters"),
        ({"stop": ["x" * 257]}, "1..256 characters"),
        ({"top_logprobs": 21}, "top_logprobs must be in 0..20"),
    ],
)
def test_bad_stop_rules_are_invalid_argument(stop_worker, fields, what):
    sid = stop_worker.client.create_session("lme").session_id
    with pytest.raises(grpc.RpcError) as raised:
        call(stop_worker, sid, prompt_ids=PROMPT, **fields)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert what in raised.value.details()
    assert stop_worker.client.get_session(sid).step == 0


def test_a_model_without_tokenizer_refuses_stop_strings(stop_worker):
    c = stop_worker.client
    sid = c.create_session("lm").session_id
    with pytest.raises(InvalidArgument, match="stop strings"):
        next(c.generate(sid, 5, prompt_ids=PROMPT, stop=["a"], **PARAMS))
    assert c.get_session(sid).step == 0


def test_the_cli_takes_stop_texts_penalties_and_prints_logprobs_and_the_end(
    stop_worker, reference, tokenizer, eos_id, eos_at, capsys, tmp_path
):
    import numpy as np

    from ssmserve.client.cli import main

    c = stop_worker.client
    stop, k = _stop_string(tokenizer, reference[:eos_at])
    np.save(tmp_path / "prompt.npy", np.asarray(PROMPT))
    sid = c.create_session("lme").session_id
    flags = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.02",
             "--seed", "77"]  # fmt: skip
    args = ["--server", stop_worker.address, "generate", sid, "--max-tokens", "60",
            "--prompt-ids", str(tmp_path / "prompt.npy"), *flags]  # fmt: skip
    assert main([*args, "--stop-text", stop, "--logprobs", "2"]) == 0
    printed = capsys.readouterr()
    whole = tokenizer.decode(reference[: k + 1])
    assert printed.out == whole[: whole.find(stop)] + "\n"
    assert f"finished: stop {stop!r}" in printed.err
    lines = [line for line in printed.err.splitlines() if " logprob " in line]
    assert len(lines) == k + 1 and all(line.count(":") >= 3 for line in lines)
    # penalties and --ignore-eos reach the worker: the same tokens as the client's
    other = c.create_session("lme").session_id
    options = {"repetition_penalty": 1.5, "penalty_last_n": 8, "logit_bias": {3: -2.0}}
    expected = c.generate_text(other, 20, prompt_ids=PROMPT, ignore_eos=True, **PARAMS,
                               **options)  # fmt: skip
    third = c.create_session("lme").session_id
    args[3] = third
    args[5] = "20"
    assert main([*args, "--ignore-eos", "--repetition-penalty", "1.5", "--penalty-last-n",
                 "8", "--logit-bias", "3=-2"]) == 0  # fmt: skip
    assert capsys.readouterr().out == expected + "\n"
    assert main(["--server", stop_worker.address, "models"]) == 0
    listed = capsys.readouterr().out
    assert f"tokenizer yes\teos {eos_id}" in listed and "tokenizer no\teos none" in listed


def test_a_generation_the_worker_hands_off_ends_cancelled_saying_where_to_go_on(start_worker):
    """A migration mid-generation: the raw call's last message is FINISH_CANCELLED with the
    step error that names the new owner (the Python client follows it)."""
    a, b = start_worker(), start_worker()
    sid = a.client.create_session("lm").session_id
    call = stub(a).Generate(
        pb.GenerateRequest(session_id=sid, max_tokens=3000, prompt_ids=PROMPT,
                           sampling=pb.SamplingParams(**PARAMS)),
        timeout=30,
    )  # fmt: skip
    replies = []
    for reply in call:
        replies.append(reply)
        if len(tokens_of(replies)) == 20:
            a.client.migrate(sid, b.address)
    last = replies[-1]
    assert last.finish_reason == pb.GenerateResponse.FINISH_CANCELLED, last
    assert b.address in last.stopped.message or last.stopped.owner == b.address
    assert last.session_step == tokens_of(replies)[-1].step


def test_the_go_on_command_of_a_cut_generation_keeps_the_stop_rules_and_penalties():
    import argparse

    from ssmserve.client import cli_sampling

    parser = argparse.ArgumentParser()
    cli_sampling.add_flags(parser)
    given = ["--stop-text", "a b", "--stop-text", "\n", "--ignore-eos", "--presence-penalty",
             "0.5", "--penalty-last-n", "0", "--logit-bias", "3=-2", "--logprobs", "2"]  # fmt: skip
    args = parser.parse_args(given)
    again = parser.parse_args(cli_sampling.go_on_flags(args))
    assert again == args and cli_sampling.options(again) == cli_sampling.options(args)
    assert cli_sampling.go_on_flags(parser.parse_args([])) == []


def test_a_ggufs_eos_id_is_its_tokenizer_ggml_eos_token_id():
    """The converted fixtures store the tokenizer's EOS (id 0, GPT-NeoX's <|endoftext|>)."""
    import gguf

    data = Path(__file__).parent / "data" / "gguf"
    for name in ("mamba1-f32.gguf", "mamba2-q8_0.gguf"):
        field = gguf.GGUFReader(data / name).fields["tokenizer.ggml.eos_token_id"]
        assert read_eos_ids(data / name, 384) == (int(field.contents()),) == (0,)
