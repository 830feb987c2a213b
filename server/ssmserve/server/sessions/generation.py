"""Generate: a token model fed its prompt, then its own seeded draws, step by step.

Every input Generate gives a session goes through the :class:`StepIntake` like a Stream
step: the session's numbering, input log, durability, guards, lease checks and batching
with every other step are the stepper's. So a generated token is logged before it is
answered, concurrent generations share engine calls, and rollback, fork, migration and
crash recovery replay a generation exactly.

The token of step ``s + 1`` is drawn from the (guarded) logits of step ``s`` with the key
``(seed, s)`` (``sampling.draw``): it depends on nothing but the request and the
session's history, so a retry draws the same tokens on any worker. A retry names the step
the client got to (``at_step``, with the prompt again if it got no token): the session's
logged inputs past it are checked to be this request's (the prompt's ids, then the tokens
its draws give) and answered again, and generation goes on from the session's step.

``Generations.start`` checks the request and reads where the session is, before anything
is queued: what is wrong with the request is raised there and the session is untouched.
``Generation.run`` then feeds the prompt (as runs of steps) and generates, putting each
token and finally the end on ``Generation.updates`` as soon as it is known.

A model served with a tokenizer has text in and out: ``prompt_text`` is encoded into the
prompt's ids, and each token carries the text it completes (``engine.detokenizer``: the
generated ids decoded on their own, whole characters only). A resumed generation rebuilds
the detokenizer from the tokens it generated before (the session's log), so its texts
are the ones an undisturbed call sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ssmserve.server.engine.tokenizer import ModelTokenizer
from ssmserve.server.errors import ErrorKind, SessionMovedError, SsmserveError
from ssmserve.server.sessions.constraints import GrammarTokenizers
from ssmserve.server.sessions.guards import GuardEvent
from ssmserve.server.sessions.guided_output import (
    Guide,
    OutputRules,
    Retraction,
    Verdict,
    prepare_guide,
    retract_to,
)
from ssmserve.server.sessions.handover import HANDOVER_BOUND_S, HandOver, take_back
from ssmserve.server.sessions.intake import StepIntake
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.logits import adjusted, logprobs, penalty_window
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.sampling import Draw, SamplingParams, draw
from ssmserve.server.sessions.session import (
    GuardRejectedError,
    GuardRolledBackError,
    Session,
    StepOutcome,
    StepRun,
)
from ssmserve.server.sessions.stopping import GeneratedText
from ssmserve.server.sessions.text_monitor import MonitorRejectedError

log = logging.getLogger(__name__)

#: Prompt steps queued at once (one run each): well inside a session's queue limit.
PROMPT_CHUNK = 512
MAX_STOP_IDS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20


class GenerateUnsupportedError(SsmserveError):
    """Generate needs a token model (FAILED_PRECONDITION for a signal model)."""

    kind = ErrorKind.FAILED_PRECONDITION


class BadGenerateRequestError(SsmserveError):
    """A Generate request out of range (INVALID_ARGUMENT): max_tokens, prompt, stop ids."""


class GenerateAtStepError(SsmserveError):
    """``at_step`` does not fit the session: it is behind it, its log no longer holds
    the steps after it, or they are not this generation's. ``session_step``: where the
    session is."""

    kind = ErrorKind.FAILED_PRECONDITION

    def __init__(self, message: str, session_step: int) -> None:
        super().__init__(message)
        self.session_step = session_step


class GenerateFailedError(SsmserveError):
    """A bug ended a generation (INTERNAL; the worker's log has its traceback)."""

    kind = ErrorKind.INTERNAL


class SessionSteppedError(SsmserveError):
    """A step Generate sent was already taken with another input: something else steps
    the session at the same time (FAILED_PRECONDITION)."""

    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class GenerateSettings:
    """Limits of one Generate call (documented defaults)."""

    max_tokens: int = 4096  # tokens per generation; more is INVALID_ARGUMENT
    max_prompt_ids: int = 65_536
    # prompt_text longer than this is refused before it is encoded (its ids are then
    # held to max_prompt_ids): the encoding's work stays bounded.
    max_prompt_chars: int = 1_048_576


@dataclass(frozen=True)
class GenerateRequest:
    session_id: str  # as stored
    max_tokens: int
    sampling: SamplingParams
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (n,) int64
    at_step: int | None = None
    stop_ids: frozenset[int] = frozenset()
    generated_before: int = 0
    prompt_text: str = ""
    stop: tuple[str, ...] = ()  # stop strings (models with a tokenizer)
    ignore_eos: bool = False  # True: the model's EOS ids do not end generation
    logprobs: bool = False  # each token carries its unfiltered logprob
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS most likely tokens per token (implies logprobs)
    rules: OutputRules | None = None  # a constraint, a text monitor (guided_output)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # after penalties and logit_bias, before temperature and filters
    text: str = ""  # models with a tokenizer: the token decoded on its own


@dataclass(frozen=True)
class Token:
    step: int  # the step this token is the input of
    token: int
    logprob: float
    guard_events: tuple[GuardEvent, ...] = ()
    # Models with a tokenizer: the text released at this token (the whole characters it
    # completes, less what may still begin a stop string: held back for a later token).
    text: str = ""
    unfiltered_logprob: float | None = None  # requested: after penalties and bias
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finish:
    """How a generation ended: ``reason`` length, stop, eos, cancelled or guard; ``error``
    set for a guard's verdict or a step that failed (the client follows a SESSION_MOVED).
    ``stop_string``: the stop string matched; ``text``: held-back text released with no
    token to carry it."""

    reason: str
    session_step: int
    error: SsmserveError | None = None
    stop_string: str = ""
    text: str = ""


@dataclass(frozen=True)
class Start:
    """The step generation starts from, once the prompt is fed: a retry with no token
    received goes on from here, without the prompt."""

    session_step: int


@dataclass(frozen=True)
class Fed:
    """Part of a long prompt is fed: the session took it up to ``session_step``. A retry
    goes on from there with the rest; ``ids_left`` (the first one of a ``prompt_text``):
    the encoded ids still to feed, which the client cannot know otherwise."""

    session_step: int
    ids_left: np.ndarray | None = None


Update = Start | Fed | Token | Finish | Retraction


class Generations:
    """Starts Generate calls on one worker's sessions."""

    def __init__(
        self,
        loader: SessionLoader,
        intake: StepIntake,
        replay: Replay,
        residents: ResidentSessions,
        settings: GenerateSettings,
        tokenizer_of: Callable[[str], ModelTokenizer | None] | None = None,
        eos_of: Callable[[str], tuple[int, ...]] | None = None,
    ) -> None:
        self.loader, self.intake, self.replay, self.residents = loader, intake, replay, residents
        self.settings = settings
        # A model's tokenizer (None: it has none, and prompt_text is refused): by default
        # the one served with it.
        self.tokenizer_of = tokenizer_of or loader.models.tokenizer
        # A model's end-of-sequence ids (generation_config.json / config.json / GGUF).
        self.eos_of = eos_of or loader.models.eos_ids
        self.grammar_tokenizers = GrammarTokenizers()  # constraints' view of tokenizers
        # The newest generation started on each session: a cancelled older one takes no
        # step back once a newer call (a retry) has resumed from what the session holds.
        self.latest: dict[str, Generation] = {}

    async def start(self, request: GenerateRequest) -> Generation:
        """A generation ready to run, or the error that refuses it (session untouched)."""
        self._check_request(request)
        s = await self.loader.session(request.session_id)
        c = s.model.config
        if not c.is_token_model:
            raise GenerateUnsupportedError(
                f"model {s.model_name!r} takes float vectors: Generate needs a token model "
                f"(use Forecast to run a signal model ahead)"
            )
        tokenizer = self.tokenizer_of(s.model_name)
        if request.stop and tokenizer is None:
            raise BadGenerateRequestError(
                f"stop: model {s.model_name!r} has no tokenizer, so stop strings cannot be "
                f"matched; give stop_token_ids (or serve the model with its tokenizer.json)"
            )
        if request.prompt_text:
            request = await self._encoded(request, s.model_name, tokenizer)
        bias_ids = np.fromiter((t for t, _ in request.sampling.logit_bias), np.int64)
        ids = np.concatenate([request.prompt, np.fromiter(request.stop_ids, np.int64), bias_ids])
        outside = (ids < 0) | (ids >= c.vocab_size)
        if outside.any():
            bad = int(ids[np.argmax(outside)])
            raise BadGenerateRequestError(
                f"token id {bad} (prompt, stop ids or logit_bias) is outside "
                f"[0, {c.vocab_size}) of model {s.model_name!r}"
            )
        eos = frozenset() if request.ignore_eos else frozenset(self.eos_of(s.model_name))
        guide = await prepare_guide(
            request.rules, tokenizer, c.vocab_size, s.model_name,
            request.sampling.temperature, self.grammar_tokenizers,
        )  # fmt: skip
        generation = Generation(self, s, request, tokenizer, eos, guide)
        self.latest[s.id] = generation
        try:
            await generation.resume()
        except BaseException:
            if self.latest.get(s.id) is generation:
                del self.latest[s.id]
            raise
        return generation

    async def _encoded(
        self, request: GenerateRequest, model: str, tokenizer: ModelTokenizer | None
    ) -> GenerateRequest:
        """``request`` with its prompt_text encoded into its prompt ids."""
        if tokenizer is None:
            raise BadGenerateRequestError(
                f"model {model!r} has no tokenizer.json, so prompt_text cannot be encoded; "
                f"send the prompt as prompt_ids (or serve the model from a directory that "
                f"holds its tokenizer.json)"
            )
        # Off the event loop: a long text takes milliseconds to encode.
        ids = await asyncio.to_thread(tokenizer.encode, request.prompt_text)
        if len(ids) > self.settings.max_prompt_ids:
            raise BadGenerateRequestError(
                f"prompt_text encodes to {len(ids)} ids, over this server's limit of "
                f"{self.settings.max_prompt_ids}; feed the rest with Stream first"
            )
        return replace(request, prompt=ids)

    def _check_request(self, r: GenerateRequest) -> None:
        limit = self.settings.max_tokens
        if not 1 <= r.max_tokens <= limit:
            raise BadGenerateRequestError(
                f"max_tokens must be in 1..{limit} (this server's limit), got {r.max_tokens}"
            )
        if r.generated_before >= r.max_tokens:
            raise BadGenerateRequestError(
                f"generated_before ({r.generated_before}) must be below max_tokens "
                f"({r.max_tokens}): that generation is complete"
            )
        if len(r.prompt) > self.settings.max_prompt_ids:
            raise BadGenerateRequestError(
                f"a prompt of {len(r.prompt)} ids is over this server's limit of "
                f"{self.settings.max_prompt_ids}; feed the rest with Stream first"
            )
        if r.prompt_text and len(r.prompt):
            raise BadGenerateRequestError("give prompt_ids or prompt_text, not both")
        if len(r.prompt_text) > self.settings.max_prompt_chars:
            raise BadGenerateRequestError(
                f"a prompt_text of {len(r.prompt_text)} characters is over this server's "
                f"limit of {self.settings.max_prompt_chars}; feed the rest with Stream first"
            )
        if len(r.stop_ids) > MAX_STOP_IDS:
            raise BadGenerateRequestError(f"at most {MAX_STOP_IDS} stop ids, got {len(r.stop_ids)}")
        if len(r.stop) > MAX_STOP_STRINGS:
            raise BadGenerateRequestError(
                f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(r.stop)}"
            )
        for text in r.stop:
            if not 1 <= len(text) <= MAX_STOP_STRING_CHARS:
                raise BadGenerateRequestError(
                    f"stop: each stop string must be 1..{MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(text)}"
                )
        if not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadGenerateRequestError(
                f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {r.top_logprobs}"
            )
        r.sampling.check()


