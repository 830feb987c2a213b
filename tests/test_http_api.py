"""The OpenAI-compatible HTTP door, with the ``openai`` package as the client.

A real worker serves ``--http`` on a free loopback port beside its gRPC listener; the
reference for what the door answers is the same worker's gRPC Generate (the real client)
on a fresh session: the door must drive exactly that path. The served "chat" model has a
tokenizer and a chat template (``tests/http_models.py``), "plain" the same tokenizer
without a template, "lm" neither.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from ssmserve.server.http.listener import HttpListenError, HttpSettings
from ssmserve.server.main import build_parser, settings_from_args
from ssmserve.server.sessions import generation as generation_module
from ssmserve.server.sessions.config import SessionDefaults
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.server.worker import (
    ExposedWithoutAuthError,
    Worker,
    WorkerSettings,
    check_exposure,
)
from tests.conftest import make_token
from tests.harness import WorkerHarness
from tests.http_models import write_chat_model

SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def http_dirs(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> Any:
    root = tmp_path_factory.mktemp("http-models")
    tokenizer = write_chat_model(root / "chat")
    write_chat_model(root / "plain", template=False)
    return {"chat": root / "chat", "plain": root / "plain", "lm": model_dirs["lm"]}, tokenizer


@pytest.fixture(scope="module")
def door(http_dirs: Any, redis_server: Any) -> Any:
    dirs, _ = http_dirs
    settings = HttpSettings(listen="127.0.0.1:0", max_body_bytes=64 << 10)
    harness = WorkerHarness(dirs, redis_server.url, http=settings)
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def tokenizer(http_dirs: Any) -> Any:
    return http_dirs[1]


def client_of(harness: WorkerHarness, token: str = "unused") -> openai.OpenAI:
    address = harness.worker.http_door.address
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key=token, max_retries=0, timeout=60)


def counts(harness: WorkerHarness) -> Any:
    return harness.worker.http_door.runs.cache.counts


def forget_kept(harness: WorkerHarness) -> None:
    """Close every kept session: the next request prefills afresh."""
    harness.call(harness.worker.http_door.runs.forget())


def kept_histories(harness: WorkerHarness) -> list[list[int]]:
    cache = harness.worker.http_door.runs.cache
    return [k.history.tolist() for kept in cache._kept.values() for k in kept.values()]


def f32(values: list[float]) -> list[float]:
    return np.asarray(values, np.float32).tolist()


# ---------------------------------------------------------------------------- answers


def test_models_lists_the_token_models(door):
    listed = client_of(door).models.list()
    assert sorted(m.id for m in listed.data) == ["chat", "lm", "plain"]
    assert all(m.owned_by == "ssmserve" and m.object == "model" for m in listed.data)


def test_a_completion_is_generate_on_a_new_session(door, tokenizer):
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 5}
    answer = client_of(door).completions.create(
        model="chat",
        prompt="hello world, how are",
        max_tokens=12,
        logprobs=3,
        extra_body={"ignore_eos": True, "top_k": 40, "min_p": 0.01},
        **params,
    )
    session = door.client.create_session("chat").session_id
    reference = list(
        door.client.generate(
            session, 12, prompt_text="hello world, how are", ignore_eos=True, top_k=40,
            min_p=0.01, logprobs=True, top_logprobs=3, **params,
        )
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.text == "".join(t.text for t in reference)
    assert choice.finish_reason == "length"
    assert f32(choice.logprobs.token_logprobs) == f32([t.unfiltered_logprob for t in reference])
    tops = [sorted(top.values(), reverse=True) for top in choice.logprobs.top_logprobs]
    assert [f32(t) for t in tops] == [
        f32(sorted({tokenizer.decode([x.token_id]): x.logprob for x in t.top_logprobs}.values(),
                   reverse=True))
        for t in reference
    ]  # fmt: skip
    prompt_ids = tokenizer.encode("hello world, how are").ids
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.completion_tokens == 12 and answer.usage.total_tokens == 12 + len(
        prompt_ids
    )


def test_the_same_seed_gives_the_same_text(door):
    c = client_of(door)

    def text(seed: int) -> str:
        r = c.completions.create(
            model="chat", prompt="the quick brown", max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.choices[0].text

    assert text(11) == text(11)
    assert text(11) != text(12)


def test_streams_carry_the_same_text_and_end_with_the_reason(door):
    c = client_of(door)
    common: dict[str, Any] = {"max_tokens": 10, "temperature": 0.7, "seed": 21}
    common["extra_body"] = {"ignore_eos": True}
    whole = c.completions.create(model="chat", prompt="state space", **common)
    chunks = list(
        c.completions.create(
            model="chat", prompt="state space", stream=True,
            stream_options={"include_usage": True}, **common,
        )
    )  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices

    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    reply = c.chat.completions.create(model="chat", messages=messages, **common)
    events = list(c.chat.completions.create(model="chat", messages=messages, stream=True, **common))
    assert events[0].choices[0].delta.role == "assistant"
    streamed = "".join(e.choices[0].delta.content or "" for e in events)
    assert streamed == reply.choices[0].message.content
    assert events[-1].choices[0].finish_reason == reply.choices[0].finish_reason == "length"


def test_max_tokens_and_stop_strings_end_the_text(door):
    c = client_of(door)
    common: dict[str, Any] = {"model": "chat", "prompt": "a Mamba state", "temperature": 0.8}
    common.update(seed=4, extra_body={"ignore_eos": True})
    full = c.completions.create(max_tokens=24, **common).choices[0].text
    short = c.completions.create(max_tokens=3, **common)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    at = next(i for i in range(1, len(full) - 1) if full[i : i + 2].isascii())
    stop = full[at : at + 2]
    at = full.find(stop)
    assert at > 0, full
    stopped = c.completions.create(max_tokens=24, stop=[stop, "never-there"], **common)
    assert stopped.choices[0].text == full[:at]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = c.completions.create(max_tokens=24, stop=stop, stream=True, **common)
    assert "".join(ch.choices[0].text for ch in streamed) == full[:at]


def test_chat_logprobs_carry_the_top_alternatives(door):
    reply = client_of(door).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=2,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-12
        assert bytes(entry.bytes).decode() == entry.token


def test_chat_renders_the_models_template(door, tokenizer):
    messages = [SYSTEM, {"role": "user", "content": "hello there"}]
    reply = client_of(door).chat.completions.create(
        model="chat", messages=messages, max_tokens=8, temperature=0.6, seed=8,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "<s><|system|>\nYou are terse.</s>\n<|user|>\nhello there</s>\n<|assistant|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    session = door.client.create_session("chat").session_id
    reference = door.client.generate(
        session, 8, prompt_ids=ids, temperature=0.6, seed=8, ignore_eos=True
    )
    assert reply.choices[0].message.content == "".join(t.text for t in reference)
    assert reply.usage.prompt_tokens == len(ids)
    # the template's own refusal (raise_exception) is a 400 that says what it said
    with pytest.raises(openai.BadRequestError, match="roles must be system, user or assistant"):
        client_of(door).chat.completions.create(
            model="chat", messages=[{"role": "robot", "content": "beep"}], max_tokens=2
        )


def test_chat_needs_a_chat_template(door):
    for model in ("plain", "lm"):
        with pytest.raises(openai.BadRequestError, match="has no chat template") as caught:
            client_of(door).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert caught.value.code == "no_chat_template"


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"n": 2}, "n"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"oops": 1}}, "logit_bias"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [5, 999]}, "prompt"),
        ({"prompt": [5, 2**63]}, "prompt"),  # past int64: a 400, not an overflow
        ({"prompt": [[5, 2**64]]}, "prompt"),
        ({"prompt": [-(2**63) - 1]}, "prompt"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"logprobs": 9}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
        ),
        ({"prompt": None}, "prompt"),
    ],
)
def test_bad_requests_are_400_naming_the_field(door, request_body, param):
    before = len(door.manager.resident_ids())
    with pytest.raises(openai.BadRequestError) as caught:
        client_of(door).completions.create(
            model="chat", prompt="hello", max_tokens=4, extra_body=request_body
        )
    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error" and caught.value.message
    assert len(door.manager.resident_ids()) == before  # no session was made


def test_a_repetition_penalty_of_0_is_off(door):
    """As over gRPC (its proto's zero default): 0 is 1, no penalty."""
    ask: dict[str, Any] = {"model": "chat", "prompt": "the quick brown", "max_tokens": 12}
    ask.update(seed=6, temperature=0.9)
    texts = [
        client_of(door)
        .completions.create(extra_body={"ignore_eos": True, "repetition_penalty": penalty}, **ask)
        .choices[0]
        .text
        for penalty in (0, 1)
    ]
    assert texts[0] == texts[1]


def test_an_unknown_model_is_404(door):
    with pytest.raises(openai.NotFoundError) as caught:
        client_of(door).completions.create(model="nope", prompt="x", max_tokens=2)
    assert caught.value.code == "model_not_found" and "not served here" in caught.value.message


def _post(harness: WorkerHarness, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
    address = harness.worker.http_door.address
    request = urllib.request.Request(
        f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_body_past_the_limit_or_not_json_is_refused(door):
    prompt = "x" * (70 << 10)
    status, body = _post(
        door, "/v1/completions", json.dumps({"model": "chat", "prompt": prompt}).encode()
    )
    assert status == 413 and "limit of 65536 bytes" in body["error"]["message"]
    status, body = _post(door, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(door, "/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------------------- prefix cache


def _completion(c: openai.OpenAI, prompt: list[int], seed: int) -> Any:
    return c.completions.create(
        model="chat", prompt=prompt, max_tokens=10, temperature=0.9, seed=seed, logprobs=5,
        presence_penalty=0.4, frequency_penalty=0.2, extra_body={"ignore_eos": True},
    )  # fmt: skip


def _same(a: Any, b: Any) -> None:
    """The same tokens, logprobs and top alternatives, bit for bit."""
    x, y = a.choices[0], b.choices[0]
    assert x.text == y.text
    assert x.logprobs.tokens == y.logprobs.tokens
    assert x.logprobs.token_logprobs == y.logprobs.token_logprobs
    assert x.logprobs.top_logprobs == y.logprobs.top_logprobs


def test_a_prompt_that_extends_a_kept_session_continues_it_exactly(door, tokenizer):
    c = client_of(door)
    forget_kept(door)
    text = "state space models carry a fixed-size state from token to token; hello world, a Mamba"
    prompt = tokenizer.encode(text).ids
    assert len(prompt) >= 40
    _completion(c, prompt, seed=1)
    (history,) = kept_histories(door)
    assert history[: len(prompt)] == prompt and len(history) == len(prompt) + 10
    extended = history + tokenizer.encode(" and the next turn").ids
    before = counts(door).continued
    cached = _completion(c, extended, seed=9)
    assert counts(door).continued == before + 1  # fed only the new ids
    forget_kept(door)
    missed = counts(door).missed
    fresh = _completion(c, extended, seed=9)
    assert counts(door).missed == missed + 1  # prefilled the whole prompt
    _same(cached, fresh)

    # a shorter common prefix (an edited last turn): a fork at that step
    (history,) = kept_histories(door)
    edited = history[:-4] + tokenizer.encode(" or else").ids
    forked = counts(door).forked
    cached = _completion(c, edited, seed=3)
    assert counts(door).forked == forked + 1
    forget_kept(door)
    _same(cached, _completion(c, edited, seed=3))


def test_a_chat_goes_on_from_its_last_turn_exactly(door):
    c = client_of(door)
    turns = ["hello", "how are you today?", "tell me about the fox", "and the lazy dog?"]

    system = "You are terse: one short line about state space models, foxes or dogs."
    # (a system prompt past the fork threshold: a reply the template writes back in other
    # tokens than were drawn forks at the common prefix, so every next turn reuses)

    def chat(keep: bool) -> list[str]:
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        replies = []
        for i, turn in enumerate(turns):
            if not keep:
                forget_kept(door)
            messages.append({"role": "user", "content": turn})
            reply = c.chat.completions.create(
                model="chat", messages=messages, max_tokens=12, temperature=0.8, seed=i,
                presence_penalty=0.5, logprobs=True, top_logprobs=2,
            )  # fmt: skip
            content = reply.choices[0].message.content
            logprobs = [(e.token, e.logprob) for e in reply.choices[0].logprobs.content]
            replies.append(f"{content!r} {logprobs!r} {reply.choices[0].finish_reason}")
            messages.append({"role": "assistant", "content": content})
        return replies

    forget_kept(door)
    reused = counts(door).continued + counts(door).forked
    with_cache = chat(keep=True)
    assert counts(door).continued + counts(door).forked - reused == len(turns) - 1
    assert chat(keep=False) == with_cache


# ---------------------------------------------------------------------------- tokens, bounds


def test_tokens_and_tenants_are_the_grpc_apis(http_dirs, redis_server, tokens):
    dirs, _ = http_dirs
    settings = HttpSettings(listen="127.0.0.1:0")
    harness = WorkerHarness(
        {"chat": dirs["chat"]}, redis_server.url, auth_tokens=tokens["path"], http=settings
    )
    try:
        ask = {"model": "chat", "prompt": "hello world", "max_tokens": 4, "seed": 1}
        with pytest.raises(openai.AuthenticationError) as caught:
            client_of(harness, "not-a-token").completions.create(**ask)
        assert caught.value.status_code == 401 and "known token" in caught.value.message
        operator = client_of(harness, tokens["operator"])
        assert [m.id for m in operator.models.list().data] == ["chat"]
        with pytest.raises(openai.PermissionDeniedError, match="may not call Generate"):
            operator.completions.create(**ask)
        a = client_of(harness, tokens["a"]).completions.create(**ask)
        ids = harness.manager.resident_ids()
        assert any(i.startswith("tenant-a~http-") for i in ids), ids
        missed = counts(harness).missed
        b = client_of(harness, tokens["b"]).completions.create(**ask)
        assert counts(harness).missed == missed + 1  # tenant a's kept session is not b's
        assert a.choices[0].text == b.choices[0].text
        assert any(i.startswith("tenant-b~http-") for i in harness.manager.resident_ids())
    finally:
        harness.stop()


def test_requests_past_the_limit_are_429(http_dirs, redis_server):
    dirs, _ = http_dirs
    settings = HttpSettings(listen="127.0.0.1:0", max_requests=1)
    harness = WorkerHarness({"chat": dirs["chat"]}, redis_server.url, http=settings)
    try:
        c = client_of(harness)
        stream = c.completions.create(
            model="chat", prompt="hello", max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        with pytest.raises(openai.RateLimitError, match="at most 1 requests at once"):
            c.completions.create(model="chat", prompt="hello", max_tokens=2)
        stream.close()  # the client goes away: its generation stops, the slot frees
        for _ in range(100):
            try:
                c.completions.create(model="chat", prompt="hello", max_tokens=2)
                break
            except openai.RateLimitError:
                time.sleep(0.05)
        else:
            raise AssertionError("the closed stream's slot never came back")
    finally:
        harness.stop()


def test_a_taken_port_refuses_the_start_and_a_stop_closes_the_kept_sessions(
    http_dirs, redis_server
):
    dirs, _ = http_dirs
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = WorkerSettings(
            models=(("chat", dirs["chat"]),), listen="127.0.0.1:0", redis_url=redis_server.url,
            http=HttpSettings(listen=f"127.0.0.1:{port}"),
        )  # fmt: skip
        with pytest.raises(HttpListenError, match=f"port {port} is already in use"):
            asyncio.run(Worker(settings).start())  # refused before anything started
    harness = WorkerHarness(
        {"chat": dirs["chat"]}, redis_server.url, http=HttpSettings(listen="127.0.0.1:0")
    )
    client_of(harness).completions.create(model="chat", prompt="hello", max_tokens=3)
    (kept,) = [k for kept in harness.worker.http_door.runs.cache._kept.values() for k in kept]
    assert harness.client.get_session(kept).step > 0
    harness.stop()
    other = WorkerHarness({"chat": dirs["chat"]}, redis_server.url)
    try:
        assert kept not in [s.session_id for s in other.client.list_sessions()]
    finally:
        other.stop()


def test_http_is_refused_beyond_loopback_without_tokens_and_with_workers(tmp_path):
    exposed = WorkerSettings(
        models=(), listen="127.0.0.1:0", http=HttpSettings(listen="0.0.0.0:8000")
    )
    with pytest.raises(ExposedWithoutAuthError, match=r"refusing to listen on 0\.0\.0\.0:8000"):
        check_exposure(exposed)
    check_exposure(replace(exposed, auth_tokens=tmp_path / "tokens.toml"))  # with tokens: served
    args = build_parser().parse_args(["--demo", "--data-dir", str(tmp_path), "--http",
                                      "127.0.0.1:8000", "--workers", "2"])  # fmt: skip
    with pytest.raises(SystemExit, match="--http serves from one worker process"):
        settings_from_args(args)
    args = build_parser().parse_args(["--demo", "--data-dir", str(tmp_path), "--http",
                                      "127.0.0.1:8000", "--http-prefix-cache", "3"])  # fmt: skip
    http = settings_from_args(args).http
    assert (http.listen, http.prefix_cache, http.max_requests) == ("127.0.0.1:8000", 3, 256)


def test_a_stop_gives_a_stream_in_flight_its_grace_then_ends_it(http_dirs, redis_server):
    dirs, _ = http_dirs
    harness = WorkerHarness(
        {"chat": dirs["chat"]}, redis_server.url, http=HttpSettings(listen="127.0.0.1:0")
    )  # shutdown_grace_s 1 (the harness's)
    stream = client_of(harness).completions.create(
        model="chat", prompt="hello", max_tokens=4000, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    (running,) = [s for s in harness.manager.resident_ids() if s.startswith("http-")]
    stopper = threading.Thread(target=harness.stop)
    started = time.monotonic()
    stopper.start()
    received = 1
    with pytest.raises(openai.APIError):  # cut at the grace: no [DONE]
        for _ in chunks:
            received += 1
    stopper.join(30)
    assert not stopper.is_alive() and time.monotonic() - started < 15
    assert 1 < received < 4000  # it went on streaming during the grace
    other = WorkerHarness({"chat": dirs["chat"]}, redis_server.url)
    try:  # the generation's session was closed, not left behind
        assert running not in [s.session_id for s in other.client.list_sessions()]
    finally:
        other.stop()


BOOLEAN_OBJECT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "verdict", "schema": BOOLEAN_OBJECT}},
        {"type": "json_object"},
    ],
)
def test_response_format_constrains_the_reply_to_json(door, response_format):
    """A random-weight model writes JSON only under the constraint: the reply parses
    (and, with a schema, is one of the two documents it allows), the same at one seed."""
    replies = []
    for _ in range(2):
        reply = client_of(door).chat.completions.create(
            model="chat",
            messages=[SYSTEM, {"role": "user", "content": "Answer in JSON."}],
            max_tokens=200,
            seed=11,
            temperature=0.8,
            response_format=response_format,
        )
        replies.append(reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop"
    assert replies[0] == replies[1]
    document = json.loads(replies[0])
    assert isinstance(document, dict)
    if response_format["type"] == "json_schema":
        assert document in ({"ok": True}, {"ok": False})


# ---------------------------------------------------------------------------- sessions left


def _wait_until(check: Any, timeout: float = 15.0) -> bool:
    """Poll ``check`` until it is true, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _running(harness: WorkerHarness) -> set[str]:
    async def running() -> set[str]:
        return set(harness.worker.http_door.runs._running)

    return harness.call(running())


def _open_stream(harness: WorkerHarness, body: dict[str, Any], events: int) -> socket.socket:
    """A streaming request on a raw socket, left open after its first ``events`` events."""
    host, port = harness.worker.http_door.address.rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    received = b""
    while received.count(b"data: ") < events:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    return sock


def test_a_client_that_drops_its_stream_leaves_no_session(door):
    """Starlette cancels a dropped stream's task again at every wait: the door's cleanup
    (its session closed, its run forgotten) must happen anyway."""
    body = {"model": "chat", "prompt": "hello", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    before = _running(door)
    sockets = [_open_stream(door, body, 3) for _ in range(3)]
    streaming = _running(door) - before
    assert len(streaming) == 3
    for sock in sockets:
        sock.close()

    def released() -> bool:
        resident = set(door.manager.resident_ids())
        return not streaming & (_running(door) | resident)

    assert _wait_until(released), (streaming, _running(door), door.manager.resident_ids())


def test_a_fork_past_the_snapshots_reach_keeps_the_session_and_prefills(http_dirs, redis_server):
    """Snapshots every 4 steps, 2 kept: a kept session forks only within its last ~8
    steps; a request that shares an older prefix prefills afresh, the kept session stays
    kept (not dropped from the cache while it stays open)."""
    dirs, _ = http_dirs
    harness = WorkerHarness(
        {"chat": dirs["chat"]}, redis_server.url, http=HttpSettings(listen="127.0.0.1:0"),
        manager=ManagerSettings(defaults=SessionDefaults(snapshot_every=4, max_snapshots=2)),
    )  # fmt: skip
    try:
        c = client_of(harness)
        prompt = list(range(5, 45))
        common: dict[str, Any] = {"model": "chat", "max_tokens": 40, "seed": 3}
        common["extra_body"] = {"ignore_eos": True}
        c.completions.create(prompt=prompt, **common)
        (first,) = kept_histories(harness)
        edited = [*prompt[:36], 7, 7, 7]
        missed, forked = counts(harness).missed, counts(harness).forked
        answer = c.completions.create(prompt=edited, **common)
        assert counts(harness).missed == missed + 1 and counts(harness).forked == forked
        histories = kept_histories(harness)
        assert first in histories and len(histories) == 2  # the old one kept, the new one
        kept = {k for kept in harness.worker.http_door.runs.cache._kept.values() for k in kept}
        resident = {s for s in harness.manager.resident_ids() if "http-" in s}
        assert resident == kept  # every open session of the door's is in the cache
        forget_kept(harness)
        assert (
            answer.choices[0].text == c.completions.create(prompt=edited, **common).choices[0].text
        )
    finally:
        harness.stop()


def test_a_client_does_not_continue_an_admins_sessions(http_dirs, redis_server, tokens, capsys):
    """An admin's sessions are stored without a tenant (plain ``http-...`` ids): a client
    of the admin's own tenant does not find them in the prefix cache, nor they its."""
    dirs, _ = http_dirs
    ops_client = make_token(capsys, tokens["path"], "ops", "client")
    settings = HttpSettings(listen="127.0.0.1:0")
    harness = WorkerHarness(
        {"chat": dirs["chat"]}, redis_server.url, auth_tokens=tokens["path"], http=settings
    )
    try:
        ask = {"model": "chat", "prompt": "hello world", "max_tokens": 4, "seed": 1}
        admin = client_of(harness, tokens["admin"])
        admin.completions.create(**ask)
        (admins,) = kept_histories(harness)
        ask["prompt"] = [*admins, 9, 9]  # extends the admin's kept session
        missed = counts(harness).missed
        client = client_of(harness, ops_client)
        client.completions.create(**ask)
        assert counts(harness).missed == missed + 1  # prefilled in its own tenant
        assert any(i.startswith("ops~http-") for i in harness.manager.resident_ids())
        client.completions.create(**{**ask, "prompt": "the quick brown fox"})
        clients = [h for h in kept_histories(harness) if h[: len(admins)] != admins]
        ask["prompt"] = [*clients[0], 8]  # extends only the client's
        admin.completions.create(**ask)
        assert counts(harness).missed == missed + 3 and counts(harness).continued == 0
    finally:
        harness.stop()


def test_a_generation_the_handover_bound_stops_is_an_error(door, monkeypatch):
    """A generation whose token is not taken within the handover bound (a stream not
    read; here a bound of 0, so it stops after its first token) ends "cancelled": not
    a clean stop, so an error (503; in a stream, an error event) and no session kept."""
    monkeypatch.setattr(generation_module, "HANDOVER_BOUND_S", 0.0)
    forget_kept(door)
    c = client_of(door)
    ask: dict[str, Any] = {"model": "chat", "prompt": "hello", "max_tokens": 50}
    ask["extra_body"] = {"ignore_eos": True}
    with pytest.raises(openai.InternalServerError) as caught:
        c.completions.create(**ask)
    assert caught.value.status_code == 503 and caught.value.type == "service_unavailable"
    assert "not taken" in caught.value.message
    chunks = []
    with pytest.raises(openai.APIError, match="not taken"):
        for chunk in c.completions.create(stream=True, **ask):
            chunks.append(chunk)
    assert len(chunks) < 50 and all(ch.choices[0].finish_reason is None for ch in chunks)
    assert _wait_until(lambda: not _running(door))
    assert kept_histories(door) == []  # neither session kept
