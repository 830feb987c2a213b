"""The records the store reads and writes: a session's metadata, a lease's holder, a
worker's registry entry, a snapshot's index entry, a snapshot to commit. Each turns
itself into the fields of its Redis hash and back; none does I/O (``store`` does)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from ssmserve.server.errors import SessionMovedError
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store_errors import StoreDataError


def flat_hash(pairs: list[Any]) -> dict[bytes, bytes]:
    """A hash a script returned flat (HGETALL inside Lua: field, value, field, ...)."""
    return dict(zip(pairs[::2], pairs[1::2], strict=True))


def _int(raw: dict[bytes, bytes], name: str, what: str, default: bytes | None = None) -> int:
    value = raw.get(name.encode(), default)
    if value is None or not value.isdigit():
        raise StoreDataError(f"{what}: field {name!r} holds {value!r:.40}, not a step number")
    return int(value)


def _float(raw: dict[bytes, bytes], name: str, what: str, default: bytes = b"0") -> float:
    try:
        return float(raw.get(name.encode(), default))
    except ValueError:
        raise StoreDataError(f"{what}: field {name!r} is not a number") from None


@dataclass(frozen=True)
class SessionMeta:
    session_id: str
    model: str
    fingerprint: str
    step: int  # durable step
    log_start: int  # first step with a logged input
    config: bytes  # SessionConfig.to_bytes()
    created_at: float
    updated_at: float
    closed: bool
    epoch: int = 0  # acquisitions within this incarnation (for people; fencing uses token)
    owner: str = ""  # worker id of the last acquirer ('' after a release)
    owner_addr: str = ""
    token: str = ""  # the current owner's fencing token (``state.lease``)
    numerics: str = ""  # the numerics signature its history was computed with

    def to_fields(self) -> list[Any]:
        fields: list[Any] = [
            "model", self.model, "fingerprint", self.fingerprint, "step", self.step,
            "log_start", self.log_start, "config", self.config, "created_at", self.created_at,
            "updated_at", self.updated_at, "closed", "1" if self.closed else "0",
            "incarnation", self.token.partition(".")[0], "epoch", self.epoch,
            "token", self.token, "owner", self.owner, "owner_addr", self.owner_addr,
            "numerics", self.numerics,
        ]  # fmt: skip
        return fields

    @classmethod
    def from_hash(cls, session_id: str, raw: dict[bytes, bytes]) -> SessionMeta:
        what = f"session {session_id!r}"
        try:
            return cls(
                session_id=session_id,
                model=raw[b"model"].decode(),
                fingerprint=raw[b"fingerprint"].decode(),
                step=_int(raw, "step", what),
                log_start=_int(raw, "log_start", what),
                config=raw[b"config"],
                created_at=_float(raw, "created_at", what),
                updated_at=_float(raw, "updated_at", what),
                closed=raw.get(b"closed", b"0") == b"1",
                epoch=_int(raw, "epoch", what, b"0"),
                owner=raw.get(b"owner", b"").decode(),
                owner_addr=raw.get(b"owner_addr", b"").decode(),
                token=raw.get(b"token", b"").decode(),
                numerics=raw.get(b"numerics", b"").decode(),
            )
        except (KeyError, UnicodeDecodeError) as exc:
            raise StoreDataError(f"{what}: its metadata is incomplete ({exc})") from None


@dataclass(frozen=True)
class AcquiredLoad:
    """What ``Store.acquire_to_load`` took and read in one round trip."""

    lease: SessionLease
    meta: SessionMeta  # as the lease was taken: the last owner is done
    snapshot_id: str  # the newest snapshot at or before the durable step ('' for none)
    # That snapshot's record and checkpoint bytes, when the load expected it (else None:
    # the load reads them itself).
    snapshot: tuple[SnapshotRecord, bytes] | None


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a session's lease right now (``holder`` may be ``handoff:<worker id>``)."""

    holder: str
    owner_addr: str
    ttl_ms: int

    def redirect(self, session_id: str) -> SessionMovedError:
        """The error that sends a caller to this lease's holder."""
        return SessionMovedError(
            f"session {session_id!r} is served by worker {self.owner_addr or '(unknown)'}",
            owner=self.owner_addr,
            retry_after_ms=self.ttl_ms,
        )


