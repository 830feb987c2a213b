"""The asyncio client's Generate: tokens drawn by a session's model, fed back, yielded once.

:class:`~ssmserve.client.aio.AsyncClient` inherits :class:`AsyncGenerateCalls`. The call
follows the session like a stream does: when it is cut (the session moved, its worker
died, the store was briefly away) it asks again, from the step of the last token it
received (or, before any, from where it started, with the prompt; or from the step after
the prompt once the worker said it was fed) and with ``generated_before`` the tokens it
has. Tokens are drawn by a generator keyed by (seed, step), and the worker answers again
from the session's log what it generated past that step, so the caller sees each token
exactly once and the same tokens as without the fault.

A model served with a tokenizer takes ``prompt_text`` and gives each token's ``text``: the
whole characters it completes, so the texts joined are the generation's text, the same
across a resumed call (the worker rebuilds its detokenizer from the session's log).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from ssmserve.client.errors import (
    SsmserveClientError,
    StepFailed,
    Unavailable,
    from_rpc_error,
    step_redirect,
)
from ssmserve.client.retry import Backoff, RetryPolicy
from ssmserve.client.routing import TRANSIENT_NUMBERS, WorkerRouter, session_metadata
from ssmserve.client.step_values import SessionRef, session_id_of
from ssmserve.v1 import ssmserve_pb2 as pb

#: How long closing a generation early waits for each call that takes a token back.
TAKE_BACK_BOUND_S = 10.0


@dataclass(frozen=True)
class TokenLogprob:
    """A likely token at one step: its id, log-probability (after penalties and
    logit_bias, before temperature and filters) and text (a model with a tokenizer)."""

    token_id: int
    logprob: float
    text: str = ""


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token: the step it became the input of, its id, its log-probability
    under the filtered distribution it was drawn from, and the guard events of that step."""

    step: int
    token_id: int
    logprob: float
    guard_events: list[pb.GuardEvent] = field(default_factory=list)
    # Models with a tokenizer: the text released at this token (whole characters, less
    # what may still begin a stop string, held for a later token); joined, the
    # generation's text.
    text: str = ""
    # logprobs / top_logprobs asked for: after penalties and logit_bias, before
    # temperature and the filters; the most likely tokens first.
    unfiltered_logprob: float | None = None
    top_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The generation's last token: why it ended ("length", "stop", "eos"), and the stop
    # string matched ('' for a stop id); '' on every other token.
    finish_reason: str = ""
    stop_string: str = ""
    # A text monitor rejected a later token: the tokens yielded before this one with a
    # step after this are withdrawn (the session was rolled back there); None: none.
    retracted_after_step: int | None = None


FINISH_REASONS = {
    pb.GenerateResponse.FINISH_LENGTH: "length",
    pb.GenerateResponse.FINISH_STOP: "stop",
    pb.GenerateResponse.FINISH_GUARD: "guard",
    pb.GenerateResponse.FINISH_EOS: "eos",
    pb.GenerateResponse.FINISH_CANCELLED: "cancelled",
    pb.GenerateResponse.FINISH_MONITOR: "monitor",
}


