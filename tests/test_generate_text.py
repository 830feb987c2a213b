"""Text in and out: a model served with a Hugging Face ``tokenizer.json``.

The tokenizer is trained here, offline, with the ``tokenizers`` library: a byte-level BPE
on a few sentences with multi-byte characters ("é", "日本", an emoji), its 37 ids exactly
the token fixture model's vocabulary, so the model can generate any of them (bytes of a
character split over several tokens included). The served "lmt" is the fixture model
"lm" with that tokenizer.json beside its weights: its tokens are "lm"'s.

The reference for every text is the tokenizer's own ``decode`` of the ids: the texts of a
generation joined are ``decode(ids)`` less the U+FFFD at its very end (the bytes of a
character not finished yet), after every token.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ssmserve.client.errors import InvalidArgument
from ssmserve.server.engine.detokenizer import MAX_PENDING, IncrementalDetokenizer
from ssmserve.server.engine.tokenizer import TOKENIZER_FILE, load_tokenizer
from ssmserve.server.errors import ModelFormatError
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.harness import WorkerHarness
from tests.test_generate import PARAMS, offline, raw_generate, stub

VOCAB = 37  # the token fixture model's (tests/conftest.py token_config)
SENTENCES = ["café crème brûlée", "日本 日本語", "hi 🙂 ok 🙂", "hello world, hello café"]
TEXTS = [*SENTENCES, "日本🙂é", "écho, 日本", "🙂🙂 hello"]


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (as GPT-2's and Mamba's GPT-NeoX tokenizer are) of ``VOCAB`` ids:
    the bytes the sentences use, then merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False, initial_alphabet=[])
    tokenizer.train_from_iterator(SENTENCES, trainer)
    assert tokenizer.get_vocab_size() == VOCAB
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer()


def decode(tokenizer: Tokenizer):
    return lambda ids: tokenizer.decode(ids)


def texts_of(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(decode(tokenizer))
    return [d.add(i) for i in ids]


def _byte_of(char: str) -> int:
    """The byte a byte-level alphabet character stands for (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return {chr(v): b for b, v in table.items()}[char]


# ---------------------------------------------------------------------------- detokenizer


def test_texts_round_trip_whole_characters_only(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        parts = texts_of(tokenizer, ids)
        assert "".join(parts) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in p for p in parts), parts
        for char in {c for c in text if len(c.encode()) > 1}:
            assert char in parts or any(char in p for p in parts)  # never in pieces


def test_a_character_split_over_tokens_arrives_whole_with_its_last_byte(tokenizer):
    ids = [_single_byte_ids(tokenizer)[b] for b in "日".encode()]
    assert len(ids) == 3
    assert texts_of(tokenizer, ids) == ["", "", "日"]
    emoji = [_single_byte_ids(tokenizer)[b] for b in "🙂".encode()]
    assert texts_of(tokenizer, emoji) == ["", "", "", "🙂"]
    # whole characters before an unfinished one go at once: "a" does not wait for "日"
    hello = tokenizer.token_to_id("hel")
    assert texts_of(tokenizer, [hello, *ids]) == ["hel", "", "", "日"]
    # a token that finishes one character and starts the next
    caf, e_acute = tokenizer.token_to_id("caf"), tokenizer.token_to_id("Ã©")
    assert texts_of(tokenizer, [caf, e_acute, *ids[:2], ids[2]]) == ["caf", "é", "", "", "日"]


def test_after_every_token_the_text_is_the_decode_less_its_unfinished_end(tokenizer):
    """Random id sequences (invalid UTF-8 included, as a random model draws them)."""
    rng = random.Random(5)
    for _ in range(400):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))]
        d, sent = IncrementalDetokenizer(decode(tokenizer)), ""
        for k, i in enumerate(ids):
            sent += d.add(i)
            assert sent == tokenizer.decode(ids[: k + 1]).rstrip("\ufffd"), ids[: k + 1]


def test_a_rebuilt_detokenizer_sends_the_same_texts(tokenizer):
    rng = random.Random(6)
    for _ in range(100):
        ids = [rng.randrange(VOCAB) for _ in range(50)]
        whole = texts_of(tokenizer, ids)
        for cut in (1, 7, 23, 49):
            d = IncrementalDetokenizer(decode(tokenizer))
            d.skip(ids[:cut])
            assert [d.add(i) for i in ids[cut:]] == whole[cut:]


def test_a_window_that_never_ends_whole_moves_on(tokenizer):
    """Only invalid bytes stay unfinished that long: they go as U+FFFD, bounded work."""
    lead = _single_byte_ids(tokenizer)[0xE6]  # a lead byte with no continuation
    d = IncrementalDetokenizer(decode(tokenizer))
    parts = [d.add(lead) for _ in range(MAX_PENDING)]
    assert parts[:-1] == [""] * (MAX_PENDING - 1)
    assert parts[-1] == "\ufffd" * MAX_PENDING
    assert len(d.ids) - d._read == 0  # the window restarted


