"""A request's prompt ids, and its generation's updates as OpenAI's answers.

``/v1/completions`` takes a prompt as text (encoded with the model's tokenizer, with the
special tokens its post-processor adds, as Generate's ``prompt_text``) or as token ids;
``/v1/chat/completions`` renders its messages with the model's chat template
(``chat_template``) and encodes that text without added special tokens (the template
writes them), as transformers does. Then both run the same way (``runs``), and each
token's released text (stop strings held back and cut, in the session: see
``sessions.stopping``) becomes the answer's text, its logprobs OpenAI's logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ssmserve.server.api.tenancy import TenantScope
from ssmserve.server.engine.tokenizer import ModelTokenizer
from ssmserve.server.errors import SsmserveError
from ssmserve.server.http import protocol
from ssmserve.server.http.chat_template import ChatTemplate, load_chat_template
from ssmserve.server.http.errors import HttpError, bad_request, from_error, internal
from ssmserve.server.http.params import chat_request, completion_request, param_of
from ssmserve.server.http.protocol import ChatCompletionRequest, CompletionRequest
from ssmserve.server.http.runs import Caller, CompletionRuns
from ssmserve.server.sessions.generation import (
    Finish,
    GenerateRequest,
    GenerateSettings,
    Token,
    TokenLogprob,
)
from ssmserve.server.sessions.manager import SessionManager

#: Internal finish reasons -> OpenAI's ("stop": a stop string, a stop id or EOS). A
#: generation ended "cancelled" is an error (``_finish_reason``), never a clean stop.
FINISH_REASONS = {"length": "length", "stop": "stop", "eos": "stop"}


@dataclass(frozen=True)
class Prepared:
    """A request checked and encoded, ready to run."""

    chat: bool
    model: str  # the served key
    ids: np.ndarray
    request: GenerateRequest
    tokenizer: ModelTokenizer | None
    include_usage: bool


@dataclass
class Answer:
    """A generation's updates gathered: its text, tokens, logprobs and end."""

    tokenizer: ModelTokenizer | None
    text: list[str] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, token: Token) -> None:
        self.tokens.append(token)
        self.text.append(token.text)

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(self, tokens: list[Token]) -> dict[str, Any]:
        return {
            "content": [
                {
                    "token": (text := self.token_text(t.token)),
                    "logprob": _logprob(t),
                    "bytes": list(text.encode()),
                    "top_logprobs": [_chat_top(top) for top in t.top_logprobs],
                }
                for t in tokens
            ],
            "refusal": None,
        }

    def completion_logprobs(self, tokens: list[Token], offset: int) -> dict[str, Any]:
        texts = [self.token_text(t.token) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [_logprob(t) for t in tokens],
            "top_logprobs": [
                {_top_text(top): top.logprob for top in t.top_logprobs} for t in tokens
            ],
            "text_offset": offsets,
        }


def _logprob(token: Token) -> float:
    return token.unfiltered_logprob if token.unfiltered_logprob is not None else token.logprob


def _top_text(top: TokenLogprob) -> str:
    return top.text or f"token_id:{top.token}"


def _chat_top(top: TokenLogprob) -> dict[str, Any]:
    text = _top_text(top)
    return {"token": text, "logprob": top.logprob, "bytes": list(text.encode())}


