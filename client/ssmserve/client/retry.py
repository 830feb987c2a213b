"""How the client rides out moves, crashes and outages: redirects, retries, backoff.

A request for a session another worker owns comes back as
:class:`~ssmserve.client.errors.SessionMoved` with the owner's address: the client goes there at
once. A worker that cannot be reached, or a store outage (UNAVAILABLE), is retried with
exponential backoff and jitter, trying the other known workers in turn, until
``give_up_after_s`` passes without progress.

An owner that a redirect names and that does not answer (frozen, dead) keeps its lease
until it runs out: the client asks the worker that redirected again until it takes the
session over, for at most ``takeover_wait_s`` (by default derived from how long that
worker says the lease still runs).

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
    # How long a call waits, through the worker that redirected it, for that worker to
    # take over a session whose owner does not answer (frozen, dead, cut off from this
    # client). 0: give_up_after_s (60 s), as long as any retry: owners killed again and
    # again (a worker restarting in place, a takeover that is itself cut) take many
    # lease TTLs, and a stream bounded by twice the lease + 5 s gave up where it had
    # ridden the same faults out before (tests/test_cluster_processes.py).
    takeover_wait_s: float = 0.0

    def takeover_wait(self, retry_after_ms: int) -> float:
        """How long to wait for a takeover the worker said may start in ``retry_after_ms``
        (the setting as given; it only names the wait, the bound is the setting's)."""
        wait_s = self.takeover_wait_s if self.takeover_wait_s > 0 else self.give_up_after_s
        return min(wait_s, self.give_up_after_s)


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
        self.redirected_by = ""  # the worker whose redirect was followed last
        self.redirected_to = ""  # the owner it named
        self.redirect_hint_ms = 0  # how long it said the owner's lease still runs
        # When the wait for a takeover (the owner does not answer) started, and its bound.
        self.takeover_since: float | None = None
        self.takeover_bound_s = 0.0

    def expired(self) -> bool:
        return self.elapsed() > self.policy.give_up_after_s

    def elapsed(self) -> float:
        """Seconds since the operation started or last made progress."""
        return time.monotonic() - self._since

    @property
    def since(self) -> float:
        """When (``time.monotonic()``) the operation started or last made progress."""
        return self._since

    def takeover_left(self) -> float:
        """Seconds left of the wait for a takeover (0 when it is over or never started)."""
        if self.takeover_since is None:
            return 0.0
        return max(0.0, self.takeover_since + self.takeover_bound_s - time.monotonic())

    async def wait(self, at_least_s: float = 0.0, at_most_s: float | None = None) -> None:
        delay = max(at_least_s, self._delay * (0.5 + random.random() / 2))
        if at_most_s is not None:
            delay = min(delay, at_most_s)
        self._delay = min(self._delay * self.policy.multiplier, self.policy.max_backoff_s)
        await asyncio.sleep(delay)
