"""A text monitor: a check over a generation's whole output so far, that rolls the
session back and resamples when it rejects.

The check is a regex or a JSON schema (llguidance, as ``constraints``): after every token,
the output so far must still be able to become a match (regex), or a prefix of a valid
document (JSON schema); an end-of-sequence id is accepted only where the output is
complete. Unlike a constraint, it does not mask the draw: the token is drawn and applied
as any other, then judged; a rejected one is retracted.

On a rejection the session is rolled back ``rollback_tokens`` tokens (the rejected one
and those before it, never past the generation's first token) through the session's
Rollback (the same path as the RPC), and generation goes on from there with the next
attempt of the seed: every draw after the ``a``-th rejection uses the key
``(attempt_seed(seed, a), step)``. So every token is a pure function of the request, the
step and how many rejections came before it, and a resumed call that says how many it
saw (``monitor_retries``) draws the same tokens. After ``max_retries`` rejections the
generation ends with finish reason MONITOR and a :class:`MonitorRejectedError`.

A monitor resamples, so it needs temperature > 0: a greedy draw would take the rejected
token again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.sessions.constraints import (
    BadConstraintError,
    CompiledConstraint,
    Constraint,
    TokenMatcher,
)

#: The server's cap on a request's ``max_retries``.
MAX_MONITOR_RETRIES = 64
#: The furthest back one rejection may roll.
MAX_ROLLBACK_TOKENS = 4096
DEFAULT_MAX_RETRIES = 8
_U64 = (1 << 64) - 1


class MonitorRejectedError(SsmserveError):
    """The text monitor rejected the output more than ``max_retries`` times: the
    generation ended at the last accepted token (FAILED_PRECONDITION)."""

    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class TextMonitor:
    """A request's monitor: ``check`` (kind ``regex`` or ``json_schema``), how many tokens
    a rejection takes back, and how many rejections end the generation."""

    check: Constraint
    rollback_tokens: int = 1
    max_retries: int = DEFAULT_MAX_RETRIES

    def checked(self, temperature: float) -> TextMonitor:
        """This monitor, or BadConstraintError naming what is out of range."""
        if self.check.kind not in ("regex", "json_schema"):
            raise BadConstraintError(
                f"a text monitor checks a regex or a json_schema, got {self.check.kind!r}"
            )
        if not 1 <= self.rollback_tokens <= MAX_ROLLBACK_TOKENS:
            raise BadConstraintError(
                f"rollback_tokens must be in 1..{MAX_ROLLBACK_TOKENS}, got {self.rollback_tokens}"
            )
        if not 0 <= self.max_retries <= MAX_MONITOR_RETRIES:
            raise BadConstraintError(
                f"max_retries must be in 0..{MAX_MONITOR_RETRIES} (this server's cap), got "
                f"{self.max_retries}"
            )
        if temperature == 0.0:
            raise BadConstraintError(
                "a text monitor resamples after a rejection: it needs temperature > 0 (a "
                "greedy draw takes the same token again); use a constraint to steer a greedy "
                "generation"
            )
        return self


def attempt_seed(seed: int, attempt: int) -> int:
    """The seed of the draws after ``attempt`` rejections: ``seed`` itself for 0, else the
    first 64-bit output of Philox4x64-10 keyed ``(seed, attempt)`` at counter 1 (a draw's
    variate is counter 0, so no seed's attempt reuses a draw's variate)."""
    if attempt == 0:
        return seed
    key = np.array([seed & _U64, attempt & _U64], np.uint64)
    generator = np.random.Philox(key=key, counter=np.array([1, 0, 0, 0], np.uint64))
    return int(generator.random_raw())


class TextWatch:
    """One generation's monitor at work: the output so far in its matcher, the
    rejections so far, and the verdict on each new token."""

    def __init__(
        self, monitor: TextMonitor, compiled: CompiledConstraint, retries: int = 0
    ) -> None:
        self.monitor = monitor
        self.matcher: TokenMatcher = compiled.matcher()
        self.retries = retries  # rejections so far (a resumed call: the client's count)

    def seed(self, seed: int) -> int:
        """The seed of the next draw."""
        return attempt_seed(seed, self.retries)

    def rebuild(self, tokens: list[int]) -> bool:
        """Feed the generation's tokens before a resumed call; False when the output
        they make was rejected already (the resumed call retracts it)."""
        return self.matcher.consume_all(tokens) == len(tokens)

    def accepts(self, token: int, end_ids: frozenset[int]) -> bool:
        """Judge ``token`` after the output so far; accepted tokens are added to it. An
        id of ``end_ids`` is accepted where the output is complete."""
        if token in end_ids:
            return self.matcher.ends(token)
        return self.matcher.consume(token)

    @property
    def complete(self) -> bool:
        """The output is complete and nothing may follow it: the generation ends."""
        return self.matcher.complete

    def retract(self, generated: int) -> int:
        """Count a rejection; the tokens to take back (the rejected one included, which
        was never fed to the matcher) out of the ``generated`` so far. Raises
        MonitorRejectedError past ``max_retries``."""
        self.retries += 1
        if self.retries > self.monitor.max_retries:
            raise MonitorRejectedError(
                f"the text monitor ({self.monitor.check.kind}) rejected the output "
                f"{self.retries} times, over max_retries {self.monitor.max_retries}; the "
                f"generation ends at the last accepted token"
            )
        back = min(self.monitor.rollback_tokens, generated)
        self.matcher.rollback(back - 1)
        return back