class AsyncGenerateCalls:
    """Generate: a token model's session fed a prompt, then its own seeded draws."""

    retry: RetryPolicy
    router: WorkerRouter

    async def get_session(self, session: SessionRef) -> pb.SessionInfo:
        raise NotImplementedError  # AsyncClient's

    async def generate(
        self,
        session: SessionRef,
        max_tokens: int,
        *,
        prompt_ids: Iterable[int] | None = None,
        prompt_text: str = "",
        at_step: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        stop_token_ids: Iterable[int] = (),
        stop: Iterable[str] = (),
        ignore_eos: bool = False,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        penalty_last_n: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        take_back_on_close: bool = True,
        constraint: pb.Constraint | None = None,
        monitor: pb.TextMonitor | None = None,
        monitor_retries: int = 0,
    ) -> AsyncIterator[GeneratedToken]:
        """Generate up to ``max_tokens`` tokens with the session's token model (an id or a
        SessionInfo); yields a GeneratedToken per token, in order, as it is drawn.

        ``prompt_ids`` are fed first, as steps; or ``prompt_text``, which a model served
        with a tokenizer.json encodes into them (one of the two). Each token is drawn from
        the logits of the step before it and fed back as the session's next input, logged
        like any step:
        ``temperature`` 0 is greedy (the argmax); otherwise the logits over
        ``temperature``, filtered by ``top_k`` (0: all), ``top_p`` (1: all) and
        ``min_p`` (0: none), drawn with a generator keyed by (``seed``, step), so the same
        call from the same step gives the same tokens. Generation ends after
        ``max_tokens`` tokens, a token of ``stop_token_ids`` (yielded), one of the model's
        end-of-sequence ids (yielded, without text; unless ``ignore_eos``) or, a model
        with a tokenizer, when its text contains a string of ``stop`` (at most 16; not
        sent: the text that may begin one is held back until it cannot); the last token
        says why (``finish_reason``, ``stop_string``). Before temperature, the logits are
        adjusted by ``repetition_penalty`` (1: off), ``presence_penalty`` and
        ``frequency_penalty`` (0: off) over the session's last ``penalty_last_n`` inputs
        (None: 64) and ``logit_bias`` ({id: bias in [-100, 100]}). ``logprobs`` /
        ``top_logprobs`` (0..20): each token carries its ``unfiltered_logprob`` and the
        most likely tokens of that adjusted distribution. ``at_step``:
        the step the session is at before the prompt (default: its step now). When the
        call is cut it resumes wherever the session is served; each token is yielded
        once, with ``text`` (a model with a tokenizer: the whole characters it releases).
        Closed early (``aclose()`` or ``close()``, a ``break``), the session is rolled
        back to the step of the last token yielded if this generation went past it
        (``take_back_on_close``), and the worker takes back a step it still had in flight
        once it lands: settled, the session holds no token the caller did not get.
        Raises InvalidArgument (bad parameters, ids outside the vocabulary, prompt_text
        or stop strings for a model without a tokenizer; the session is untouched),
        FailedPrecondition (a signal model, or a session not at ``at_step``), StepFailed
        (a guard rejected or rolled back the next step, or something else stepped the
        session: the tokens before it were yielded), NotFound.

        A model with a tokenizer: ``constraint`` (``ssmserve.client.constraints``: a JSON
        schema, regex, Lark grammar or any JSON object) holds the output to it; ``monitor``
        checks the text after each token and retracts what it rejects: the next token
        yielded carries ``retracted_after_step`` (drop the tokens after it), and past its
        max_retries StepFailed (MONITOR_REJECTED) is raised. ``monitor_retries``: the
        attempt of the seed to draw with (``ssmserve.client.monitored``)."""
        session_id = session_id_of(session)
        if at_step is None:
            at_step = (await self.get_session(session_id)).step
        if self.router.discover_pending:
            await self.router.discover()
        request = pb.GenerateRequest(
            session_id=session_id,
            max_tokens=max_tokens,
            sampling=pb.SamplingParams(
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                seed=seed,
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                penalty_last_n=penalty_last_n,
                logit_bias=dict(logit_bias or {}),
            ),
            stop_token_ids=list(stop_token_ids),
            stop=list(stop),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            constraint=constraint,
            monitor=monitor,
            monitor_retries=monitor_retries,
        )
        prompt = _Prompt(list(prompt_ids or ()), prompt_text)
        last: GeneratedToken | None = None
        tokens = _generate(self.router, request, prompt, at_step)
        try:
            async for token in tokens:
                last = token
                yield token
        except GeneratorExit:  # closed before the generation ended
            await tokens.aclose()  # the call is cancelled first
            if take_back_on_close and last is not None and not last.finish_reason:
                await self._take_back(session_id, last.step)
            raise

    async def _take_back(self, session_id: str, step: int) -> None:
        """Roll the session back to ``step``, the last token yielded, if it is past it:
        the worker took the step of a token that was on its way when the call was closed
        (it takes back one it had not handed over itself). Best effort, bounded: a
        failure leaves the session where it is."""
        try:
            info = await asyncio.wait_for(self.get_session(session_id), TAKE_BACK_BOUND_S)
            if info.step > step:
                await asyncio.wait_for(self.rollback(session_id, to_step=step), TAKE_BACK_BOUND_S)
        except (SsmserveClientError, TimeoutError):
            pass

    async def rollback(self, session: SessionRef, *, to_step: int | None = None) -> Any:
        raise NotImplementedError  # AsyncClient's

    async def generate_text(
        self, session: SessionRef, max_tokens: int, *, prompt_text: str = "", **options: Any
    ) -> str:
        """The text ``generate`` gives (its tokens' texts joined): a model served with a
        tokenizer; ``options`` as ``generate``'s."""
        parts: list[tuple[int, str]] = []
        async for t in self.generate(session, max_tokens, prompt_text=prompt_text, **options):
            if t.retracted_after_step is not None:  # a text monitor withdrew the later ones
                parts = [p for p in parts if p[0] <= t.retracted_after_step]
            parts.append((t.step, t.text))
        return "".join(text for _, text in parts)


@dataclass
class _Prompt:
    """What is still to be fed before generating: ids, or a text the worker encodes."""

    ids: list[int]
    text: str

    def fed(self) -> None:
        self.ids, self.text = [], ""

    def __bool__(self) -> bool:
        return bool(self.ids or self.text)


