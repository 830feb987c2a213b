"""OpenAI's request fields -> the internal ``GenerateRequest`` (all but session and prompt).

=====================  ===============================================================
OpenAI / vLLM field    ``GenerateRequest`` / ``SamplingParams``
=====================  ===============================================================
max_tokens,            ``max_tokens`` (1 .. the server's Generate limit; chat's default:
max_completion_tokens  that limit, completions': 16, as OpenAI's)
temperature           ``temperature`` (default 1; 0: greedy)
top_p, top_k, min_p    the same
seed                   ``seed`` (absent: a random one per request)
stop                   ``stop`` (strings, matched on the text; at most 4, as OpenAI's)
stop_token_ids         ``stop_ids``
ignore_eos             ``ignore_eos``
presence_penalty,      the same (over the session's last ``penalty_last_n`` inputs, the
frequency_penalty,     prompt's included); ``repetition_penalty`` 0 is 1 (off), as over
repetition_penalty     gRPC
logit_bias             ``logit_bias`` (token id strings -> bias)
logprobs,              ``logprobs`` and ``top_logprobs`` (completions: ``logprobs`` N is
top_logprobs           the top N; chat: ``logprobs`` true, ``top_logprobs`` N)
response_format        ``text``; ``json_object`` and ``json_schema`` (its ``schema``) become
                       the request's constraint (``sessions.constraints``, llguidance)
n, best_of             1 only
=====================  ===============================================================
"""

from __future__ import annotations

import json
import secrets

import numpy as np

from ssmserve.server.http.errors import HttpError, bad_request
from ssmserve.server.http.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from ssmserve.server.sessions.constraints import (
    BadConstraintError,
    Constraint,
    check_constraint,
)
from ssmserve.server.sessions.generation import GenerateRequest
from ssmserve.server.sessions.guided_output import OutputRules
from ssmserve.server.sessions.sampling import BadSamplingError, SamplingParams

#: Completions' ``logprobs`` at most (OpenAI's limit); chat's ``top_logprobs`` at most.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


def completion_request(body: CompletionRequest, max_tokens_limit: int) -> GenerateRequest:
    _refuse_unsupported(body)
    if body.echo:
        raise bad_request("echo is not supported: the prompt is not sent back", "echo")
    if body.suffix:
        raise bad_request("suffix is not supported (no fill-in-the-middle)", "suffix")
    if body.best_of not in (None, 1):
        raise bad_request("best_of must be 1 (one completion per request)", "best_of")
    top = body.logprobs
    if top is not None and not 0 <= top <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS}", "logprobs")
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    return _request(body, max_tokens, max_tokens_limit, top is not None, top or 0)


def chat_request(body: ChatCompletionRequest, max_tokens_limit: int) -> GenerateRequest:
    _refuse_unsupported(body)
    if body.tools:
        raise bad_request("tools are not supported by this server", "tools")
    top = body.top_logprobs
    if top is not None:
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in 0..{MAX_CHAT_TOP_LOGPROBS}", "top_logprobs")
        if top and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    given = body.max_completion_tokens if body.max_completion_tokens is not None else None
    max_tokens = given if given is not None else body.max_tokens
    param = "max_completion_tokens" if given is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = max_tokens_limit
    return _request(body, max_tokens, max_tokens_limit, body.logprobs, top or 0, param)


def _refuse_unsupported(body: SamplingFields) -> None:
    if body.n not in (None, 1):
        raise bad_request(
            "n must be 1: this server makes one completion per request (send n requests "
            "with different seeds for more)",
            "n",
        )


def response_format(body: SamplingFields) -> OutputRules | None:
    """The constraint ``response_format`` asks for: none for ``text`` (or no field);
    ``json_object``: any JSON object; ``json_schema``: a document valid under its
    ``json_schema.schema``. The schema is checked here (llguidance reads it), before a
    session is made for the request; an unknown type is refused by name, never ignored
    (a client relying on it would get free text)."""
    fmt = body.response_format
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        constraint = Constraint("json_object")
    elif kind == "json_schema":
        spec = fmt.get("json_schema") if fmt is not None else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise bad_request(
                "response_format json_schema needs json_schema.schema: a JSON schema object",
                "response_format",
            )
        constraint = Constraint("json_schema", json.dumps(schema))
    else:
        raise bad_request(
            f"response_format type {str(kind)[:40]!r} is not supported; use 'text', "
            f"'json_object' or 'json_schema'",
            "response_format",
        )
    try:
        check_constraint(constraint)
    except BadConstraintError as exc:
        raise bad_request(f"response_format: {exc}", "response_format") from None
    return OutputRules(constraint=constraint)


def _request(
    body: SamplingFields,
    max_tokens: int,
    limit: int,
    logprobs: bool,
    top_logprobs: int,
    max_tokens_param: str = "max_tokens",
) -> GenerateRequest:
    if not 1 <= max_tokens <= limit:
        raise bad_request(
            f"{max_tokens_param} must be in 1..{limit} (this server's limit), got {max_tokens}",
            max_tokens_param,
        )
    stops = body.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(not s for s in stops):
        raise bad_request("stop: a stop string must not be empty", "stop")
    seed = body.seed
    if seed is not None and not 0 <= seed < 2**64:
        raise bad_request("seed must be in [0, 2**64)", "seed")
    top_k = body.top_k or 0
    if top_k < 0:  # vLLM's -1: all tokens, as 0 here
        if top_k != -1:
            raise bad_request(f"top_k must be -1 or 0 (all tokens) or more, got {top_k}", "top_k")
        top_k = 0
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        seed=secrets.randbits(64) if seed is None else seed,
        # 0 is off, as over gRPC (its proto's zero default) and as the range's message says
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias),
    )
    try:
        sampling.check()  # here, before a session is made for the request
    except BadSamplingError as exc:
        raise bad_request(str(exc), param_of(str(exc))) from None
    return GenerateRequest(
        session_id="",
        max_tokens=max_tokens,
        sampling=sampling,
        prompt=np.zeros(0, np.int64),
        stop_ids=frozenset(body.stop_token_ids or ()),
        stop=tuple(stops),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        rules=response_format(body),
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys are token ids, got {key[:40]!r}", "logit_bias"
            ) from None
        out[token] = float(value)
    return tuple(sorted(out.items()))


def param_of(message: str) -> str | None:
    """The request field an internal refusal names (its message starts with it)."""
    for name in (
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
        "top_logprobs",
    ):  # fmt: skip
        if message.startswith(name) or f"({name}" in message:
            return name
    return None


__all__ = ["HttpError", "chat_request", "completion_request", "param_of"]
