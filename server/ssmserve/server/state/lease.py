"""A session lease: this worker's proof that it owns one session, and until when.

Ownership of a session is one value, produced only by the store's ``create`` and
``acquire`` scripts and required by every store write of the session:

- ``token`` is the fencing token, ``<incarnation>.<epoch>``. The incarnation is 128 random
  bits chosen when the session id is created (create, import, fork); the epoch counts the
  acquisitions within that incarnation. So a token never repeats, not even when an id is
  closed and created again: a worker that froze while it owned the old session can never
  write into the new one (the ABA case). Redis compares tokens inside every write script.
- ``holder`` is the owning worker's id (the value of the session's lease key in Redis).
- ``valid_until`` is this worker's own bound, on its monotonic clock, of how long the lease
  certainly still runs: the start of the last call that set or extended it, plus the TTL,
  minus a margin for clock rate differences. Past it the worker may have lost the session
  without knowing (a freeze, a partition from Redis), so it stops answering for the
  session until a renewal succeeds (``SessionManager.revalidate``). Monotonic time keeps
  running while a process is stopped, so a worker that wakes from SIGSTOP sees its leases
  as expired before it answers anything.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field


def new_incarnation() -> str:
    """128 random bits, hex: the part of a fencing token that never repeats."""
    return secrets.token_hex(16)


@dataclass(eq=False, slots=True)
class SessionLease:
    session_id: str
    token: str  # "<incarnation>.<epoch>"
    holder: str  # worker id
    valid_until: float = field(default=0.0)  # time.monotonic() bound; 0: not valid

    @property
    def epoch(self) -> int:
        """The acquisition count within this incarnation (for logs and operators)."""
        _incarnation, _, epoch = self.token.rpartition(".")
        return int(epoch) if epoch.isdigit() else 0

    def valid(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.valid_until

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
        left = self.valid_until - time.monotonic()
        return f"SessionLease({self.session_id!r}, token={self.token}, valid {left:+.2f} s)"
