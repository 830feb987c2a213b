"""A generation's output rules at work: its constraint's mask before each draw, its text
monitor's verdict after it (``constraints``, ``text_monitor``).

:func:`prepare_guide` checks and compiles the rules before anything is queued (a bad
schema, regex or grammar, or a model without a tokenizer: BadConstraintError); the
:class:`Guide` then follows the generation's tokens: ``rebuild`` with the tokens it drew
before a resumed call (from the session's log), ``logits`` and ``seed`` for each draw,
``after`` each token applied, ``retract`` when the monitor rejected one.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

import numpy as np

from ssmserve.server.engine.tokenizer import ModelTokenizer
from ssmserve.server.sessions.constraints import (
    BadConstraintError,
    Constraint,
    GrammarTokenizers,
    TokenMatcher,
    compile_constraint,
    masked,
)
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.events import record as record_events
from ssmserve.server.sessions.records import RollbackTarget
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.session import Session
from ssmserve.server.sessions.text_monitor import TextMonitor, TextWatch, attempt_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputRules:
    """What a Generate request asks of its output (each None: none)."""

    constraint: Constraint | None = None
    monitor: TextMonitor | None = None
    monitor_retries: int = 0  # a resumed call: the retractions it received
    # A resumed call: the tokens it received, for a session whose log no longer holds them
    generated: tuple[int, ...] = ()


@dataclass(frozen=True)
class Retraction:
    """The text monitor rejected a token: the session is back at ``step`` and the tokens
    after it are withdrawn; ``retries``: the rejections so far."""

    step: int
    retries: int


class Verdict(enum.Enum):
    GOES_ON = "goes_on"
    COMPLETE = "complete"  # the output is complete and nothing may follow: stop here
    REJECTED = "rejected"  # the monitor rejected the token: retract


class Guide:
    """The constraint's matcher and the monitor's watch over one generation's tokens."""

    def __init__(
        self, matcher: TokenMatcher | None, watch: TextWatch | None, attempt: int = 0
    ) -> None:
        self.matcher, self.watch = matcher, watch
        self.attempt = attempt  # without a monitor: the request's attempt, fixed
        self.tokens: list[int] = []  # this generation's tokens, as far as it goes now

    def rebuild(self, tokens: list[int], end_ids: frozenset[int]) -> bool:
        """Follow ``tokens``, this generation's before a resumed call; False when the
        constraint refuses them (they are not this generation's) or the monitor rejected
        one (never answered: the generation was cut before it retracted it)."""
        return all(self.after(token, end_ids) is not Verdict.REJECTED for token in tokens)

    def logits(self, logits: np.ndarray, end_ids: frozenset[int]) -> np.ndarray:
        """``logits`` with what the constraint does not allow next at -Inf. The mask
        commutes with the penalties and logit_bias (-Inf stays -Inf through them), so the
        draw sees the masked logits after them."""
        if self.matcher is None:
            return logits
        return masked(logits, self.matcher.allowed(end_ids))

    def seed(self, seed: int) -> int:
        """The seed of the next draw: ``seed``'s attempt after the rejections so far."""
        return attempt_seed(seed, self.retries)

    @property
    def retries(self) -> int:
        return self.attempt if self.watch is None else self.watch.retries

    def after(self, token: int, end_ids: frozenset[int]) -> Verdict:
        """Follow ``token`` (drawn and applied): the monitor's verdict, else whether the
        constraint is complete."""
        if self.watch is not None and not self.watch.accepts(token, end_ids):
            return Verdict.REJECTED
        self.tokens.append(token)
        if self.matcher is not None:
            taken = self.matcher.ends(token) if token in end_ids else self.matcher.consume(token)
            if not taken:  # a masked draw cannot be refused: a resent token, not ours
                return Verdict.REJECTED
            if self.matcher.complete:
                return Verdict.COMPLETE
        if self.watch is not None and self.watch.complete:
            return Verdict.COMPLETE
        return Verdict.GOES_ON

    def retract(self) -> int:
        """Count a rejection of the token just drawn (not followed); how many tokens to
        take back, that one included. Raises MonitorRejectedError past max_retries."""
        assert self.watch is not None
        back = self.watch.retract(len(self.tokens) + 1)
        if back > 1:
            if self.matcher is not None:
                self.matcher.rollback(back - 1)
            del self.tokens[len(self.tokens) - (back - 1) :]
        return back


async def prepare_guide(
    rules: OutputRules | None,
    tokenizer: ModelTokenizer | None,
    vocab_size: int,
    model: str,
    temperature: float,
    tokenizers: GrammarTokenizers,
) -> Guide | None:
    """The guide of ``rules`` for a model (None: no rules), or BadConstraintError: a
    schema, regex or grammar llguidance refuses, a monitor out of range, a model without
    a tokenizer. Compiled off the event loop (a large schema takes milliseconds)."""
    if rules is None or (rules.constraint is None and rules.monitor is None):
        # monitor_retries alone: the draws of the caller's own monitor after as many
        # rejections (``ssmserve.client.monitored``)
        return (
            None
            if rules is None or not rules.monitor_retries
            else Guide(None, None, rules.monitor_retries)
        )
    if tokenizer is None:
        raise BadConstraintError(
            f"model {model!r} has no tokenizer.json, so its output cannot be constrained or "
            f"monitored as text; serve it from a directory that holds its tokenizer.json"
        )
    monitor = None if rules.monitor is None else rules.monitor.checked(temperature)

    def compiled() -> Guide:
        grammar_tokenizer = tokenizers.get(tokenizer, vocab_size)
        matcher = None
        if rules.constraint is not None:
            matcher = compile_constraint(rules.constraint, grammar_tokenizer).matcher()
        watch = None
        if monitor is not None:
            # a monitor reads what the model wrote: JSON's whitespace is fine there
            check = compile_constraint(monitor.check, grammar_tokenizer, compact=False)
            watch = TextWatch(monitor, check, rules.monitor_retries)
        return Guide(matcher, watch)

    return await asyncio.to_thread(compiled)


async def retract_to(replay: Replay, s: Session, step: int, retries: int) -> np.ndarray:
    """Roll ``s`` back to ``step`` for the text monitor, through the session's rollback
    path (``Replay.resolve`` and ``Replay.restore_to``, as the Rollback RPC does; recorded
    as a rollback with cause ``text_monitor``); the (guarded) logits of that step."""
    async with replay.residents.hold(s):
        target, record = await replay.resolve(s, RollbackTarget(step=step), "retract")
        before = s.step
        await replay.restore_to(s, target, record)
        event = SessionEvent.rollback(before, target, "text_monitor", f"retry {retries}")
        await record_events(replay.store, s.lease, [event])
        output = s.recent.output_at(target)
    log.info(
        "session %s: the text monitor rejected step %d: rolled back to step %d", s.id,
        before, target,
        extra={"session_id": s.id, "step": target, "event": "rolled_back",
               "cause": "text_monitor"},
    )  # fmt: skip
    return output if output is not None else await replay.output_at(s, target)
