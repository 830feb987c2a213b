"""Where fencing tokens show: the workers' JSON logs and the sessions' meta hashes in Redis.

A worker logs every acquisition that makes a token: ``created`` (create, fork, import,
with ``token``), ``taken_over`` (with ``token``) and "restored at step N, token T" (a load:
takeover, hand-off target, reload), each line with its worker id and wall-clock time. A
sampler thread reads each session's ``meta`` hash (``token``, ``owner_addr``) from Redis
a few times a second. Both go into the history as :class:`TokenSighting`; the checker
looks there for a token handed out twice, and the log's acquisitions are what makes an
answer's worker the owner (the ownership rule).
"""

from __future__ import annotations

import calendar
import json
import re
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path

import redis

from tests.nemesis.history import HANDOFF, History, TokenSighting

_RESTORED = re.compile(r"session (\S+) restored at step \d+, token (\S+) ")
_ACQUIRING_EVENTS = frozenset({"created", "taken_over"})


def parse_time(stamp: str) -> float:
    """``2024-05-01T12:00:00.123Z`` (the JSON log's ``time``) as epoch seconds."""
    whole, _, rest = stamp.partition(".")
    seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
    return seconds + int(rest.rstrip("Z") or 0) / 1000


def acquisitions(log: Path, worker: str) -> list[TokenSighting]:
    """Every acquisition ``worker``'s log (all its runs) records, in order."""
    found: list[TokenSighting] = []
    if not log.exists():
        return found
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        sid, token = rec.get("session_id"), rec.get("token")
        event = rec.get("event", "")
        if event not in _ACQUIRING_EVENTS:
            match = _RESTORED.search(rec.get("message", ""))
            if not match:
                continue
            sid, token, event = match.group(1), match.group(2).rstrip(","), "restored"
        if not sid or not token:
            continue
        at = parse_time(rec["time"])
        source = f"log:{rec.get('worker_id', '?')}:{event}"
        found.append(TokenSighting(sid, token, worker, at, source))
    return found


class TokenSampler:
    """Reads every known session's token and owner from Redis until stopped."""

    def __init__(
        self,
        store: Callable[[], redis.Redis],
        history: History,
        sessions: Callable[[], Iterable[str]],
        every_s: float = 0.25,
    ) -> None:
        self.store = store
        self.history = history
        self.sessions = sessions
        self.every_s = every_s
        self.reads = 0
        self._stop = threading.Event()
        self._last: dict[str, str] = {}
        self._thread = threading.Thread(target=self._loop, name="tokens", daemon=True)

    def start(self) -> TokenSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            # A connection per round: a Sentinel master demoted by a failover keeps its
            # clients and serves its stale data as a replica; a new one asks the
            # sentinels where the master is now.
            conn: redis.Redis | None = None
            try:
                conn = self.store()
                for sid in list(self.sessions()):
                    token, owner = conn.hmget(f"ssm:{{{sid}}}:meta", "token", "owner_addr")
                    lease = conn.get(f"ssm:{{{sid}}}:lease") or b""
                    self.reads += 1
                    if token is None:
                        continue
                    value = token.decode()
                    held_by = (owner or b"").decode()
                    if lease.startswith(b"handoff:"):  # reserved for a migration's target
                        held_by = f"{HANDOFF}{held_by}"
                    elif not lease:
                        # Nobody holds it: released, its owner gone, or a hand-off's
                        # reservation that ran out, whose owner_addr names the target under
                        # the source's token (seen after a failover went back to it).
                        held_by = ""
                    if self._last.get(sid) != value:  # only changes: a short record
                        self._last[sid] = value
                        self.history.token(TokenSighting(sid, value, held_by, time.time(), "redis"))
            except (redis.RedisError, OSError, IndexError, KeyError):
                pass  # Redis is down, frozen or failing over: try again next round
            finally:
                with suppress(Exception):
                    if conn is not None:
                        conn.close()
