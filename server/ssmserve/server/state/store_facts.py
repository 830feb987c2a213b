"""What a worker checks about the store itself, not about its sessions.

- **Its identity** (:class:`StoreIdentity`): a random id and a creation time in one key
  (``store_layout.store_identity_key``), written once by the first worker that finds none.
  A Redis that was wiped (FLUSHALL, restarted without persistence, an empty replacement)
  has another identity, or none: the sessions a worker holds in memory are gone from it.
- **Its eviction policy** (:class:`EvictionPolicies`): ``maxmemory-policy`` of every
  server that holds sessions. Any policy but ``noeviction`` lets Redis delete keys when
  it fills up: session metadata, logged inputs, leases and registry entries vanish
  without an error, so acknowledged steps are lost and a session may get two owners.

``Store`` reads both (``Store.store_identity``, ``Store.eviction_policies``);
``cluster.store_guard`` decides what they mean.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

#: The only ``maxmemory-policy`` under which Redis never deletes a key on its own.
NO_EVICTION = "noeviction"


@dataclass(frozen=True)
class StoreIdentity:
    """Who the store is: a random id and when it was made (seconds since the epoch)."""

    store_id: str
    created_at: float

    @classmethod
    def new(cls) -> StoreIdentity:
        return cls(secrets.token_hex(8), time.time())

    def to_value(self) -> str:
        return f"{self.store_id} {self.created_at!r}"

    @classmethod
    def from_value(cls, raw: bytes) -> StoreIdentity:
        """The identity a key holds; a value this worker did not write is taken whole as
        the id (so it still compares unequal to any other)."""
        text = raw.decode(errors="replace")
        store_id, _, created = text.partition(" ")
        try:
            return cls(store_id, float(created))
        except ValueError:
            return cls(text[:200], 0.0)

    def describe(self) -> str:
        made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created_at))
        return f"{self.store_id} (made {made})"


@dataclass(frozen=True)
class EvictionPolicies:
    """``maxmemory-policy`` of each server that holds sessions, by its address; or why it
    could not be read (CONFIG and INFO both refused: a managed Redis, an ACL user)."""

    by_server: dict[str, str] = field(default_factory=dict)
    unreadable: str = ""  # '' when every server's policy was read

    @property
    def evicting(self) -> dict[str, str]:
        """The servers whose policy lets Redis delete keys, with that policy."""
        return {s: p for s, p in sorted(self.by_server.items()) if p != NO_EVICTION}
