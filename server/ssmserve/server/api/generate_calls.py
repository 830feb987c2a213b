"""Generate's answers: a request turned into a generation, its tokens into responses.

``sessions.generation`` does the work; this module converts. What is wrong with the
request (its parameters, the model, the session) ends the call with its status before
anything is queued. Once generating, tokens go out as soon as they are drawn: each
response carries every token that is ready when it is written (several when the client
reads slower than the session steps, one at a time otherwise: none waits to be batched).
The last response says why it ended; a step that failed (a guard, a SESSION_MOVED to
follow, an at_step the session cannot resume from) is its ``stopped``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np

from ssmserve.server.api import answer_fence, status
from ssmserve.server.api.conversions import guard_event_to_pb
from ssmserve.server.api.output_rules import add_retraction, rules_from_pb
from ssmserve.server.api.tenancy import TenantScope
from ssmserve.server.errors import SsmserveError
from ssmserve.server.observability.metrics import Metrics
from ssmserve.server.sessions.generation import (
    Fed,
    Finish,
    GenerateAtStepError,
    GenerateRequest,
    Generations,
    Start,
    Token,
    Update,
)
from ssmserve.server.sessions.guided_output import Retraction
from ssmserve.server.sessions.sampling import DEFAULT_PENALTY_LAST_N, SamplingParams
from ssmserve.v1 import ssmserve_pb2 as pb

#: Tokens per response at most (each is a few bytes; this bounds a message, not a wait).
TOKENS_PER_MESSAGE = 256
_FINISH = {
    "length": pb.GenerateResponse.FINISH_LENGTH,
    "stop": pb.GenerateResponse.FINISH_STOP,
    "guard": pb.GenerateResponse.FINISH_GUARD,
    "eos": pb.GenerateResponse.FINISH_EOS,
    "cancelled": pb.GenerateResponse.FINISH_CANCELLED,
    "monitor": pb.GenerateResponse.FINISH_MONITOR,
    "": pb.GenerateResponse.FINISH_UNSPECIFIED,
}


def request_from_pb(request: pb.GenerateRequest, session_id: str) -> GenerateRequest:
    return GenerateRequest(
        session_id=session_id,
        max_tokens=request.max_tokens,
        sampling=sampling_from_pb(request.sampling),
        prompt=np.asarray(request.prompt_ids, np.int64),
        at_step=request.at_step if request.HasField("at_step") else None,
        stop_ids=frozenset(request.stop_token_ids),
        generated_before=request.generated_before,
        prompt_text=request.prompt_text,
        stop=tuple(request.stop),
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs or request.top_logprobs > 0,
        top_logprobs=request.top_logprobs,
        rules=rules_from_pb(request),
    )


def sampling_from_pb(p: pb.SamplingParams) -> SamplingParams:
    """The proto's parameters; its zero defaults mean off (repetition_penalty 0 is 1, an
    unset penalty_last_n the default window)."""
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty or 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        penalty_last_n=(
            p.penalty_last_n if p.HasField("penalty_last_n") else DEFAULT_PENALTY_LAST_N
        ),
        logit_bias=tuple(sorted(p.logit_bias.items())),
    )


async def answer(
    generations: Generations,
    request: pb.GenerateRequest,
    scope: TenantScope,
    context: grpc.aio.ServicerContext,
    refusal: Callable[[], SsmserveError | None],
) -> AsyncIterator[pb.GenerateResponse]:
    """The responses of one Generate call."""
    started = time.perf_counter()
    at_step_error: GenerateAtStepError | None = None
    async with status.edge(context, scope.clean):
        if (refused := refusal()) is not None:
            raise refused
        try:
            generation = await generations.start(
                request_from_pb(request, scope.stored(request.session_id))
            )
        except GenerateAtStepError as exc:  # answered, with where the session is
            at_step_error = exc
    if at_step_error is not None:
        yield pb.GenerateResponse(
            stopped=status.step_error(at_step_error, scope.clean),
            session_step=at_step_error.session_step,
        )
        return
    task = asyncio.create_task(generation.run(), name="generate")
    meter = _Meter(generations.replay.store.metrics, generation.session.model_name, started)
    try:
        updates = generation.updates
        while True:
            batch = [await updates.get()]
            while not updates.empty() and len(batch) < TOKENS_PER_MESSAGE:
                batch.append(updates.get_nowait())
            response = _response(batch, scope)
            if response.tokens and not generation.session.lease.valid():
                # Decided as the tokens leave (``answer_fence``): the client resumes the
                # generation where its tokens stop, from the session's owner.
                lapsed = answer_fence.lapsed(request.session_id, response.tokens[0].step)
                await status.abort(context, lapsed, scope.clean)
            generation.handover.offer(response.session_step)  # the client may get it now
            yield response
            # Written to gRPC: the generation may take its next step (``handover``).
            generation.handover.hand(response.session_step)
            meter.handed(len(response.tokens))
            if isinstance(batch[-1], Finish):
                meter.finished(batch[-1].reason or "error")
                return
    finally:
        meter.finished("aborted")  # no-op once finished
        task.cancel()  # done, or the client went away: stop generating
        await asyncio.gather(task, return_exceptions=True)


class _Meter:
    """A Generate call's time to first token, time between tokens, tokens and finish
    reason (``observability.metrics``), measured as responses are handed to gRPC."""

    def __init__(self, metrics: Metrics, model: str, started: float) -> None:
        self.metrics, self.model, self.last = metrics, model, started
        self.first = True
        self.done = False

    def handed(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.first:
            m.time_to_first_token.labels(self.model).observe(now - self.last)
            if tokens > 1:
                m.inter_token_latency.labels(self.model).observe(0.0, tokens - 1)
            self.first = False
        else:
            m.inter_token_latency.labels(self.model).observe((now - self.last) / tokens, tokens)
        m.generation_tokens.labels(self.model).inc(tokens)
        self.last = now

    def finished(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.metrics.generations_finished.labels(self.model, reason).inc()


def _response(batch: list[Update], scope: TenantScope) -> pb.GenerateResponse:
    response = pb.GenerateResponse()
    for update in batch:
        if isinstance(update, Token):
            token = response.tokens.add(
                step=update.step,
                token_id=update.token,
                logprob=update.logprob,
                text=update.text,
                guard_events=[guard_event_to_pb(e) for e in update.guard_events],
            )
            if update.unfiltered_logprob is not None:
                token.unfiltered_logprob = update.unfiltered_logprob
            for top in update.top_logprobs:
                token.top_logprobs.add(token_id=top.token, logprob=top.logprob, text=top.text)
            response.session_step = update.step
        elif isinstance(update, Start):
            response.session_step = update.session_step
        elif isinstance(update, Fed):
            _add_fed(response, update)
        elif isinstance(update, Retraction):
            add_retraction(response, update)
        else:
            assert isinstance(update, Finish)
            response.session_step = update.session_step
            response.finish_reason = _FINISH[update.reason]
            response.stop_string = update.stop_string
            response.text = update.text
            if update.error is not None:
                response.stopped.CopyFrom(status.step_error(update.error, scope.clean))
    return response


def _add_fed(response: pb.GenerateResponse, fed: Fed) -> None:
    """``fed`` into ``response``: a later one (same message) moves the step on and trims
    the ids left that an earlier one carried."""
    if response.HasField("prompt_fed_step") and len(response.prompt_ids_left):
        taken = fed.session_step - response.prompt_fed_step
        del response.prompt_ids_left[:taken]
    elif fed.ids_left is not None:
        response.prompt_ids_left.extend(fed.ids_left.tolist())
    response.prompt_fed_step = fed.session_step
    response.session_step = fed.session_step
