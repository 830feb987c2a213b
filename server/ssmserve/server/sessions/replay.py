"""Rebuilding a session's state at a step: the newest snapshot at or before it, plus replay.

:meth:`Replay.rebuild` is the one primitive behind every way back to a past step: load
(an evicted session, or one whose worker died), rollback (by a monitor or a guard), fork
and forecast from a past step, and the output of a resent step that memory no longer
holds. Replays are prefills (``EngineLane.prefill``: each layer's products over all the
replayed steps at once, the head only for the outputs asked for), which compute the bits
of stepping by construction, so the replayed state equals the state the session had.
Replays run on the model's engine lane, so a long one never stalls the event loop. A
session whose guards carry state replays from the guard state its snapshot holds and
judges every step again (``guarded_replay``), so it takes the decisions it took live.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import CheckpointError, clip
from ssmserve.server.sessions.checkpoints import Checkpoints, recent_history
from ssmserve.server.sessions.errors import (
    BadStepInputError,
    ModelMismatchError,
    RollbackRangeError,
    SnapshotMissingError,
)
from ssmserve.server.sessions.guarded_replay import replay_guarded
from ssmserve.server.sessions.guards import check_output
from ssmserve.server.sessions.records import RollbackTarget, StatePoint
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import Session
from ssmserve.server.sessions.stateful_guards import is_stateful, state_of_checkpoint
from ssmserve.server.state.checkpoint import Checkpoint, GuardState, InputHistory
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_records import SnapshotRecord


@dataclass(frozen=True)
class Rebuilt:
    """A session's state at ``step``, rebuilt from snapshot ``record`` plus replay."""

    step: int
    record: SnapshotRecord
    checkpoint: Checkpoint  # the snapshot as read (its history window, its step's output)
    state: SessionState
    # Guarded outputs of the last replayed steps, ``outputs_from .. step`` (all of
    # record.step+1..step unless the rebuild asked for fewer: ``Replay.rebuild``'s tail).
    outputs: list[np.ndarray]
    inputs: list[bytes]  # the encoded inputs of every replayed step
    guards: GuardState | None = None  # what the session's guards carry at ``step``

    @property
    def replayed(self) -> int:
        return self.step - self.record.step

    @property
    def outputs_from(self) -> int:
        """The step of ``outputs[0]``."""
        return self.step - len(self.outputs) + 1