async def _generate(
    router: WorkerRouter, base: pb.GenerateRequest, prompt: _Prompt, at: int
) -> AsyncIterator[GeneratedToken]:
    """Generate calls until the generation ends, each from where the last one got to."""
    session_id = base.session_id
    stop = set(base.stop_token_ids)
    received, last_token = 0, -1
    # A constrained or monitored generation's tokens, sent with a resumed call: the worker
    # rebuilds its matcher from them where the session's log no longer holds them.
    guided = base.HasField("constraint") or base.HasField("monitor")
    kept: list[int] = []
    retracted: int | None = None  # a retraction not yet passed on with a token
    backoff = Backoff(router.retry)
    address = router.owner_of(session_id)
    while True:
        request = pb.GenerateRequest()
        request.CopyFrom(base)
        request.at_step, request.generated_before = at, received
        if guided:
            request.generated_ids.extend(kept)  # the ``received`` tokens
        request.prompt_ids.extend(prompt.ids)
        request.prompt_text = prompt.text
        call = router.worker(address).sessions.Generate(
            request, metadata=session_metadata(session_id)
        )
        error: SsmserveClientError
        try:
            async for reply in router.replies(call):
                backoff.progress()
                router.served(session_id, address)
                if reply.HasField("retracted_after_step"):  # before this reply's tokens
                    back = reply.retracted_after_step
                    received, at = received - max(at - back, 0), min(at, back)
                    del kept[received:]
                    retracted = back if retracted is None else min(retracted, back)
                    base.monitor_retries = reply.monitor_retries  # a resumed call's draws
                for i, t in enumerate(reply.tokens):
                    if t.step <= at and received:
                        continue  # answered before this call resumed
                    last = i == len(reply.tokens) - 1
                    yield _token(t, reply if last else None, retracted)
                    retracted = None
                    received, last_token, at = received + 1, t.token_id, t.step
                    if guided:
                        kept.append(t.token_id)
                    prompt.fed()
                if prompt and reply.HasField("prompt_fed_step"):  # part of a long prompt
                    if prompt.text:  # the worker's ids of the text: a retry sends the rest
                        prompt.ids, prompt.text = list(reply.prompt_ids_left), ""
                    else:
                        prompt.ids = prompt.ids[reply.prompt_fed_step - at :]
                    at = reply.prompt_fed_step
                if prompt and _prompt_fed(reply, at, prompt):
                    at = reply.session_step
                    prompt.fed()
                if reply.HasField("stopped"):
                    stopped = reply.stopped
                    if stopped.code not in TRANSIENT_NUMBERS:
                        result = pb.StepResult(
                            session_id=session_id, step=reply.session_step + 1, error=stopped
                        )
                        raise StepFailed(result)
                    error = step_redirect(stopped) or Unavailable(stopped.message, stopped.reason)
                    break
                if reply.finish_reason != pb.GenerateResponse.FINISH_UNSPECIFIED:
                    return
            else:
                error = Unavailable(f"{address} ended the generation before it finished")
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        finally:
            call.cancel()
        if received >= base.max_tokens or (received and last_token in stop):
            return  # every token is here; only the end was not
        address = await router.next_address(address, error, backoff, session_id)


def _token(
    t: pb.GeneratedToken, final: pb.GenerateResponse | None, retracted: int | None = None
) -> GeneratedToken:
    """A token as the caller gets it; ``final``: the reply it ends, if it carries the
    finish reason; ``retracted``: the step after which earlier tokens are withdrawn."""
    finish = "" if final is None else FINISH_REASONS.get(final.finish_reason, "")
    top = [TokenLogprob(x.token_id, x.logprob, x.text) for x in t.top_logprobs]
    return GeneratedToken(
        t.step, t.token_id, t.logprob, list(t.guard_events), t.text,
        unfiltered_logprob=t.unfiltered_logprob if t.HasField("unfiltered_logprob") else None,
        top_logprobs=top,
        finish_reason=finish,
        stop_string="" if final is None else final.stop_string,
        retracted_after_step=retracted,
    )  # fmt: skip


def _prompt_fed(reply: pb.GenerateResponse, at: int, prompt: _Prompt) -> bool:
    """Whether ``reply`` says the prompt is fed: the first message after it carries no
    token and the step generation starts from (a text's id count is the worker's)."""
    if prompt.ids:
        return reply.session_step == at + len(prompt.ids)
    done = (
        reply.HasField("stopped") or reply.finish_reason != pb.GenerateResponse.FINISH_UNSPECIFIED
    )
    return not reply.tokens and not done and reply.session_step > at