class Generation:
    """One Generate call on one session: ``resume`` (in ``Generations.start``) reads
    where the session is; ``run`` feeds and generates onto ``updates``."""

    def __init__(
        self,
        parent: Generations,
        s: Session,
        request: GenerateRequest,
        tokenizer: ModelTokenizer | None = None,
        eos: frozenset[int] = frozenset(),
        guide: Guide | None = None,
    ) -> None:
        self.parent, self.session, self.request = parent, s, request
        self.guide = guide  # the request's constraint and text monitor (None: neither)
        self.tokenizer, self.eos = tokenizer, eos
        # The texts of this generation's tokens (None: the model has no tokenizer).
        self.text = (
            None if tokenizer is None else GeneratedText(tokenizer.decode, request.stop, eos)
        )
        self.updates: asyncio.Queue[Update] = asyncio.Queue()
        # The sender says which tokens it handed to gRPC: a step is taken only once the
        # token before it was handed, so a cancelled call leaves at most one token the
        # client was not handed, and that one is taken back (``_cancelled``).
        self.handover = HandOver()
        self.step = 0  # the step the session is at after what was fed so far
        self.output: np.ndarray | None = None  # the logits of ``step``, once known
        self.prompt_left = request.prompt  # prompt ids not yet fed
        self.count = request.generated_before  # tokens of this generation so far
        self.resent: list[Token] = []  # tokens past at_step, answered again from the log
        # The penalties' window: the session's inputs up to ``step`` (None: no penalties).
        self.window: deque[int] | None = None
        self.pending: Token | None = None  # the token of the step taken last (or being)
        self.in_flight: asyncio.Future[StepOutcome] | None = None  # its step, unanswered
        self.ended: Finish | None = None  # a retry after the generation's last token
        self.resent_verdict = Verdict.GOES_ON  # the guide's verdict on the last resent token
        self.rejected_step: int | None = None  # a resent step the text monitor rejects

    async def resume(self) -> None:
        """Where the session is against ``at_step``: the part of the prompt still to feed,
        or the tokens it generated past it (checked to be this generation's draws)."""
        s, r = self.session, self.request
        async with self.parent.residents.hold(s, read_only=True):
            t = s.step
            self.output = s.recent.output_at(t)
        self.step = t
        at = t if r.at_step is None else r.at_step
        if at > t:
            raise GenerateAtStepError(
                f"session {s.id!r} is at step {t}, behind at_step {at} (it came back from the "
                f"store behind steps that were answered, or was rolled back)",
                t,
            )
        if r.sampling.penalized and r.sampling.penalty_last_n:
            self.window = await penalty_window(self.parent.replay, s, at, r.sampling.penalty_last_n)
        if self.guide is not None and r.generated_before:  # before the tokens past at
            await self._rebuild_guide(at, r.generated_before)
        n = len(r.prompt)
        ahead = t - at
        if ahead:
            logged = await self._logged(at, t)
            fed = min(n, ahead)
            if not np.array_equal(logged[:fed], r.prompt[:fed]):
                raise GenerateAtStepError(
                    f"the inputs of session {s.id!r} after step {at} are not this request's "
                    f"prompt: something else stepped it; generate from its step {t}",
                    t,
                )
            self._saw(logged[:fed])
            self.prompt_left = r.prompt[fed:]
            if ahead > n:
                await self._resend(at + n, logged[n:])
        if self.text is not None and r.generated_before:
            await self._rebuild_texts(at, r.generated_before)
        if r.generated_before and not ahead and at:
            self.ended = await self._ended_at(at)
        if t == 0 and not len(self.prompt_left):
            raise GenerateAtStepError(
                f"session {s.id!r} is at step 0 and has no logits to draw from yet; send a "
                f"prompt (prompt_ids)",
                0,
            )

    async def _ended_at(self, at: int) -> Finish | None:
        """A retry from the generation's last token, if that token ended it (a stop id,
        EOS, a completed stop string: its finish was cut off): that Finish, not more
        tokens."""
        s, r = self.session, self.request
        token = int(s.codec.decode_many(await self.parent.replay.inputs(s, at, at))[0])
        if self.text is not None and self.text.stop_string:
            return Finish("stop", at, stop_string=self.text.stop_string)
        if token in r.stop_ids:
            return Finish("stop", at)
        if token in self.eos:
            return Finish("eos", at)
        return None

    async def _rebuild_texts(self, at: int, before: int) -> None:
        """Feed the detokenizer this generation's tokens up to ``at`` (steps
        ``at - before + 1 ..``, from the log) so it sends the texts an undisturbed call
        would. A log that no longer reaches the generation's start gives what it keeps."""
        assert self.text is not None
        s = self.session
        first = max(at - before, 0)
        _count, oldest = await self.parent.replay.store.snapshot_count_and_oldest(s.id)
        if oldest is None or at <= oldest:
            return  # nothing logged to rebuild from: texts start afresh
        first = max(first, oldest)
        tokens = s.codec.decode_many(await self.parent.replay.inputs(s, first + 1, at))
        self.text.skip([int(t) for t in tokens])

    async def _rebuild_guide(self, at: int, before: int) -> None:
        """Feed the guide this generation's tokens up to ``at`` (steps
        ``at - before + 1 ..``, from the log, else the request's ``generated_ids``): the
        masks and verdicts go on as an undisturbed call's. Neither: GenerateAtStepError."""
        assert self.guide is not None and self.request.rules is not None
        given = self.request.rules.generated
        try:
            tokens = [int(t) for t in await self._logged(at - before, at)]
        except GenerateAtStepError:
            if len(given) != before:  # a fork, a trimmed log: the client's tokens
                raise
            tokens = list(given)
        if not self.guide.rebuild(tokens, self.eos):
            raise GenerateAtStepError(
                f"the tokens of session {self.session.id!r} up to step {at} are not this "
                f"generation's (its constraint or text monitor refuses them, or monitor_retries "
                f"is not the count of retractions received); generate from its step {self.step}",
                self.step,
            )

    async def _retract(self) -> Finish | None:
        """The text monitor rejected the token of ``self.step``: the session is rolled
        back over it and the tokens before it the monitor takes back, the retraction
        sent; past max_retries, the Finish (the rejected token taken back alone)."""
        assert self.guide is not None
        r, self.pending = self.request, None
        try:
            back, error = self.guide.retract(), None
        except MonitorRejectedError as exc:
            back, error = 1, exc
        to = self.step - back
        replay = self.parent.replay
        self.output = await retract_to(replay, self.session, to, self.guide.retries)
        self.step, self.count = to, self.count - (back - 1)
        if self.window is not None:
            n = r.sampling.penalty_last_n
            self.window = await penalty_window(replay, self.session, to, n)
        if self.text is not None and back > 1:  # the texts of the tokens kept, again
            assert self.tokenizer is not None
            self.text = GeneratedText(self.tokenizer.decode, r.stop, self.eos)
            self.text.skip(self.guide.tokens)
        if error is not None:
            return Finish("monitor", to, error, text=self._flushed())
        self.updates.put_nowait(Retraction(to, self.guide.retries))
        return None

    async def _logged(self, at: int, t: int) -> np.ndarray:
        return await logged_inputs(self.parent.replay, self.session, at, t)

    async def _resend(self, start: int, tokens: np.ndarray) -> None:
        """The tokens of steps ``start + 1 ..``, generated before this call: each checked
        to be what this generation draws there, then kept to be answered first."""
        s, r = self.session, self.request
        outputs = await self._outputs(start, start + len(tokens) - 1)
        for i, token in enumerate(tokens.tolist()):
            step = start + i  # the step whose logits drew it
            drawn = self._draw(step, outputs[i])
            if drawn.token != token:
                raise GenerateAtStepError(
                    f"step {step + 1} of session {s.id!r} took token {token}, not "
                    f"{drawn.token} that this generation draws there: something else stepped "
                    f"it; generate from its step {self.step}",
                    self.step,
                )
            if self.guide is not None:  # the verdict it had: the last one resent ends there
                self.resent_verdict = self.guide.after(token, self.eos)
                if self.resent_verdict is Verdict.REJECTED:  # cut before it was retracted
                    self.resent_verdict, self.rejected_step = Verdict.GOES_ON, step + 1
                    break
            self.resent.append(drawn)
            self._saw([token])
            ends = token in r.stop_ids or token in self.eos
            if self.count + len(self.resent) >= r.max_tokens or ends:
                break
            if self.resent_verdict is Verdict.COMPLETE:
                break

    def _draw(self, step: int, output: np.ndarray) -> Token:
        """The token this generation draws from ``output``, the logits of ``step`` (as
        the token of step ``step + 1``, with its logprobs when asked for)."""
        r = self.request
        z = output if self.window is None else adjusted(output, r.sampling, self.window)
        seed = r.sampling.seed
        if self.guide is not None:  # the constraint's mask; the seed after the rejections
            z, seed = self.guide.logits(z, self.eos), self.guide.seed(seed)
        d: Draw = draw(r.sampling, (seed, step), z)
        if not r.logprobs:
            return Token(step + 1, d.token, d.logprob)
        lp = logprobs(z, d.token, r.top_logprobs)
        top = tuple(TokenLogprob(i, p, self._decoded(i)) for i, p in lp.top)
        return Token(step + 1, d.token, d.logprob, unfiltered_logprob=lp.chosen, top_logprobs=top)

    def _decoded(self, token: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token])

    def _saw(self, inputs: np.ndarray | list[int]) -> None:
        """The penalties' window after the session takes ``inputs``."""
        if self.window is not None:
            self.window.extend(int(t) for t in inputs)

    async def _outputs(self, first: int, last: int) -> list[np.ndarray]:
        return await logged_outputs(self.parent.replay, self.session, first, last, self.step)

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Feed what is left of the prompt, then generate; every update goes on
        ``updates``, the last a :class:`Finish`. Cancelled (the client went away), a
        step taken whose token was not handed to the client is taken back."""
        try:
            finish = await self._run()
        except asyncio.CancelledError:
            await _take_back_cancelled(self)
            raise
        except SsmserveError as exc:  # a prompt step's, or logits that cannot be drawn from
            finish = self._stopped(exc)
        except Exception as exc:  # a bug: logged here, the client told no more than that
            log.error("generate: internal error", exc_info=exc)
            failed = GenerateFailedError(f"internal error ({type(exc).__name__})")
            finish = Finish("", self.step, failed)
        finally:
            if self.parent.latest.get(self.session.id) is self:
                del self.parent.latest[self.session.id]
        self.updates.put_nowait(finish)

    async def _run(self) -> Finish:
        if self.ended is not None:
            return self.ended
        for token in self.resent:
            if (finish := self._emit(token)) is not None:
                return finish
        if self.resent:
            self.step = self.resent[-1].step
        if self.resent_verdict is Verdict.COMPLETE:
            return Finish("stop", self.step, text=self._flushed())
        if self.rejected_step is not None:
            self.step = self.rejected_step
            if (finish := await self._retract()) is not None:
                return finish
        if len(self.prompt_left):
            await self._feed(self.prompt_left)
        self.updates.put_nowait(Start(self.step))
        if self.output is None:  # not in memory: replayed
            self.output = await self.parent.replay.output_at(self.session, self.step)
        self.handover.hand(self.step)  # what came before this call's first draw
        while True:
            drawn = self._draw(self.step, self.output)
            if not await self.handover.handed(self.step, HANDOVER_BOUND_S):
                return Finish("cancelled", self.step, text=self._flushed())
            self.pending = drawn
            outcome = await self._submit(self.step + 1, drawn.token)
            if outcome.error is not None:
                return self._stopped(outcome.error)
            self.step += 1
            self.output = outcome.output
            verdict = Verdict.GOES_ON
            if self.guide is not None:
                verdict = self.guide.after(drawn.token, self.eos)
                if verdict is Verdict.REJECTED:
                    if (finish := await self._retract()) is not None:
                        return finish
                    continue
            self._saw([drawn.token])
            if (
                finish := self._emit(replace(drawn, guard_events=outcome.guard_events))
            ) is not None:
                return finish
            if verdict is Verdict.COMPLETE:  # the constraint or monitor allows no more
                return Finish("stop", self.step, text=self._flushed())

    def _emit(self, token: Token) -> Finish | None:
        """Put ``token`` on ``updates`` with the text it releases; the Finish it makes
        (a stop rule or max_tokens), or None: generation goes on."""
        r = self.request
        self.count += 1
        ends = token.token in r.stop_ids or token.token in self.eos or self.count >= r.max_tokens
        stop_string = ""
        if self.text is not None:
            released = self.text.add(token.token, last=ends)
            token, stop_string = replace(token, text=released.text), released.stop_string
        self.updates.put_nowait(token)
        if stop_string:
            return Finish("stop", token.step, stop_string=stop_string)
        if token.token in r.stop_ids:
            return Finish("stop", token.step)
        if token.token in self.eos:
            return Finish("eos", token.step)
        if self.count >= r.max_tokens:
            return Finish("length", token.step)
        return None

    def _flushed(self) -> str:
        return "" if self.text is None else self.text.flush()

    def _stopped(self, error: SsmserveError) -> Finish:
        if isinstance(error, GuardRolledBackError):
            return Finish("guard", self.session.step, error, text=self._flushed())
        if isinstance(error, GuardRejectedError):
            return Finish("guard", self.step, error, text=self._flushed())
        if isinstance(error, SessionMovedError):  # the worker drains or stops: resume there
            return Finish("cancelled", self.step, error)
        return Finish("", self.step, error)

    async def _submit(self, step: int, token: int) -> StepOutcome:
        """Step ``step`` with input ``token``, through the intake like a Stream step."""
        intake, sid = self.parent.intake, self.session.id
        try:
            future = intake.submit_resident(sid, step, token)
            if future is None:
                future = await intake.submit(sid, step, token)
        except SsmserveError as exc:
            return StepOutcome(sid, step, error=exc)
        # Shielded: a cancelled call leaves the step queued, and ``_cancelled`` waits for
        # its outcome before it takes it back.
        self.in_flight = future
        outcome = await asyncio.shield(future)
        self.in_flight = None
        if outcome.replayed and outcome.error is None:
            self._check_same(step, np.asarray([token], np.int64))
        return outcome

    async def _feed(self, prompt: np.ndarray) -> None:
        """The prompt's ids as steps ``self.step + 1 ..``, in runs; the logits of its last
        step become ``self.output``. A failed step raises its error."""
        for lo in range(0, len(prompt), PROMPT_CHUNK):
            chunk = prompt[lo : lo + PROMPT_CHUNK]
            first = self.step + 1
            # Only the last step's logits are read: the run computes no other output
            # (a prefill at matrix speed computes the head for that row alone).
            future = await self.parent.intake.submit_run(
                self.session.id, first, chunk, last_only=True
            )
            if future is not None:
                run = await future
                output = self._run_result(run, chunk)
            else:  # not resident now (moved, evicted) or its queue is full: one by one
                for i, token in enumerate(chunk.tolist()):
                    outcome = await self._submit(first + i, token)
                    if outcome.error is not None:
                        raise outcome.error
                    output = outcome.output
            self.step += len(chunk)
            self.output = output
            self._saw(chunk)
            rest = prompt[lo + PROMPT_CHUNK :]
            if len(rest):  # progress a client's stall bound sees, and a retry resumes from
                text = self.request.prompt_text and lo == 0
                self.updates.put_nowait(Fed(self.step, rest.copy() if text else None))

    def _run_result(self, run: StepRun, chunk: np.ndarray) -> np.ndarray | None:
        """The last output of a prompt run; raises the error of its first failed step."""
        for i, outcome in enumerate(run.outcomes):
            if outcome is None:
                continue
            if outcome.error is not None:
                raise outcome.error
            if outcome.replayed:
                self._check_same(run.first + i, chunk[i : i + 1])
        last = run.outcomes[-1]
        if last is not None:
            return last.output
        return None if run.outputs is None else run.outputs[-1]

    def _check_same(self, step: int, value: np.ndarray) -> None:
        """A step answered as a resend (already taken) must have been taken with this
        input: this generation's own earlier attempt, not another client's step."""
        s = self.session
        if s.recent.input_at(step) != s.codec.encode(value[0]):
            raise SessionSteppedError(
                f"step {step} of session {s.id!r} was already taken with another input (or "
                f"one no longer in memory to compare): something else steps this session "
                f"while it generates; generate again from its current step"
            )


async def _take_back_cancelled(g: Generation) -> None:
    """The step of the last token drawn, if taken but not handed to the client, taken
    back by the session's rollback path (bounded)."""
    drawn = g.pending
    if drawn is None or drawn.step <= max(g.handover.last, g.handover.offered):
        return
    try:
        if g.in_flight is not None:  # queued: it lands after the cancel unless awaited
            await asyncio.wait_for(asyncio.shield(g.in_flight), HANDOVER_BOUND_S)
        if g.parent.latest.get(g.session.id) is not g:
            return  # a retry resumed from the session meanwhile: the step is its now
        await asyncio.wait_for(
            take_back(g.parent.replay, g.session, drawn.step, drawn.token),
            HANDOVER_BOUND_S,
        )
    except (SsmserveError, TimeoutError) as exc:
        log.warning(
            "generate: session %s: step %d, taken for a cancelled call, stays (%s)",
            g.session.id, drawn.step, exc,
        )  # fmt: skip


