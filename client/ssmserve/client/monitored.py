"""A generation checked by the caller's own code: rollback on a constraint violation.

:func:`generate_monitored` (asyncio) and :func:`generate_monitored_sync` (the blocking
client) run ``generate`` and call ``check`` with the tokens accepted so far after every
token. When ``check`` rejects, the generation is stopped, the session is rolled back
``rollback_tokens`` tokens with the session's own Rollback (exactly the state before
them), and generation goes on from there with the next attempt of the seed. The draws
after the ``a``-th rejection use the seed :func:`attempt_seed` ``(seed, a)``, the key the
server's text monitor uses too (``TextMonitor`` in the Generate request): every token is a
pure function of the request, its step and the rejections before it, so the same calls
give the same tokens. After ``max_retries`` rejections it raises :class:`MonitorRejected`,
the session left at the last accepted token.

A greedy draw (temperature 0) takes the rejected token again: give a temperature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ssmserve.client.errors import StepFailed
from ssmserve.client.generation import GeneratedToken
from ssmserve.client.step_values import SessionRef, session_id_of

if TYPE_CHECKING:
    from ssmserve.client.aio import AsyncClient
    from ssmserve.client.sync import Client

_U64 = (1 << 64) - 1
#: Times a cancelled call's late step is rolled back again before the error is raised.
LATE_STEPS = 3
#: A check: the tokens accepted so far, the newest last -> whether they may stand.
Check = Callable[[Sequence[GeneratedToken]], bool]


class MonitorRejected(Exception):
    """``check`` rejected the output more than ``max_retries`` times; ``tokens``: those
    accepted, where the session is left."""

    def __init__(self, message: str, tokens: list[GeneratedToken]) -> None:
        super().__init__(message)
        self.tokens = tokens


@dataclass(frozen=True)
class MonitoredGeneration:
    tokens: list[GeneratedToken]  # the accepted tokens, in order (what the session holds)
    retries: int  # the rejections on the way

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


def attempt_seed(seed: int, attempt: int) -> int:
    """The seed of the draws after ``attempt`` rejections: ``seed`` for 0, else the first
    64-bit output of Philox4x64-10 keyed ``(seed, attempt)`` at counter 1 (the server's
    ``text_monitor.attempt_seed``)."""
    if attempt == 0:
        return seed
    key = np.array([seed & _U64, attempt & _U64], np.uint64)
    generator = np.random.Philox(key=key, counter=np.array([1, 0, 0, 0], np.uint64))
    return int(generator.random_raw())


class _Run:
    """The bookkeeping both flavours share."""

    def __init__(self, max_tokens: int, rollback_tokens: int, max_retries: int) -> None:
        if rollback_tokens < 1 or max_retries < 0:
            raise ValueError("rollback_tokens must be >= 1 and max_retries >= 0")
        self.max_tokens, self.rollback_tokens, self.max_retries = (
            max_tokens,
            rollback_tokens,
            max_retries,
        )
        self.tokens: list[GeneratedToken] = []
        self.retries = 0
        self.at: int | None = None  # where the next call starts (None: the first call)
        self.rollback_to: int | None = None  # set when the session is to be rolled back
        self.late = 0  # steps a cancelled call applied after a rollback, rolled back again

    def options(self, options: dict[str, Any], seed: int) -> dict[str, Any]:
        """The next call's options: after the first, no prompt, from ``at``."""
        given = dict(options, seed=attempt_seed(seed, self.retries))
        if self.at is not None:
            given.pop("prompt_ids", None)
            given.pop("prompt_text", None)
            given["at_step"] = self.at
        return given

    def judge(self, token: GeneratedToken, check: Check) -> bool:
        """Take ``token``; True when ``check`` rejects it (``rollback_to`` is then the step
        to roll back to, and the rejection is counted)."""
        self.tokens.append(token)
        if check(self.tokens):
            return False
        self.retries += 1
        back = min(self.rollback_tokens, len(self.tokens))
        del self.tokens[len(self.tokens) - back :]
        self.at = self.rollback_to = token.step - back
        return True

    def late_step(self, error: StepFailed) -> bool:
        """Whether ``error`` is a step the cancelled call still applied after the last
        rollback (the session ahead of ``at`` with a token this attempt does not draw):
        rolled back again, a bounded number of times."""
        if self.at is None or error.reason != "GENERATE_AT_STEP" or self.late >= LATE_STEPS:
            return False
        self.late += 1
        self.rollback_to = self.at
        return True

    def rolled_back(self) -> None:
        """The session is at ``rollback_to`` now. Raises MonitorRejected past
        max_retries."""
        self.rollback_to = None
        if self.retries > self.max_retries:
            raise MonitorRejected(
                f"check rejected the output {self.retries} times, over max_retries "
                f"{self.max_retries}; the session is rolled back to step {self.at}",
                self.tokens,
            )

    @property
    def left(self) -> int:
        return self.max_tokens - len(self.tokens)


async def generate_monitored(
    client: AsyncClient,
    session: SessionRef,
    max_tokens: int,
    check: Check,
    *,
    rollback_tokens: int = 1,
    max_retries: int = 8,
    seed: int = 0,
    **options: Any,
) -> MonitoredGeneration:
    """Generate up to ``max_tokens`` accepted tokens (``options`` as ``generate``'s),
    ``check`` judging the accepted tokens after each; a rejection rolls the session back
    ``rollback_tokens`` tokens (the rejected one included) and resamples from there."""
    sid = session_id_of(session)
    run = _Run(max_tokens, rollback_tokens, max_retries)
    while run.left > 0:
        stream = client.generate(sid, run.left, **run.options(options, seed))
        try:
            async for token in stream:
                if run.judge(token, check):
                    break
        except StepFailed as exc:
            if not run.late_step(exc):
                raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # the call is cancelled
        if run.rollback_to is None:
            break
        await client.rollback(sid, to_step=run.rollback_to)
        run.rolled_back()
    return MonitoredGeneration(run.tokens, run.retries)


def generate_monitored_sync(
    client: Client,
    session: SessionRef,
    max_tokens: int,
    check: Check,
    *,
    rollback_tokens: int = 1,
    max_retries: int = 8,
    seed: int = 0,
    **options: Any,
) -> MonitoredGeneration:
    """:func:`generate_monitored` with the blocking client."""
    sid = session_id_of(session)
    run = _Run(max_tokens, rollback_tokens, max_retries)
    while run.left > 0:
        stream = client.generate(sid, run.left, **run.options(options, seed))
        try:
            for token in stream:
                if run.judge(token, check):
                    break
        except StepFailed as exc:
            if not run.late_step(exc):
                raise
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # the call is cancelled
        if run.rollback_to is None:
            break
        client.rollback(sid, to_step=run.rollback_to)
        run.rolled_back()
    return MonitoredGeneration(run.tokens, run.retries)
