"""When this worker may take a session over from an owner that never let it go.

An owner trusts its lease by its own monotonic clock, until the start of its last
successful renewal plus the TTL (``state.lease``). Redis expires the lease key by its own
wall clock, which can step (an NTP correction, a VM restored, a wrong date set by hand):
stepped forward 30 s, every lease in Redis runs out at once while every owner still
trusts its own. So Redis's expiry alone never hands a session on. A worker takes over a
session whose owner never let it go only after it has itself seen the session's lease
*beat* (moved by every acquisition and renewal, in Redis) stay the same for a whole TTL
on its own clock (``state.lease.lease_clock``): the owner's last renewal ran before that
first sighting, so by then the owner has stopped trusting it, whatever Redis's clock did.

What it costs: a takeover after a crash or a freeze waits a TTL from the first request
that finds the session held, instead of until Redis expires the key (at most a TTL after
the owner's last renewal); ``bench/bench_failover.py`` measures both. Releases (drains,
idle eviction, shutdown) and hand-offs (migration) name their next owner and never wait.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ssmserve.server.state.lease import lease_clock
from ssmserve.server.state.store_errors import LeaseHeldError

#: Sightings kept (one per session asked for while someone else held it); the oldest go
#: first. Forgetting one only delays a takeover: the next request starts a new sighting.
MAX_SIGHTINGS = 100_000


@dataclass(frozen=True, slots=True)
class Sighting:
    """The beat of one session's lease as first seen, and when (monotonic)."""

    beat: str
    seen_at: float  # lease_clock()
    wait_s: float  # how long it must stay the same: the longer of both workers' TTLs


class Takeovers:
    """The sessions this worker found held by others, and since when their beat stood."""

    def __init__(self, lease_ttl_s: float, limit: int = MAX_SIGHTINGS) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.limit = limit
        self._sightings: OrderedDict[str, Sighting] = OrderedDict()

    def proof(self, session_id: str, now: float | None = None) -> str:
        """The beat to acquire ``session_id`` with: the one seen unchanged for a whole TTL,
        or '' when there is none yet (the store then refuses a takeover)."""
        sighting = self._sightings.get(session_id)
        now = lease_clock() if now is None else now
        if sighting is None or now - sighting.seen_at < sighting.wait_s:
            return ""
        return sighting.beat

    def saw(
        self, session_id: str, error: LeaseHeldError, now: float | None = None
    ) -> LeaseHeldError:
        """An acquire found ``session_id`` held (``error``, just received): remember its beat
        unless it is the one already being watched. Returns ``error`` with its retry hint
        at least as long as the watch still has to run."""
        now = lease_clock() if now is None else now
        sighting = self._sightings.get(session_id)
        if sighting is None or sighting.beat != error.beat:
            wait_s = max(self.lease_ttl_s, error.owner_lease_ms / 1000)
            sighting = Sighting(error.beat, now, wait_s)
            self._sightings[session_id] = sighting
            self._sightings.move_to_end(session_id)
            while len(self._sightings) > self.limit:
                self._sightings.popitem(last=False)
        left_ms = int(max(0.0, sighting.seen_at + sighting.wait_s - now) * 1000)
        error.retry_after_ms = max(error.retry_after_ms, left_ms)
        return error

    def forget(self, session_id: str) -> None:
        """``session_id`` was acquired (or is gone): its sighting proves nothing any more."""
        self._sightings.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._sightings)
