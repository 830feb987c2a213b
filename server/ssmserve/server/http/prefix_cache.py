"""A Mamba state is a prefix cache: the sessions of recent requests, found by token prefix.

A session that answered a request holds the model's state after its prompt and its
reply: everything a next request that starts with those tokens (a chat's next turn: the
previous prompt, the reply, the new user turn) would prefill again. The door keeps such
sessions, per namespace (a client's tenant; none for an admin) and model, in a
least-recently-used list of at most ``per_key``; for a new prompt it finds the kept
history with the longest common prefix:

- the whole history is a prefix of the prompt: the request continues that session (taken
  out of the list while it runs, put back with its longer history after), feeding only
  the rest of the prompt;
- a shorter common prefix (a regenerated reply, an edited turn, a prompt that stops
  inside a kept history): the request forks the session at that step (``Fork``: its state
  there, exactly) and feeds the rest; the kept session stays for others.

A session's state after a step is a pure function of its inputs, so either way the
logits (and the seeded draws) are those of a fresh prefill of the whole prompt.

This module is the bookkeeping only (no I/O): the door creates, forks and closes the
sessions; a session pushed out of a full list, or forgotten, is handed to ``on_evict``
to be closed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: (namespace, model key): whose sessions (their stored-id prefix: a client's tenant, ''
#: for an admin's or without auth), of which model.
CacheKey = tuple[str, str]


@dataclass(frozen=True)
class KeptSession:
    session_id: str  # as stored
    history: np.ndarray  # (n,) int64: the session's inputs of steps 1..n; it is at step n


@dataclass(frozen=True)
class PrefixMatch:
    kept: KeptSession
    length: int  # the prompt's first ``length`` ids are the kept history's

    @property
    def whole(self) -> bool:
        """The whole kept history is a prefix of the prompt: continue the session."""
        return self.length == len(self.kept.history)


@dataclass
class CacheCounts:
    continued: int = 0  # requests that continued a kept session
    forked: int = 0  # requests that forked one at a shorter common prefix
    missed: int = 0  # requests that prefilled a new session
    evicted: int = 0  # sessions pushed out of a full list (closed)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class PrefixCache:
    per_key: int  # sessions kept per (namespace, model); 0: none
    on_evict: Callable[[str], None]
    counts: CacheCounts = field(default_factory=CacheCounts)
    _kept: dict[CacheKey, OrderedDict[str, KeptSession]] = field(default_factory=dict)

    def match(self, key: CacheKey, ids: np.ndarray, min_fork: int) -> PrefixMatch | None:
        """The kept session of ``key`` to start ``ids`` from: the one whose whole history
        is the longest prefix of ``ids``, unless another shares ``min_fork`` ids more (a
        fork replays up to a snapshot interval: it must save more than that); else the
        one sharing the longest prefix of ``min_fork`` ids or more; None when none does."""
        whole: PrefixMatch | None = None
        fork: PrefixMatch | None = None
        for kept in self._kept.get(key, {}).values():
            n = common_prefix(kept.history, ids)
            found = PrefixMatch(kept, n)
            if n and found.whole and (whole is None or n > whole.length):
                whole = found
            elif n >= min_fork and not found.whole and (fork is None or n > fork.length):
                fork = found
        if fork is not None and (whole is None or fork.length > whole.length + min_fork):
            return fork
        return whole

    def take(self, key: CacheKey, session_id: str) -> None:
        """Take a session out while a request continues it (nobody else may step it)."""
        kept = self._kept.get(key)
        if kept is not None:
            kept.pop(session_id, None)

    def keep(self, key: CacheKey, session_id: str, history: np.ndarray) -> None:
        """Keep ``session_id`` (now at step ``len(history)``) as the most recent of
        ``key``; the least recent past ``per_key`` goes to ``on_evict``."""
        if self.per_key <= 0:
            self.on_evict(session_id)
            return
        kept = self._kept.setdefault(key, OrderedDict())
        kept.pop(session_id, None)
        kept[session_id] = KeptSession(session_id, np.asarray(history, np.int64).copy())
        while len(kept) > self.per_key:
            _, old = kept.popitem(last=False)
            self.counts.evicted += 1
            self.on_evict(old.session_id)

    def forget(self, key: CacheKey, session_id: str) -> None:
        """Drop a kept session that can no longer be used (moved, closed, broken): it
        goes to ``on_evict`` to be closed, as every session that leaves the cache does
        (one gone already is not found there, which is harmless)."""
        kept = self._kept.get(key)
        if kept is not None and kept.pop(session_id, None) is not None:
            self.on_evict(session_id)

    def drain(self) -> list[str]:
        """Every kept session id, the cache emptied (the door stops)."""
        ids = [s for kept in self._kept.values() for s in kept]
        self._kept.clear()
        return ids

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())