def _single_byte_ids(tokenizer: Tokenizer) -> dict[int, int]:
    return {_byte_of(token): i for token, i in tokenizer.get_vocab().items() if len(token) == 1}


# ---------------------------------------------------------------------------- loading


def test_a_model_directory_without_tokenizer_json_has_no_text(tmp_path, tokenizer):
    assert load_tokenizer(tmp_path, VOCAB) is None
    tokenizer.save(str(tmp_path / TOKENIZER_FILE))
    loaded = load_tokenizer(tmp_path, VOCAB)
    assert loaded is not None
    assert loaded.encode("日本").tolist() == tokenizer.encode("日本").ids
    assert len(loaded.fingerprint) == 64
    with pytest.raises(ModelFormatError, match="token id 36, outside the model's 20"):
        load_tokenizer(tmp_path, 20)
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps({"model": "nonsense"}))
    with pytest.raises(ModelFormatError, match="cannot be read as a Hugging Face tokenizer"):
        load_tokenizer(tmp_path, VOCAB)


# ---------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def text_dirs(model_dirs: dict[str, Path], tmp_path_factory, tokenizer) -> dict[str, Path]:
    """ "lm" as it is, and "lmt": the same files with the tokenizer.json beside them."""
    lmt = tmp_path_factory.mktemp("text-model") / "lmt"
    shutil.copytree(model_dirs["lm"], lmt)
    tokenizer.save(str(lmt / TOKENIZER_FILE))
    return {"lm": model_dirs["lm"], "lmt": lmt}


@pytest.fixture
def text_worker(text_dirs, redis_url):
    harness = WorkerHarness(text_dirs, redis_url)
    yield harness
    harness.stop()


def test_prompt_text_is_the_prompt_ids_and_each_token_carries_its_text(
    text_worker, served_models, tokenizer
):
    c = text_worker.client
    prompt = "hello café 日本"
    ids = tokenizer.encode(prompt).ids
    a, b = (c.create_session("lmt").session_id for _ in range(2))
    by_text = list(c.generate(a, 60, prompt_text=prompt, at_step=0, **PARAMS))
    by_ids = list(c.generate(b, 60, prompt_ids=ids, **PARAMS))
    tokens = [t.token_id for t in by_text]
    assert tokens == [t.token_id for t in by_ids] == offline(served_models["lm"], ids, 60)[0]
    assert [t.text for t in by_text] == [t.text for t in by_ids] == texts_of(tokenizer, tokens)
    assert "".join(t.text for t in by_text) == tokenizer.decode(tokens).rstrip("\ufffd")
    assert any(len(t.text.encode()) > 1 for t in by_text)  # it drew whole multi-byte chars
    np.testing.assert_array_equal(c.history(a, 1).inputs[: len(ids)], ids)
    assert by_text[0].step == len(ids) + 1
    other = c.create_session("lmt").session_id
    assert c.generate_text(other, 60, prompt_text=prompt, **PARAMS) == "".join(
        t.text for t in by_text
    )
    # the model's tokenizer is named where its models are listed
    listed = {m.key: m.tokenizer_fingerprint for m in c.list_models().models}
    assert listed["lm"] == "" and len(listed["lmt"]) == 64


def test_a_resumed_generation_sends_the_texts_the_undisturbed_one_would(text_worker, tokenizer):
    """A retry from the last token received (at_step, generated_before) is answered the
    tokens past it from the log, then generates on: its texts are the undisturbed call's,
    the detokenizer rebuilt from the session's log. The cut is where a fresh one would
    send other texts (inside a character's bytes, or before a held U+FFFD)."""
    c = text_worker.client
    sid = c.create_session("lmt", snapshot_every=16, max_snapshots=16).session_id
    whole = list(c.generate(sid, 80, prompt_text="日本 hello", **PARAMS))
    tokens, texts = [t.token_id for t in whole], [t.text for t in whole]
    start = whole[0].step - 1
    cuts = [k for k in range(1, 60) if texts_of(tokenizer, tokens[k:]) != texts[k:]]
    assert cuts, "the generation has no cut a fresh detokenizer would get wrong"
    cut = cuts[0]
    replies = raw_generate(
        text_worker, session_id=sid, at_step=start + cut, max_tokens=80,
        sampling=pb.SamplingParams(**PARAMS), generated_before=cut,
    )  # fmt: skip
    again = [t for r in replies for t in r.tokens]
    assert [t.token_id for t in again] == tokens[cut:], replies
    assert [t.text for t in again] == texts[cut:]
    assert "".join(texts[:cut]) + "".join(t.text for t in again) == "".join(texts)
    assert replies[-1].finish_reason == pb.GenerateResponse.FINISH_LENGTH


