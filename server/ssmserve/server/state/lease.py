"""A session lease: this worker's proof that it owns one session, and until when.

Ownership of a session is one value, produced only by the store's ``create`` and
``acquire`` scripts and required by every store write of the session:

- ``token`` is the fencing token: ``<incarnation>.<epoch>`` as created,
  ``<incarnation>.<epoch>.<nonce>`` once acquired. The incarnation is 128 random bits
  chosen when the session id is created (create, import, fork), so a worker that froze
  while it owned an old session of the same id can never write into the new one (the ABA
  case). The nonce is 64 random bits per acquisition, so a token never repeats even when
  Redis loses writes: the epoch counter (for people) can go back after a failover to a
  replica that missed writes, a restored backup or an fsync window, and hand out the
  same epoch twice. Redis compares whole tokens inside every write script.
- ``holder`` is the owning worker's id (the value of the session's lease key in Redis).
- ``valid_until`` is this worker's own bound, on its monotonic clock, of how long the lease
  certainly still runs: the start of the last call that set or extended it, plus the TTL,
  minus a margin for clock rate differences. Past it the worker may have lost the session
  without knowing (a freeze, a partition from Redis), so it stops answering for the
  session until a renewal succeeds (``SessionManager.revalidate``). The clock is
  :func:`lease_clock`, which keeps running while a process is stopped and while the
  machine sleeps, so a worker that wakes from SIGSTOP, a VM pause or a suspend sees its
  leases as run out before it answers anything.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field


def lease_clock() -> float:
    """Seconds by the clock every lease bound is kept on: ``CLOCK_BOOTTIME`` where the
    system has one (Linux), which also counts time the machine spent suspended, else
    ``time.monotonic()``. ``CLOCK_MONOTONIC`` stops during a suspend: an owner that woke
    from one would still trust a lease another worker had long taken over."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def new_incarnation() -> str:
    """128 random bits, hex: the part of a fencing token that names one creation of an id."""
    return secrets.token_hex(16)


def new_nonce() -> str:
    """64 random bits, hex: the part of a fencing token that names one acquisition."""
    return secrets.token_hex(8)


@dataclass(eq=False, slots=True)
class SessionLease:
    session_id: str
    token: str  # "<incarnation>.<epoch>[.<nonce>]"
    holder: str  # worker id
    valid_until: float = field(default=0.0)  # a lease_clock() bound; 0: not valid
    # The acquisition count within this incarnation (for logs and operators).
    epoch: int = field(init=False)

    def __post_init__(self) -> None:
        self.epoch = token_epoch(self.token)

    def valid(self, now: float | None = None) -> bool:
        return (lease_clock() if now is None else now) < self.valid_until

    def extend(self, sent_at: float, ttl_s: float, margin_s: float) -> None:
        """A call that set or extended the lease was sent at ``sent_at`` and succeeded.

        Redis started the TTL when it ran the call, which is after ``sent_at``; so the
        lease runs at least until ``sent_at + ttl_s`` on a clock that runs like ours.
        """
        self.valid_until = max(self.valid_until, sent_at + ttl_s - margin_s)

    def expire(self) -> None:
        """Forget the bound: the next answer waits for a successful renewal."""
        self.valid_until = 0.0

    def __repr__(self) -> str:
        left = self.valid_until - lease_clock()
        return f"SessionLease({self.session_id!r}, token={self.token}, valid {left:+.2f} s)"


def token_epoch(token: str) -> int:
    """The epoch of ``token`` (its second part), 0 if it has none."""
    parts = token.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
