"""What a step and a forecast answer, as Python values; and a value as a ``StepInput``.

numpy is imported where it is used, not with this module: the CLI's commands that move
no arrays (``session list``, ``workers``, ...) then start without it (a tenth of a
second). Once imported, an ``import numpy`` in a function is a dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from ssmserve.v1 import ssmserve_pb2 as pb

if TYPE_CHECKING:
    import numpy as np

#: A session, as the client's methods take it: its id, or the SessionInfo that
#: ``create_session``, ``get_session`` or ``list_sessions`` returned.
SessionRef: TypeAlias = str | pb.SessionInfo


def session_id_of(session: SessionRef) -> str:
    """The id of ``session`` (an id, or a SessionInfo); TypeError for anything else."""
    if isinstance(session, str):
        return session
    if isinstance(session, pb.SessionInfo):
        return session.session_id
    raise TypeError(f"expected a session id (str) or a SessionInfo, got {type(session).__name__}")


@dataclass(frozen=True)
class StepOutput:
    session_id: str
    step: int
    output: np.ndarray  # (o,) float32; empty when the step failed
    replayed: bool
    guard_events: Sequence[pb.GuardEvent]
    snapshot_events: Sequence[pb.SnapshotEvent]
    error: pb.StepError | None

    @classmethod
    def from_pb(cls, result: pb.StepResult) -> StepOutput:
        return cls(
            session_id=result.session_id,
            step=result.step,
            output=vector_array(result.output),
            replayed=result.replayed,
            guard_events=list(result.guard_events),
            snapshot_events=list(result.snapshot_events),
            error=result.error if result.HasField("error") else None,
        )


@dataclass(frozen=True)
class Forecast:
    """A forecast: the outputs of steps ``from_step + 1 ..``, as stepping a copy would give."""

    session_id: str
    from_step: int
    outputs: np.ndarray  # (h, o) float32; h < horizon when ``stopped`` is set
    tokens: np.ndarray | None  # (h,) int64 for token models: the argmax fed back next
    guard_events: Sequence[pb.GuardEvent]
    stopped: pb.StepError | None  # why it ended early (a guard, an output with NaN/Inf)

    @property
    def steps(self) -> np.ndarray:
        """(h,) the step number of each output."""
        import numpy as np

        return np.arange(self.from_step + 1, self.from_step + 1 + len(self.outputs))


def vector_array(vector: pb.Vector) -> np.ndarray:
    """A Vector's floats as a float32 array, whichever form the worker sent (``packed``
    little-endian bytes when asked for, ``values`` otherwise or from older workers)."""
    import numpy as np

    if vector.packed:
        return np.frombuffer(vector.packed, "<f4").astype(np.float32)  # own, writable copy
    return np.asarray(vector.values, np.float32)


def step_input(session_id: str, step: int, value: Any, packed: bool = False) -> pb.StepInput:
    """A token id (int) or a vector (anything numpy turns into floats) as a StepInput.

    ``packed``: the vector as little-endian float32 bytes (``Vector.packed``), which a
    worker decodes in one copy instead of float by float. Workers older than packed
    vectors read only ``values``: send packed only to workers that have it.
    """
    import numpy as np

    if isinstance(value, int | np.integer):
        return pb.StepInput(session_id=session_id, step=step, token=int(value))
    array = np.asarray(value, np.float32).reshape(-1)
    if packed:
        vector = pb.Vector(packed=array.astype("<f4", copy=False).tobytes())
    else:
        vector = pb.Vector(values=array.tolist())
    return pb.StepInput(session_id=session_id, step=step, vector=vector)


@dataclass(frozen=True)
class SessionHistory:
    """What a session did over steps ``steps[0] .. steps[-1]`` (``AsyncClient.history``)."""

    session_id: str
    first_step: int
    inputs: np.ndarray  # (t, i) float32, or (t,) int64 token ids
    outputs: np.ndarray  # (t, o) float32, as they were answered
    snapshots: Sequence[pb.SnapshotInfo]
    events: Sequence[pb.SessionEvent]  # rollbacks and guard events (the newest 1,024)

    @property
    def steps(self) -> np.ndarray:
        """(t,) the step number of each row."""
        import numpy as np

        return np.arange(self.first_step, self.first_step + len(self.outputs))

    @property
    def token_input(self) -> bool:
        return self.inputs.ndim == 1
