"""Per-session settings: snapshot policy, retention, guards, durability, idle TTL, labels.

Stored with the session (msgpack in its metadata hash) so a session restored on any worker
keeps behaving the same way. Zero in a request means "the worker's default"
(:class:`SessionDefaults`); :meth:`SessionConfig.resolve` fills those in and validates.
"""

from __future__ import annotations

import enum
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import msgpack
from msgpack.exceptions import UnpackException

from ssmserve.server.errors import SsmserveError, clip
from ssmserve.server.sessions.guards import MAX_RULES, GuardRule
from ssmserve.server.state.store_errors import StoreDataError


class Durability(enum.IntEnum):
    LOG = 1  # answer a step only after its input is recorded in Redis (default)
    SNAPSHOT = 2  # periodic snapshots only: a crash loses the steps since the last one
    NONE = 3  # write only when asked (Snapshot, Close with a final snapshot, eviction)


#: The label of the sessions the HTTP door makes (``ssmserve sessions`` shows it). They
#: stay on the worker that made them: the door keeps them as its prefix cache and closes
#: them itself, so rebalancing leaves them where they are.
DOOR_LABELS: Mapping[str, str] = MappingProxyType({"created-by": "http"})


def stays_here(labels: Mapping[str, str]) -> bool:
    """Whether a session with ``labels`` is one rebalancing leaves on its worker."""
    return all(labels.get(k) == v for k, v in DOOR_LABELS.items())


class SessionConfigError(SsmserveError):
    """A session setting is out of range (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class SessionDefaults:
    """Worker-wide defaults and limits for session settings."""

    snapshot_every: int = 64  # steps between periodic snapshots
    # A session that does not ask for a snapshot phase gets phase 0 (snapshots at multiples
    # of snapshot_every), or with this set a random one, so that sessions created together
    # (lockstep streams) do not all come due on the same tick (--spread-snapshots).
    spread_snapshots: bool = False
    max_snapshots: int = 16  # snapshots kept per session (retention)
    history_window: int = 256  # inputs carried in each checkpoint's history
    idle_ttl_s: float = 0.0  # 0: sessions stay in memory until closed
    max_snapshot_every: int = 1 << 20
    max_snapshots_limit: int = 1024
    max_history_window: int = 1 << 16
    max_labels: int = 32


#: The labels of a session without any: one shared, read-only mapping (a resolved config
#: lives as long as its session, and an empty dict of each is 64 bytes).
NO_LABELS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SessionConfig:
    snapshot_every: int = 0
    max_snapshots: int = 0
    history_window: int = 0
    guards: tuple[GuardRule, ...] = ()
    durability: Durability = Durability.LOG
    idle_ttl_s: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)
    # Periodic snapshots at steps s with s % snapshot_every == snapshot_phase; None: the
    # worker picks (resolve).
    snapshot_phase: int | None = None

    def snapshot_due(self, step: int) -> bool:
        """Whether a periodic snapshot is due after ``step`` (a resolved config)."""
        return step % self.snapshot_every == self.snapshot_phase

    def resolve(
        self, defaults: SessionDefaults, output_dim: int, input_dim: int | None = None
    ) -> SessionConfig:
        """Fill defaults in for zeros; raise SessionConfigError on anything out of range
        (a guard rule that does not fit a model of these widths: GuardRuleError;
        ``input_dim`` 0: a token model)."""
        d = defaults
        out = replace(
            self,
            snapshot_every=self.snapshot_every or d.snapshot_every,
            max_snapshots=self.max_snapshots or d.max_snapshots,
            history_window=self.history_window or d.history_window,
            idle_ttl_s=self.idle_ttl_s or d.idle_ttl_s,
            labels=_own_labels(self.labels),
        )
        _at_most("snapshot_every", out.snapshot_every, d.max_snapshot_every)
        if out.snapshot_phase is None:
            phase = secrets.randbelow(out.snapshot_every) if d.spread_snapshots else 0
            out = replace(out, snapshot_phase=phase)
        elif not 0 <= out.snapshot_phase < out.snapshot_every:
            raise SessionConfigError(
                f"snapshot_phase must be in [0, snapshot_every) = [0, {out.snapshot_every}), "
                f"got {out.snapshot_phase}"
            )
        _at_most("max_snapshots", out.max_snapshots, d.max_snapshots_limit)
        _at_most("history_window", out.history_window, d.max_history_window)
        if not (math.isfinite(out.idle_ttl_s) and out.idle_ttl_s >= 0):
            raise SessionConfigError(f"idle_ttl_s must be >= 0 seconds, got {out.idle_ttl_s}")
        if len(out.labels) > d.max_labels or any(
            len(k) > 64 or len(v) > 256 for k, v in out.labels.items()
        ):
            raise SessionConfigError(
                f"at most {d.max_labels} labels, keys up to 64 and values up to 256 characters"
            )
        if len(out.guards) > MAX_RULES:
            raise SessionConfigError(f"at most {MAX_RULES} guard rules per session")
        names = [g.name for g in out.guards]
        if len(set(names)) != len(names):
            raise SessionConfigError("guard names must be unique within a session")
        for rule in out.guards:
            rule.validate(output_dim, input_dim)
        return out

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "snapshot_every": self.snapshot_every,
                "max_snapshots": self.max_snapshots,
                "history_window": self.history_window,
                "guards": [g.to_dict() for g in self.guards],
                "durability": int(self.durability),
                "idle_ttl_s": self.idle_ttl_s,
                "labels": dict(self.labels),
                "snapshot_phase": self.snapshot_phase,
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> SessionConfig:
        """A config as :meth:`to_bytes` stored it. What Redis holds is untrusted: bytes that
        do not decode to a config raise ``StoreDataError`` (DATA_LOSS for that session;
        a listing skips it), never an unnamed decoder error."""
        try:
            d = msgpack.unpackb(raw, raw=False)
            return cls(
                snapshot_every=int(d["snapshot_every"]),
                max_snapshots=int(d["max_snapshots"]),
                history_window=int(d["history_window"]),
                guards=tuple(GuardRule.from_dict(g) for g in d["guards"]),
                durability=Durability(d["durability"]),
                idle_ttl_s=float(d["idle_ttl_s"]),
                labels=_own_labels(d["labels"]),
                # A config stored without a phase snapshots at multiples of snapshot_every.
                snapshot_phase=int(d.get("snapshot_phase") or 0),
            )
        except (ValueError, TypeError, KeyError, AttributeError, UnpackException) as exc:
            raise StoreDataError(
                f"the session's stored config does not decode "
                f"({type(exc).__name__}: {clip(str(exc))})"
            ) from None


def _own_labels(labels: Mapping[str, str]) -> Mapping[str, str]:
    """A copy of ``labels`` that nothing else changes (:data:`NO_LABELS` when empty)."""
    return dict(labels) if labels else NO_LABELS


def _at_most(name: str, value: int, limit: int) -> None:
    if not 1 <= value <= limit:
        raise SessionConfigError(f"{name} must be between 1 and {limit}, got {value}")