class Replay:
    def __init__(
        self,
        store: Store,
        residents: ResidentSessions,
        checkpoints: Checkpoints,
        engines: Mapping[str, EngineLane],
    ) -> None:
        self.store = store
        self.residents = residents
        self.checkpoints = checkpoints
        self.engines = engines

    async def rebuild(
        self,
        s: Session,
        step: int,
        record: SnapshotRecord | None = None,
        tail: int | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> Rebuilt:
        """The state of ``s`` at ``step``: snapshot ``record`` (default: the newest at or
        before ``step``) plus the logged inputs after it, replayed, with the outputs of the
        last ``tail`` replayed steps (None: all; a prefill computes the head only for
        those). ``checkpoint``: ``record``'s, when the caller has it decoded (a load:
        ``Store.snapshot_and_blob``, :meth:`decode`). Changes nothing."""
        if record is None:
            record = await self.store.snapshot_at_or_before(s.id, step)
            if record is None:
                raise await self.out_of_range(s, step)
        ckpt = checkpoint
        if ckpt is None:
            ckpt = await self._read_checkpoint(s.id, record, s.model)
        raw = await self.inputs(s, record.step + 1, step)
        guards = self.guards_at(s, ckpt)
        if not raw:
            return Rebuilt(step, record, ckpt, ckpt.state, [], [], guards)
        skip = 0 if tail is None else max(0, len(raw) - tail)
        guarded, state, guards = await self._replay(
            s, raw, ckpt.state, record.step + 1, skip, guards
        )
        return Rebuilt(step, record, ckpt, state, guarded, raw, guards)

    @staticmethod
    def guards_at(s: Session, ckpt: Checkpoint) -> GuardState | None:
        """The guard state ``s`` has at ``ckpt``'s step (``stateful_guards``): None for
        guards that carry none (the model's shape is not needed then)."""
        if not is_stateful(s.config.guards):
            return None
        c = s.model.config
        input_dim = 0 if c.is_token_model else c.input_dim
        return state_of_checkpoint(ckpt, s.config.guards, input_dim, c.output_dim)

    async def _replay(
        self,
        s: Session,
        raw: list[bytes],
        state: SessionState,
        first: int,
        skip: int,
        guards: GuardState | None = None,
    ) -> tuple[list[np.ndarray], SessionState, GuardState | None]:
        """Inputs ``raw`` of steps ``first ..`` from ``state``, as one prefill on the model's
        lane (a long replay must not stall the event loop): the guarded outputs of the
        steps from ``first + skip`` on, the state after the last, and with ``guards`` (the
        guard state at ``first - 1``) every step judged again and the guard state after."""
        count = len(raw)
        if guards is not None:
            lane = self.engines[s.model_name]
            outputs, state, guards = await replay_guarded(
                lane, s.config.guards, guards, s.codec.decode_many(raw), state, first
            )
            self.store.metrics.replayed_steps.inc(count)
            return outputs[skip:], state, guards
        rows = "all" if skip == 0 else "none" if skip >= count else np.arange(skip, count)
        outputs, state = await self.engines[s.model_name].prefill(
            s.codec.decode_many(raw), state, rows
        )
        self.store.metrics.replayed_steps.inc(count)
        guarded = [
            check_output(s.config.guards, first + skip + i, out).output
            for i, out in enumerate(outputs)
        ]
        return guarded, state, None

    async def restore_to(
        self, s: Session, target: int, record: SnapshotRecord | None = None
    ) -> tuple[int, str, int]:
        """Put ``s`` exactly at step ``target``; returns (step, snapshot used, replayed).

        Computes everything first and changes Redis (the history cut) last, so a failure
        anywhere leaves the session as it was. The caller holds the session.
        """
        await s.snapshots.settled(hurry=True)  # a guard rollback holds a batch, not the gate
        if record is None and target == s.step:
            return target, "", 0  # already there; nothing after the current step to cut
        rebuilt = await self.rebuild(s, target, record, tail=1)  # the output at the target
        await self.residents.write(
            s, lambda lease: self.store.cut_history(lease, target, s.step, time.time())
        )
        s.rebuilt_at(rebuilt.state, target, rebuilt.record.step, guards=rebuilt.guards)
        s.recent.cut_after(target)
        if s.recent.input_at(target) is None:  # memory had none of it: keep what replay made
            s.recent.remember_inputs(rebuilt.record.step + 1, rebuilt.inputs)
            for i, output in enumerate(rebuilt.outputs):
                s.recent.remember_output(rebuilt.outputs_from + i, output)
        elif s.recent.output_at(target) is None:
            # Memory keeps inputs for more steps than outputs (history_window against
            # output_window): the target's output is what the replay made last, or the
            # snapshot's own. A forecast or fork from here needs it, and a fork's first
            # snapshot carries it (without it, the fork could never forecast once reloaded).
            output = rebuilt.outputs[-1] if rebuilt.outputs else rebuilt.checkpoint.output
            if output is not None:
                s.recent.remember_output(target, output)
        return target, rebuilt.record.snapshot_id, rebuilt.replayed

    async def resolve(
        self, s: Session, target: RollbackTarget, what: str
    ) -> tuple[int, SnapshotRecord | None]:
        """The step a target names, and its snapshot if it names one. The caller holds ``s``."""
        record: SnapshotRecord | None = None
        if target.snapshot_id is not None:
            record = await self.store.snapshot_by_id(s.id, target.snapshot_id)
            if record is None:
                raise SnapshotMissingError(
                    f"session {s.id!r} has no snapshot {clip(target.snapshot_id)}"
                )
            t = record.step
        elif target.label is not None:
            record = await self.store.snapshot_by_label(s.id, target.label)
            if record is None:
                raise SnapshotMissingError(
                    f"session {s.id!r} has no snapshot labelled {clip(target.label)}"
                )
            t = record.step
        elif target.steps_back is not None:
            if target.steps_back > s.step:
                raise RollbackRangeError(
                    f"cannot go {target.steps_back} steps back: session {s.id!r} is at "
                    f"step {s.step}"
                )
            t = s.step - target.steps_back
        elif target.step is not None:
            t = target.step
        else:
            raise BadStepInputError(f"{what} needs a snapshot id, a label, a step or steps back")
        if t > s.step:
            raise RollbackRangeError(
                f"cannot {what} session {s.id!r} at step {t}: it is at step {s.step}"
                if what != "roll back"
                else f"cannot roll session {s.id!r} forward to step {t}: it is at step {s.step}"
            )
        return t, record

    async def point(
        self, s: Session, target: RollbackTarget, what: str, need_output: bool
    ) -> StatePoint:
        """The session at ``target`` as rollback would reach it, without changing it.

        A target of ``step=None`` is the current step. Holds the session only while it
        reads: between two steps, with no background write in flight.
        """
        async with self.residents.hold(s, read_only=True):
            if target == RollbackTarget(step=None):
                t, record = s.step, None
            else:
                t, record = await self.resolve(s, target, what)
            if record is None and t == s.step:
                history, guards = recent_history(s, t), s.guard_state
                state, output, snapshot_id, replayed = s.state, s.recent.output_at(t), "", 0
            else:
                rebuilt = await self.rebuild(s, t, record, tail=1)
                state, guards = rebuilt.state, rebuilt.guards
                history = _history_at(s, rebuilt.checkpoint.history, rebuilt.inputs, t)
                output = rebuilt.outputs[-1] if rebuilt.outputs else s.recent.output_at(t)
                if output is None:
                    output = rebuilt.checkpoint.output
                snapshot_id, replayed = rebuilt.record.snapshot_id, rebuilt.replayed
            if output is None and need_output and t > 0:
                with contextlib.suppress(RollbackRangeError):  # the caller says what is missing
                    output = await self.output_at(s, t)
            return StatePoint(t, state, output, history, snapshot_id, replayed, guards)

    async def series(
        self, s: Session, first: int, last: int
    ) -> tuple[list[bytes], list[np.ndarray]]:
        """Inputs and outputs of steps ``first..last`` as they were answered: inputs from
        memory or the log, outputs replayed from the newest snapshot before ``first``
        (bit-exact, guards applied). Changes nothing.

        The session is held (read-only) only while the snapshot and the inputs are read,
        not while they are replayed: a long range of a large model replays for a while,
        and the session goes on stepping meanwhile (its new steps are after ``last``)."""
        async with self.residents.hold(s, read_only=True):
            record = await self.store.snapshot_at_or_before(s.id, first - 1)
            if record is None:
                raise await self.out_of_range(s, first - 1)
            ckpt = await self._read_checkpoint(s.id, record, s.model)
            raw = await self.inputs(s, record.step + 1, last)
        if not raw:
            return [], []
        skip = first - (record.step + 1)
        guards = self.guards_at(s, ckpt)
        guarded, _state, _guards = await self._replay(
            s, raw, ckpt.state, record.step + 1, skip, guards
        )
        return raw[skip:], guarded

    async def output_at(self, s: Session, step: int) -> np.ndarray:
        """The (guarded) output of an applied step that is no longer in memory: replay it."""
        record = await self.store.snapshot_at_or_before(s.id, step - 1)
        if record is None:
            raise RollbackRangeError(
                f"step {step} of session {s.id!r} is older than its kept history, so "
                f"its output cannot be sent again"
            )
        return (await self.rebuild(s, step, record, tail=1)).outputs[-1]

    async def out_of_range(self, s: Session, step: int) -> RollbackRangeError:
        _count, oldest = await self.store.snapshot_count_and_oldest(s.id)
        return RollbackRangeError(
            f"session {s.id!r} cannot reach step {step}: its oldest kept snapshot is at step "
            f"{oldest} (retention keeps {s.config.max_snapshots})"
        )

    async def _read_checkpoint(
        self, session_id: str, record: SnapshotRecord, model: Engine
    ) -> Checkpoint:
        return self.decode(
            session_id, record, model, await self.store.read_blob(session_id, record)
        )

    @staticmethod
    def decode(session_id: str, record: SnapshotRecord, model: Engine, blob: bytes) -> Checkpoint:
        """Snapshot ``record``'s checkpoint from its bytes, checked against ``model``."""
        try:
            ckpt = Checkpoint.decode(blob)
            ckpt.check_model(model)
        except CheckpointError as exc:
            raise ModelMismatchError(
                f"snapshot {record.snapshot_id} of session {session_id!r} is unusable: {exc}"
            ) from None
        return ckpt

    async def inputs(self, s: Session, first: int, last: int) -> list[bytes]:
        """Inputs of steps first..last: from memory when it has them, else the log."""
        if last < first:
            return []
        ring = [s.recent.input_at(step) for step in range(first, last + 1)]
        if all(raw is not None for raw in ring):
            return ring  # type: ignore[return-value]
        unflushed = s.recent.unflushed
        split = unflushed.first if unflushed else last + 1
        stored = await self.store.read_log(s.id, first, min(last, split - 1))
        memory = unflushed.inputs(first, last)
        return stored + memory


def _history_at(s: Session, base: InputHistory, raw: list[bytes], t: int) -> InputHistory:
    """The history window ending at ``t``: a checkpoint's history plus replayed inputs."""
    inputs = np.concatenate([base.inputs, s.codec.decode_many(raw)]) if raw else base.inputs
    window = s.config.history_window
    kept = inputs[len(inputs) - window :] if window else inputs[:0]
    return InputHistory(t - len(kept) + 1, kept)
