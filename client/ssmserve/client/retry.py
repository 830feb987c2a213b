"""How the client rides out moves, crashes and outages: redirects, retries, backoff.

A request for a session another worker owns comes back as
:class:`~ssmserve.client.errors.SessionMoved` with the owner's address: the client goes there at
once. A worker that cannot be reached, or a store outage (UNAVAILABLE), is retried with
exponential backoff and jitter, trying the other known workers in turn, until
``give_up_after_s`` passes without progress.

Except before the first answer: a client that no worker has ever answered gives up
``connect_timeout_s`` after its first failed connection, when every address it knows
failed, with :class:`~ssmserve.client.errors.ServerUnreachable`. Nothing it knows of is
then a cluster that could come back: the address is wrong, or nothing runs there (a
minute of retries would only hide that). Once a worker has answered, the client knows a
cluster is there, and one that goes away (restarting, failing over, its sessions moving)
is waited for as long as ``give_up_after_s``.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Retry settings of a client (documented defaults)."""

    initial_backoff_s: float = 0.01
    max_backoff_s: float = 0.2  # small: a dead owner's sessions return after its lease TTL
    multiplier: float = 2.0
    give_up_after_s: float = 60.0  # without any progress (an answered step, a reply)
    # Until some worker has answered this client: how long connections that fail at
    # every known address are retried (a worker still starting gets this long).
    connect_timeout_s: float = 2.0
    max_redirects: int = 8  # hops in a row before backing off (a hand-off in progress)
    # No answer for this long with steps pending on a stream, or no next reply of a
    # forecast, history or export: reconnect (or retry the call).
    stall_timeout_s: float = 30.0
    window: int = 256  # steps sent but not yet answered, per stream (kept for resending)
    # Answered inputs a stream keeps, so that a session that comes back behind them
    # (SESSION_REWOUND: snapshot or none durability after a crash, or a store that lost
    # writes) is streamed again from where it is; 0 keeps none (such a stream then
    # raises SessionRewound). A crash loses at most the steps since the last snapshot
    # (snapshot_every, 64 by default) and those not yet flushed.
    rewind_window: int = 1024
    # Deadline of every unary call (a rollback or fork may replay a snapshot interval).
    call_timeout_s: float = 30.0
    # Deadline of an import (the whole checkpoint goes up in one call).
    import_timeout_s: float = 600.0
    # gRPC keepalive: a ping after this long without news from a worker, and the
    # connection is given up when no answer comes within the timeout. A frozen or
    # vanished worker is noticed within about their sum, even mid-stream.
    keepalive_time_s: float = 2.0
    keepalive_timeout_s: float = 2.0


class Backoff:
    """Delays for one operation; :meth:`progress` resets them."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.progress()

    def progress(self) -> None:
        self._delay = self.policy.initial_backoff_s
        self._since = time.monotonic()
        self.redirects = 0
        self.waited_for = ""  # an unreachable owner whose lease we last waited out

    def expired(self) -> bool:
        return self.elapsed() > self.policy.give_up_after_s

    def elapsed(self) -> float:
        """Seconds since the operation started or last made progress."""
        return time.monotonic() - self._since

    async def wait(self, at_least_s: float = 0.0) -> None:
        delay = max(at_least_s, self._delay * (0.5 + random.random() / 2))
        self._delay = min(self._delay * self.policy.multiplier, self.policy.max_backoff_s)
        await asyncio.sleep(delay)
