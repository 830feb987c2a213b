"""What session operations take and give back: targets, results, views (values only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.sessions.config import SessionConfig
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.state.checkpoint import GuardState, InputHistory
from ssmserve.server.state.store_records import SnapshotRecord


@dataclass(frozen=True)
class SessionView:
    """What GetSession answers: a session resident here or only in the store."""

    session_id: str
    model: str
    fingerprint: str
    step: int
    config: SessionConfig
    created_at: float
    updated_at: float
    snapshot_count: int
    oldest_rollback_step: int
    owner: str
    resident: bool
    input_dim: int
    output_dim: int
    token_input: bool
    closed: bool


@dataclass(frozen=True)
class RollbackTarget:
    """Exactly one of these is set."""

    snapshot_id: str | None = None
    label: str | None = None
    step: int | None = None
    steps_back: int | None = None


@dataclass(frozen=True)
class RollbackResult:
    step: int
    from_snapshot_id: str
    replayed_steps: int


@dataclass(frozen=True)
class StatePoint:
    """A session as it was at one step, rebuilt without changing it (forecast, fork)."""

    step: int
    state: SessionState
    output: np.ndarray | None  # the (guarded) output of ``step``; None when unknown
    history: InputHistory  # the inputs up to ``step`` (the session's history window)
    from_snapshot_id: str  # "" when the session was at ``step`` (its live state)
    replayed_steps: int
    guards: GuardState | None = None  # what its stateful guards carry at ``step``


@dataclass(frozen=True)
class ForkResult:
    view: SessionView  # the fork
    source_session_id: str
    step: int
    from_snapshot_id: str
    replayed_steps: int


@dataclass(frozen=True)
class History:
    """What a session did over steps ``first_step .. first_step + len(inputs) - 1``."""

    first_step: int
    inputs: np.ndarray  # (t, i) float32, or (t,) int64 tokens
    outputs: np.ndarray  # (t, o) float32, as answered
    snapshots: list[SnapshotRecord]
    events: list[SessionEvent]


@dataclass(frozen=True)
class UpgradeResult:
    """A session moved to another version of its model (``Lifecycle.upgrade``)."""

    from_model: str
    replayed_from_step: int  # the first kept input the new version was run on
    replayed_steps: int  # 0: it ran that version already, nothing changed
