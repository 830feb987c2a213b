"""How long to wait before starting a process again that died (bounded, exponential).

The embedded Redis (``embedded_redis_keeper``) and the workers of ``--workers N``
(``supervisor``) are restarted by one rule: the first restart after a short delay, each
further one after twice the last, up to a bound; a process that then runs for
``stable_s`` without dying counts as healthy again and its next death starts over from
the first delay. A process that dies at once (a corrupt file, a port taken) thus costs
a few retries a minute, never a busy loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffSettings:
    first_s: float = 0.1
    max_s: float = 10.0
    stable_s: float = 30.0


class RestartBackoff:
    def __init__(self, settings: BackoffSettings) -> None:
        self.settings = settings
        self._next = settings.first_s
        self._started_at = time.monotonic()

    def started(self) -> None:
        """The process (re)started now."""
        self._started_at = time.monotonic()

    def delay(self) -> float:
        """The wait before the restart of a process that just died."""
        s = self.settings
        if time.monotonic() - self._started_at >= s.stable_s:
            self._next = s.first_s
        delay, self._next = self._next, min(self._next * 2, s.max_s)
        return delay