def test_a_model_without_tokenizer_refuses_prompt_text_and_sends_no_text(text_worker):
    c = text_worker.client
    sid = c.create_session("lm").session_id
    with pytest.raises(InvalidArgument, match=r"has no tokenizer\.json"):
        next(c.generate(sid, 5, prompt_text="hello", **PARAMS))
    assert c.get_session(sid).step == 0
    with pytest.raises(grpc.RpcError) as raised:
        raw_generate(
            text_worker, session_id=sid, max_tokens=5, prompt_text="hi", prompt_ids=[1, 2],
            sampling=pb.SamplingParams(**PARAMS),
        )  # fmt: skip
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not both" in raised.value.details()
    got = list(c.generate(sid, 10, prompt_ids=[1, 2, 3], **PARAMS))
    assert len(got) == 10 and all(t.text == "" for t in got)


def test_the_cli_prints_the_text_as_it_streams(text_worker, tokenizer, capsys, tmp_path):
    from ssmserve.client.cli import main

    c = text_worker.client
    sid = c.create_session("lmt").session_id
    flags = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.02",
             "--seed", "77"]  # fmt: skip
    args = ["--server", text_worker.address, "generate", sid, "--max-tokens", "30"]
    assert main([*args, "--prompt", "日本 hello", *flags]) == 0
    printed = capsys.readouterr()
    reference = c.create_session("lmt").session_id
    text = c.generate_text(reference, 30, prompt_text="日本 hello", **PARAMS)
    assert printed.out == text + "\n"
    assert "generated 30 tokens" in printed.err
    # generating on (no prompt): text still, the model has a tokenizer
    assert main([*args, *flags]) == 0
    assert capsys.readouterr().out == c.generate_text(reference, 30, **PARAMS) + "\n"
    plain = c.create_session("lm").session_id
    assert main(["--server", text_worker.address, "generate", plain, "--max-tokens", "3",
                 "--prompt", "hi"]) == 2  # fmt: skip
    assert "no tokenizer.json" in capsys.readouterr().err
    np.save(tmp_path / "ids.npy", np.asarray([1, 2]))
    both = ["--prompt", "hi", "--prompt-ids", str(tmp_path / "ids.npy")]
    assert main([*args, *both]) == 2
    assert "give --prompt-ids or --prompt, not both" in capsys.readouterr().err


def test_a_long_prompt_reports_its_progress_and_a_cut_call_resumes_from_it(
    text_worker, served_models, tokenizer
):
    """A prompt of more than one run (512 ids) sends a message per run fed, so a client's
    stall bound sees progress; a call cut after one resumes from its step with the ids
    left (a prompt_text's, as the worker encoded them) and gives the undisturbed tokens."""
    c = text_worker.client
    text = " ".join(TEXTS * 12)
    ids = tokenizer.encode(text).ids
    assert 1100 < len(ids) < 1536, len(ids)
    whole_id = c.create_session("lmt").session_id
    replies = raw_generate(
        text_worker, session_id=whole_id, at_step=0, prompt_text=text, max_tokens=20,
        sampling=pb.SamplingParams(**PARAMS),
    )  # fmt: skip
    fed = [r for r in replies if r.HasField("prompt_fed_step")]
    assert [r.prompt_fed_step for r in fed] == [512, 1024]
    assert list(fed[0].prompt_ids_left) == ids[512:] and not fed[1].prompt_ids_left
    tokens = [t.token_id for r in replies for t in r.tokens]
    assert tokens == offline(served_models["lm"], ids, 20)[0]

    cut_id = c.create_session("lmt").session_id
    call = stub(text_worker).Generate(
        pb.GenerateRequest(
            session_id=cut_id, at_step=0, prompt_text=text, max_tokens=20,
            sampling=pb.SamplingParams(**PARAMS),
        ),
        timeout=30,
    )  # fmt: skip
    first = next(r for r in call if r.HasField("prompt_fed_step"))
    call.cancel()
    again = raw_generate(
        text_worker, session_id=cut_id, at_step=first.prompt_fed_step,
        prompt_ids=list(first.prompt_ids_left), max_tokens=20,
        sampling=pb.SamplingParams(**PARAMS),
    )  # fmt: skip
    assert [t.token_id for r in again for t in r.tokens] == tokens
    # the client reads the progress messages on its way (a text becomes the worker's ids)
    by_client = c.generate(c.create_session("lmt").session_id, 20, prompt_text=text, **PARAMS)
    assert [t.token_id for t in by_client] == tokens