async def logged_inputs(replay: Replay, s: Session, at: int, t: int) -> np.ndarray:
    """The session's inputs of steps ``at + 1 .. t`` from its log (or memory);
    GenerateAtStepError when the log no longer reaches back to ``at``."""
    _count, oldest = await replay.store.snapshot_count_and_oldest(s.id)
    if oldest is None or at < oldest:
        raise GenerateAtStepError(
            f"session {s.id!r} no longer holds the inputs after step {at} (its oldest "
            f"kept snapshot is at step {oldest}); generate from its step {t}",
            t,
        )
    return s.codec.decode_many(await replay.inputs(s, at + 1, t))


async def logged_outputs(
    replay: Replay, s: Session, first: int, last: int, step: int
) -> list[np.ndarray]:
    """The (guarded) logits of steps ``first..last``: memory, else replayed;
    GenerateAtStepError (with ``step``, where the generation is) when they cannot be."""
    held = [s.recent.output_at(at) for at in range(first, last + 1)]
    if all(o is not None for o in held):
        return held  # type: ignore[return-value]
    record = await replay.store.snapshot_at_or_before(s.id, first)
    rebuilt = None if record is None else await replay.rebuild(s, last, record)
    found: dict[int, np.ndarray | None] = {}
    if rebuilt is not None:
        found = {rebuilt.record.step + 1 + i: o for i, o in enumerate(rebuilt.outputs)}
        found.setdefault(rebuilt.record.step, rebuilt.checkpoint.output)
    outputs = [found.get(at) for at in range(first, last + 1)]
    if any(o is None for o in outputs):
        raise GenerateAtStepError(
            f"the logits of steps {first}..{last} of session {s.id!r} can no longer be "
            f"rebuilt; generate from its step {step}",
            step,
        )
    return outputs  # type: ignore[return-value]