@dataclass(frozen=True)
class WorkerStats:
    """What a worker did, as of its last heartbeat (for ``ssmserve top``; Prometheus has
    the full picture). Counters run from the worker's start."""

    steps: int = 0  # steps applied
    snapshots: int = 0  # snapshots committed
    open_streams: int = 0
    step_p50_ms: float = 0.0  # over the most recent answered steps (``RecentLatency``)
    step_p99_ms: float = 0.0
    memory_held: int = 0  # bytes counted against the memory budget
    memory_budget: int = 0

    def to_fields(self) -> dict[str, str]:
        return {f"stat_{k}": repr(v) for k, v in self.__dict__.items()}

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> WorkerStats:
        values: dict[str, Any] = {}
        for name, kind in (("steps", int), ("snapshots", int), ("open_streams", int),
                           ("step_p50_ms", float), ("step_p99_ms", float),
                           ("memory_held", int), ("memory_budget", int)):  # fmt: skip
            with contextlib.suppress(KeyError, ValueError):  # older workers: defaults
                values[name] = kind(raw[f"stat_{name}".encode()])
        return cls(**values)


@dataclass(frozen=True)
class WorkerRecord:
    """One live worker as registered in Redis."""

    worker_id: str
    address: str
    models: tuple[str, ...]
    load: int  # resident sessions
    started_at: float
    heartbeat_at: float
    draining: bool
    numerics: str = ""  # what its engine's bits depend on (ssmserve.server.engine.numerics)
    stats: WorkerStats = WorkerStats()

    def to_fields(self) -> dict[str, str]:
        return self.stats.to_fields() | {
            "address": self.address,
            "models": ",".join(self.models),
            "load": str(self.load),
            "started_at": repr(self.started_at),
            "heartbeat_at": repr(self.heartbeat_at),
            "draining": "1" if self.draining else "0",
            "numerics": self.numerics,
        }

    @classmethod
    def from_hash(cls, worker_id: str, raw: dict[bytes, bytes]) -> WorkerRecord:
        models = raw.get(b"models", b"").decode()
        return cls(
            worker_id=worker_id,
            address=raw[b"address"].decode(),
            models=tuple(m for m in models.split(",") if m),
            load=int(raw.get(b"load", b"0")),
            started_at=float(raw.get(b"started_at", b"0")),
            heartbeat_at=float(raw.get(b"heartbeat_at", b"0")),
            draining=raw.get(b"draining", b"0") == b"1",
            numerics=raw.get(b"numerics", b"").decode(),
            stats=WorkerStats.from_hash(raw),
        )


@dataclass(frozen=True)
class SnapshotRecord:
    snapshot_id: str
    step: int
    label: str
    reason: str
    created_at: float
    size: int
    pieces: int

    @classmethod
    def from_hash(cls, snapshot_id: str, raw: dict[bytes, bytes]) -> SnapshotRecord:
        what = f"snapshot {snapshot_id!r}"
        try:
            return cls(
                snapshot_id=snapshot_id,
                step=_int(raw, "step", what),
                label=raw[b"label"].decode(),
                reason=raw[b"reason"].decode(),
                created_at=_float(raw, "created_at", what),
                size=_int(raw, "size", what),
                pieces=_int(raw, "pieces", what),
            )
        except (KeyError, UnicodeDecodeError) as exc:
            raise StoreDataError(f"{what}: its record is incomplete ({exc})") from None


@dataclass(frozen=True)
class SnapshotCommit:
    """One snapshot for :meth:`Store.commit_snapshots`: its owner's lease, its record, its
    bytes, and how many snapshots its session keeps (retention drops the oldest)."""

    lease: SessionLease
    record: SnapshotRecord
    blob: bytes
    max_snapshots: int
