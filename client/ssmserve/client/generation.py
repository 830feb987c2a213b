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

from collections.abc import AsyncIterator, Iterable
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


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token: the step it became the input of, its id, its log-probability
    under the filtered distribution it was drawn from, and the guard events of that step."""

    step: int
    token_id: int
    logprob: float
    guard_events: list[pb.GuardEvent] = field(default_factory=list)
    # Models with a tokenizer: the whole characters this token completes ('' while a
    # character's bytes are still coming); joined, the generation's text.
    text: str = ""


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
        ``max_tokens`` tokens or a token of ``stop_token_ids`` (yielded). ``at_step``:
        the step the session is at before the prompt (default: its step now). When the
        call is cut it resumes wherever the session is served; each token is yielded
        once, with ``text`` (a model with a tokenizer: the whole characters it completes).
        Raises InvalidArgument (bad parameters, ids outside the vocabulary, prompt_text
        for a model without a tokenizer; the session is untouched), FailedPrecondition (a
        signal model, or a session not at ``at_step``), StepFailed (a guard rejected or
        rolled back the next step, or something else stepped the session: the tokens before
        it were yielded), NotFound."""
        session_id = session_id_of(session)
        if at_step is None:
            at_step = (await self.get_session(session_id)).step
        if self.router.discover_pending:
            await self.router.discover()
        request = pb.GenerateRequest(
            session_id=session_id,
            max_tokens=max_tokens,
            sampling=pb.SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
            ),
            stop_token_ids=list(stop_token_ids),
        )
        prompt = _Prompt(list(prompt_ids or ()), prompt_text)
        async for token in _generate(self.router, request, prompt, at_step):
            yield token

    async def generate_text(
        self, session: SessionRef, max_tokens: int, *, prompt_text: str = "", **options: Any
    ) -> str:
        """The text ``generate`` gives (its tokens' texts joined): a model served with a
        tokenizer; ``options`` as ``generate``'s."""
        parts = [
            t.text
            async for t in self.generate(session, max_tokens, prompt_text=prompt_text, **options)
        ]
        return "".join(parts)


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
    backoff = Backoff(router.retry)
    address = router.owner_of(session_id)
    while True:
        request = pb.GenerateRequest()
        request.CopyFrom(base)
        request.at_step, request.generated_before = at, received
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
                for t in reply.tokens:
                    if t.step <= at and received:
                        continue  # answered before this call resumed
                    events = list(t.guard_events)
                    yield GeneratedToken(t.step, t.token_id, t.logprob, events, t.text)
                    received, last_token, at = received + 1, t.token_id, t.step
                    prompt.fed()
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


def _prompt_fed(reply: pb.GenerateResponse, at: int, prompt: _Prompt) -> bool:
    """Whether ``reply`` says the prompt is fed: the first message after it carries no
    token and the step generation starts from (a text's id count is the worker's)."""
    if prompt.ids:
        return reply.session_step == at + len(prompt.ids)
    done = (
        reply.HasField("stopped") or reply.finish_reason != pb.GenerateResponse.FINISH_UNSPECIFIED
    )
    return not reply.tokens and not done and reply.session_step > at