class Completions:
    """The endpoints' work, on one worker's models and sessions."""

    def __init__(
        self,
        manager: SessionManager,
        runs: CompletionRuns,
        generate: GenerateSettings,
        model_path: Callable[[str], Path | None],
    ) -> None:
        self.manager, self.runs, self.generate = manager, runs, generate
        self.model_path = model_path  # a served key's directory (its tokenizer config)
        self._templates: dict[tuple[str, Path], ChatTemplate | None] = {}

    # ------------------------------------------------------------------ preparing

    async def prepare_completion(self, body: CompletionRequest, caller: Caller) -> Prepared:
        key = self._model(body.model, caller.scope)
        request = completion_request(body, self.generate.max_tokens)
        tokenizer = self.manager.models.tokenizer(key)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request("one prompt per request (a list of one)", "prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            self._check_chars(len(prompt))
            if tokenizer is None:
                raise bad_request(
                    f"model {key!r} has no tokenizer.json, so a text prompt cannot be "
                    f"encoded; send the prompt as token ids",
                    "prompt",
                )
            ids = await asyncio.to_thread(tokenizer.encode, prompt)
        else:
            self._check_prompt_ids(prompt, key)  # before int64 (a larger id overflows it)
            ids = np.asarray(prompt, np.int64)
        self._check_ids(ids, key, request)
        include = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared(False, key, ids, request, tokenizer, include)

    async def prepare_chat(self, body: ChatCompletionRequest, caller: Caller) -> Prepared:
        key = self._model(body.model, caller.scope)
        request = chat_request(body, self.generate.max_tokens)
        tokenizer = self.manager.models.tokenizer(key)
        template = self._template(key)
        if template is None or tokenizer is None:
            raise bad_request(
                f"model {key!r} has no chat template (tokenizer_config.json's chat_template "
                f"beside a tokenizer.json), so it cannot chat; use /v1/completions with a "
                f"prompt, or serve it from a directory that holds its tokenizer files",
                "model",
                "no_chat_template",
            )
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request(
                "continue_final_message needs add_generation_prompt false",
                "continue_final_message",
            )
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        extra = dict(body.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt"):
            extra.pop(reserved, None)
        text = template.render(messages, body.add_generation_prompt, **extra)
        if body.continue_final_message:
            last = messages[-1].get("content") or ""
            at = text.rfind(last) if last else -1
            text = text[: at + len(last)] if at != -1 else text
        self._check_chars(len(text))
        encoded = await asyncio.to_thread(
            tokenizer.tokenizer.encode, text, add_special_tokens=False
        )
        ids = np.asarray(encoded.ids, np.int64)
        self._check_ids(ids, key, request)
        include = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared(True, key, ids, request, tokenizer, include)

    def _model(self, name: str, scope: TenantScope) -> str:
        try:
            return self.manager.models.resolve(name)
        except SsmserveError as exc:
            error = from_error(exc, scope.clean(str(exc)))
            error.param, error.code = "model", "model_not_found"
            raise error from None

    def _template(self, key: str) -> ChatTemplate | None:
        """``key``'s chat template, read once per model directory (a key loaded again
        from another directory reads that one's)."""
        path = self.model_path(key)
        if path is None:
            return None
        if (key, path) not in self._templates:
            self._templates[(key, path)] = load_chat_template(path)
        return self._templates[(key, path)]

    def _check_chars(self, n: int) -> None:
        limit = self.generate.max_prompt_chars
        if n > limit:
            raise bad_request(
                f"the prompt is {n} characters, over this server's limit of {limit}", "prompt"
            )

    def _check_prompt_ids(self, ids: list[int], key: str) -> None:
        """A prompt given as ids: each inside the model's vocabulary."""
        vocab = self.manager.models[key].config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise bad_request(
                f"token id {bad[0]} (prompt) is outside [0, {vocab}) of model {key!r}",
                "prompt",
            )

    def _check_ids(self, ids: np.ndarray, key: str, request: GenerateRequest) -> None:
        """The prompt's length, and every id it (or the request) names inside the model's
        vocabulary: checked here, before a session is made for the request."""
        vocab = self.manager.models[key].config.vocab_size
        named = [*request.stop_ids, *(t for t, _ in request.sampling.logit_bias)]
        for what, values in (("prompt", ids.tolist()), ("stop_token_ids", named)):
            bad = [i for i in values if not 0 <= i < vocab]
            if bad:
                param = what if what == "prompt" else None
                raise bad_request(
                    f"token id {bad[0]} ({what} or logit_bias) is outside [0, {vocab}) of "
                    f"model {key!r}",
                    param,
                )
        limit = self.generate.max_prompt_ids
        if len(ids) == 0:
            raise bad_request("the prompt is empty: give at least one token", "prompt")
        if len(ids) > limit:
            raise bad_request(
                f"the prompt is {len(ids)} tokens, over this server's limit of {limit}",
                "prompt",
            )

    # ------------------------------------------------------------------ running

    async def updates(
        self, prepared: Prepared, caller: Caller
    ) -> AsyncGenerator[Token | Finish, None]:
        """The generation's tokens, then its Finish; a refusal raises HttpError (before
        the first update, so a stream can still answer it with its status)."""
        run = self.runs.run(caller, prepared.model, prepared.ids, prepared.request)
        try:
            async with contextlib.aclosing(run):
                async for update in run:
                    yield update
        except SsmserveError as exc:
            error = from_error(exc, caller.scope.clean(str(exc)))
            error.param = param_of(str(exc))
            raise error from None

    async def answer(self, prepared: Prepared, caller: Caller) -> dict[str, Any]:
        """The whole answer (no stream)."""
        answer = Answer(prepared.tokenizer)
        async with contextlib.aclosing(self.updates(prepared, caller)) as updates:
            async for update in updates:
                if isinstance(update, Token):
                    answer.add(update)
                else:
                    answer.text.append(update.text)
                    answer.finish_reason = _finish_reason(update, caller)
        text = "".join(answer.text)
        use = protocol.usage(len(prepared.ids), len(answer.tokens))
        want = prepared.request.logprobs
        if prepared.chat:
            logprobs = answer.chat_logprobs(answer.tokens) if want else None
            return protocol.chat_completion(
                _id("chatcmpl"), prepared.model, text, answer.finish_reason, logprobs, use
            )
        logprobs = answer.completion_logprobs(answer.tokens, 0) if want else None
        return protocol.completion(
            _id("cmpl"), prepared.model, text, answer.finish_reason, logprobs, use
        )

    async def stream(
        self,
        prepared: Prepared,
        caller: Caller,
        first: Token | Finish,
        rest: AsyncGenerator[Token | Finish, None],
    ) -> AsyncGenerator[str, None]:
        """Server-sent events: a chunk per token (the chat's first says the role), the
        finish reason, the usage when asked for, then ``[DONE]``. An error once streaming
        is an event ``{"error": ...}`` (the ``openai`` package raises it)."""
        request_id, created = _id("chatcmpl" if prepared.chat else "cmpl"), int(time.time())
        answer = Answer(prepared.tokenizer)
        offset = 0
        want = prepared.request.logprobs

        def chunk(text: str, tokens: list[Token], finish: str | None) -> dict[str, Any]:
            nonlocal offset
            if prepared.chat:
                logprobs = answer.chat_logprobs(tokens) if want and tokens else None
                return protocol.chat_chunk(
                    request_id,
                    prepared.model,
                    created,
                    {"content": text} if text or not finish else {},
                    finish,
                    logprobs,
                )
            logprobs = answer.completion_logprobs(tokens, offset) if want and tokens else None
            offset += sum(len(answer.token_text(t.token)) for t in tokens) if want else 0
            return protocol.completion(
                request_id, prepared.model, text, finish, logprobs, None, created, chunk=True
            )

        if prepared.chat:
            role = {"role": "assistant", "content": ""}
            yield _event(protocol.chat_chunk(request_id, prepared.model, created, role))
        try:
            update: Token | Finish | None = first
            while update is not None:
                if isinstance(update, Token):
                    answer.add(update)
                    if update.text or want:  # a token that releases no text yet: no event
                        yield _event(chunk(update.text, [update], None))
                    update = await anext(rest, None)
                    continue
                reason = _finish_reason(update, caller)
                yield _event(chunk(update.text, [], reason))
                break
        except HttpError as exc:
            yield _event(exc.body())
            yield "data: [DONE]\n\n"
            return
        except Exception as exc:  # a bug: the stream says so and ends
            yield _event(internal(exc).body())
            yield "data: [DONE]\n\n"
            return
        if prepared.include_usage:
            use = protocol.usage(len(prepared.ids), len(answer.tokens))
            if prepared.chat:
                body = protocol.chat_chunk(request_id, prepared.model, created, None, use=use)
            else:
                body = protocol.completion(
                    request_id, prepared.model, "", None, None, use, created, chunk=True
                )
                body["choices"] = []
            yield _event(body)
        yield "data: [DONE]\n\n"


def _finish_reason(finish: Finish, caller: Caller) -> str:
    """OpenAI's finish reason; a generation a step's error ended raises it, and one that
    stopped because its tokens were not taken in time (``cancelled``: the answer is cut
    short) raises a 503."""
    if finish.error is not None:
        raise from_error(finish.error, caller.scope.clean(str(finish.error)))
    if finish.reason == "cancelled":
        raise HttpError(
            503,
            "the generation stopped: its tokens were not taken within the server's bound "
            "(a stream not read); the answer is incomplete, send the request again",
            "service_unavailable",
            None,
            "generation_stalled",
        )
    return FINISH_REASONS.get(finish.reason, "stop")


def _message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A chat message for the template: text parts joined into one ``content`` string."""
    if not isinstance(message.get("role"), str):
        raise bad_request(f"messages[{index}] has no role", f"messages.{index}.role")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"messages[{index}]: only text content parts are supported",
                    f"messages.{index}.content",
                )
            parts.append(str(part.get("text", "")))
        message = {**message, "content": "".join(parts)}
    elif content is not None and not isinstance(content, str):
        raise bad_request(
            f"messages[{index}].content must be a string or a list of text parts",
            f"messages.{index}.content",
        )
    return message


def _id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
