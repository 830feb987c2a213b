"""The blocking client's Generate (:class:`~ssmserve.client.sync.Client` inherits it, as
``AsyncClient`` inherits ``generation.AsyncGenerateCalls``); it iterates the async one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from ssmserve.client.aio import AsyncClient
from ssmserve.client.generation import GeneratedToken
from ssmserve.client.step_values import SessionRef
from ssmserve.v1 import ssmserve_pb2 as pb

T = TypeVar("T")


class GenerateCalls:
    """Generate: a token model's session fed a prompt, then its own seeded draws."""

    _aio: AsyncClient

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        raise NotImplementedError  # Client's

    def generate(
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
    ) -> Iterator[GeneratedToken]:
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
        return self._iterate(
            self._aio.generate(
                session,
                max_tokens,
                prompt_ids=prompt_ids,
                prompt_text=prompt_text,
                at_step=at_step,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                seed=seed,
                stop_token_ids=stop_token_ids,
                stop=stop,
                ignore_eos=ignore_eos,
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                penalty_last_n=penalty_last_n,
                logit_bias=logit_bias,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                take_back_on_close=take_back_on_close,
                constraint=constraint,
                monitor=monitor,
                monitor_retries=monitor_retries,
            )
        )

    def generate_text(
        self, session: SessionRef, max_tokens: int, *, prompt_text: str = "", **options: Any
    ) -> str:
        """The text ``generate`` gives (its tokens' texts joined): a model served with a
        tokenizer; ``options`` as ``generate``'s."""
        parts: list[tuple[int, str]] = []
        for t in self.generate(session, max_tokens, prompt_text=prompt_text, **options):
            if t.retracted_after_step is not None:  # a text monitor withdrew the later ones
                parts = [p for p in parts if p[0] <= t.retracted_after_step]
            parts.append((t.step, t.text))
        return "".join(text for _, text in parts)
