"""The OpenAI API's request bodies (pydantic models) and the JSON of its answers.

The request models take the fields of OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` and the extra sampling fields vLLM accepts (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``). Fields a client
library sends that change nothing here (``user``, ``metadata``, ``store``...) are
accepted and ignored, as OpenAI and vLLM do; fields whose meaning this server does not
implement (``n`` > 1, ``best_of``, ``echo``, ``suffix``, tools) are refused by
``params``, by name. Answers are plain dicts, in the shapes the ``openai`` package parses
(``Completion``, ``ChatCompletion`` and their stream chunks).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: Most stop strings per request (OpenAI's limit).
MAX_STOP_STRINGS = 4
#: Most entries of ``logit_bias`` (OpenAI allows 300 tokens).
MAX_LOGIT_BIAS = 300


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share: sampling, stopping and the stream."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=200)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # OpenAI's structured output: {"type": "text" | "json_object" | "json_schema", ...}.
    response_format: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top alternatives per token, 0..5 (None: no logprobs)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # vLLM's chat extras: the template's switches
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------------- answers


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    use: dict[str, int] | None,
    created: int | None = None,
    chunk: bool = False,
) -> dict[str, Any]:
    """A ``text_completion`` (``chunk``: one event of a stream, same object type, as
    OpenAI sends it)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_completion(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    use: dict[str, int],
    created: int | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": use,
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    use: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta`` None: the usage chunk (no choices)."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def model_list(keys: list[str], created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": key, "object": "model", "created": created, "owned_by": "ssmserve"}
            for key in keys
        ],
    }
