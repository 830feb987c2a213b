"""The record of a nemesis run: every request and its outcome, every fault, every token seen.

Times are wall-clock seconds (``time.time()``): the workers' JSON logs stamp their lines
with the same clock (one machine), so a client's answer and a worker's acquisition can be
put in one order. Every list is appended under one lock: clients, the fault scheduler and
the token sampler write from different threads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def digest(data: bytes) -> str:
    """A short hash of an answer's bytes: equal answers have equal digests."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


#: Marks a Redis sighting taken while a hand-off reserved the session for its target:
#: the meta names the target with the source's token until the target acquires its own.
HANDOFF = "handoff:"


@dataclass
class Op:
    """One client request. ``worker`` is the worker that answered (its name, from the
    address the answer came through); ``step`` the session's step the answer is about
    (a step's number, a forecast's or a read's starting step, a rollback's target)."""

    id: int
    client: str
    session: str
    kind: str  # create, step, rollback, snapshot, forecast, get, fork, generate, migrate, ...
    invoke: float
    complete: float | None = None
    ok: bool | None = None  # None: no outcome yet
    worker: str = ""
    step: int = -1
    digest: str = ""  # a step's output, a forecast's outputs
    error: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        took = f"{self.complete - self.invoke:6.2f}s" if self.complete is not None else "  open "
        outcome = "ok " if self.ok else ("ERR" if self.ok is False else "???")
        extra = f" {self.args}" if self.args else ""
        err = f" error={self.error[:120]!r}" if self.error else ""
        return (
            f"#{self.id:<6} {self.invoke:.3f} +{took} {outcome} {self.client:<8} "
            f"{self.kind:<9} {self.session[:18]:<18} step={self.step:<5} "
            f"by={self.worker or '-':<4} {self.digest[:8]}{extra}{err}"
        )


@dataclass
class Fault:
    """One injected fault: ``kind`` from ``start`` until ``end`` (healed)."""

    kind: str
    target: str
    start: float
    end: float | None = None
    detail: str = ""

    def line(self) -> str:
        end = f"{self.end:.3f}" if self.end is not None else "   ...   "
        return f"FAULT {self.start:.3f}..{end} {self.kind:<22} {self.target} {self.detail}"


@dataclass
class TokenSighting:
    """A fencing token seen: in Redis (the session's meta hash) or in a worker's log line
    about an acquisition (``source`` says which)."""

    session: str
    token: str
    owner: str
    at: float
    source: str  # "redis" or "log:<worker id>:<event>"


class History:
    """Append-only lists of ops, faults and token sightings, shared by every thread."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.faults: list[Fault] = []
        self.tokens: list[TokenSighting] = []
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.started = time.time()

    def invoke(self, client: str, session: str, kind: str, **args: Any) -> Op:
        op = Op(next(self._ids), client, session, kind, time.time(), args=args)
        with self._lock:
            self.ops.append(op)
        return op

    @staticmethod
    def ok(op: Op, worker: str, step: int = -1, out: str = "", at: float | None = None) -> Op:
        op.complete = time.time() if at is None else at
        op.ok, op.worker, op.step, op.digest = True, worker, step, out
        return op

    @staticmethod
    def fail(op: Op, error: BaseException | str, worker: str = "") -> Op:
        op.complete = time.time()
        op.ok, op.worker = False, worker
        op.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return op

    def fault(self, kind: str, target: str, detail: str = "") -> Fault:
        f = Fault(kind, target, time.time(), detail=detail)
        with self._lock:
            self.faults.append(f)
        return f

    def token(self, sighting: TokenSighting) -> None:
        with self._lock:
            self.tokens.append(sighting)

    def note(self, text: str) -> None:
        with self._lock:
            self.notes.append(f"{time.time():.3f} {text}")

    def dump(self, path: Path) -> None:
        """The whole history as JSON (for reading a failure at leisure)."""
        with self._lock:
            data = {
                "ops": [asdict(o) for o in self.ops],
                "faults": [asdict(f) for f in self.faults],
                "tokens": [asdict(t) for t in self.tokens],
                "notes": list(self.notes),
            }
        path.write_text(json.dumps(data, default=str))

    @classmethod
    def load(cls, path: Path) -> History:
        data = json.loads(path.read_text())
        h = cls()
        h.ops = [Op(**o) for o in data["ops"]]
        h.faults = [Fault(**f) for f in data["faults"]]
        h.tokens = [TokenSighting(**t) for t in data["tokens"]]
        h.notes = list(data["notes"])
        return h
