"""Sessions born and ended: create, fork, import, close, export.

Creating a session (also by fork or import) writes its metadata, lease and first
snapshot (step 0, or the forked or imported step, with its history window and output)
in one script, so every later step can be rebuilt and a session never exists without
its base. The fencing token starts a new incarnation, so nothing a worker did with an
earlier session of the same id can touch the new one. A fork is copied, not shared: it
has its own first snapshot and nothing else of the source's.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping

import numpy as np

from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.errors import clip
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.config import SessionConfig, SessionDefaults
from ssmserve.server.sessions.errors import (
    ModelMismatchError,
    ReloadingError,
    SnapshotMissingError,
    StepRangeError,
)
from ssmserve.server.sessions.guarded_replay import replay_guarded
from ssmserve.server.sessions.guards import check_output
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.models import ServedModels, split_key
from ssmserve.server.sessions.records import RollbackTarget, StatePoint, UpgradeResult
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import Session, SessionGoneError
from ssmserve.server.sessions.stateful_guards import initial_state, state_of_checkpoint
from ssmserve.server.state.checkpoint import Checkpoint, GuardState, InputHistory
from ssmserve.server.state.lease import SessionLease, lease_clock, new_incarnation
from ssmserve.server.state.session_ids import check_session_id
from ssmserve.server.state.store_errors import SessionClosedError
from ssmserve.server.state.store_layout import MAX_STEP
from ssmserve.server.state.store_records import SessionMeta

log = logging.getLogger(__name__)


class Lifecycle:
    def __init__(
        self,
        models: ServedModels,
        residents: ResidentSessions,
        checkpoints: Checkpoints,
        replay: Replay,
        loader: SessionLoader,
        engines: Mapping[str, EngineLane],
        defaults: SessionDefaults,
    ) -> None:
        self.models = models
        self.residents = residents
        self.store = residents.store
        self.ownership = residents.ownership
        self.checkpoints = checkpoints
        self.replay = replay
        self.loader = loader
        self.engines = engines  # by model key (``ModelLanes``): an upgrade replays on one
        self.defaults = defaults

    async def create(self, model_name: str, session_id: str, config: SessionConfig) -> str:
        """A new session at step 0 of ``model_name`` (a bare name: its newest version
        here), pinned to that version; returns its id."""
        model_name, model = self._model(model_name)
        session_id = self._new_id(session_id)
        config = config.resolve(self.defaults, model.config.output_dim, _input_dim(model))
        self.loader.check_capacity(model, config)
        if self.ownership.draining:
            raise await self.loader.elsewhere(model_name, "create sessions")
        await self._create(session_id, model, model_name, config, model.new_state(), 0, "create")
        return session_id

    async def _create(
        self,
        session_id: str,
        model: Engine,
        model_name: str,
        config: SessionConfig,
        state: SessionState,
        step: int,
        reason: str,
        history: InputHistory | None = None,
        output: np.ndarray | None = None,
        guards: GuardState | None = None,
    ) -> Session:
        """A new session at ``step``, owned here: its metadata, lease and first snapshot
        (``state``, the ``history`` window, the ``output`` of ``step``, the guard state
        there: ``guards``, or its guards' first if they carry state) written at once.

        The fencing token starts a new incarnation, so nothing a worker did with an
        earlier session of the same id can touch this one.
        """
        now = time.time()
        lease = SessionLease(session_id, f"{new_incarnation()}.1", self.ownership.worker_id)
        s = self.loader.resident(
            session_id, model, model_name, config, state, step, now, lease, history
        )
        if output is not None:  # a resend of ``step`` is answered, as by the source
            s.recent.remember_output(step, output)
        if guards is None:
            guards = initial_state(config.guards, _input_dim(model), model.config.output_dim)
        s.guard_state = guards
        blob, record = await self.checkpoints.encode(
            self.checkpoints.checkpoint(s, step, state, reason)
        )
        meta = SessionMeta(
            session_id, model_name, model.fingerprint, step, step + 1, config.to_bytes(), now,
            now, False, epoch=1, owner=self.ownership.worker_id,
            owner_addr=self.ownership.address, token=lease.token,
            numerics=self.ownership.numerics,
        )  # fmt: skip
        sent_at = lease_clock()
        await self.store.create_session(
            meta, self.ownership.lease_ms, record, blob, config.max_snapshots
        )
        s.snapshotted(step)
        self.residents.add(
            s,
            self.loader.footprint(model, config),
            self.ownership.new_lease(session_id, lease.token, sent_at),
        )
        log.info(
            "session %s created by %s at step %d", session_id, reason, step,
            extra={"session_id": session_id, "step": step, "token": s.lease.token,
                   "event": "created", "reason": reason, "model": model_name},
        )  # fmt: skip
        return s

    async def fork(
        self, session_id: str, target: RollbackTarget, new_session_id: str = ""
    ) -> tuple[str, StatePoint]:
        """A new session at the source's state at ``target`` (default: its current step).

        The fork gets a first snapshot of its own at the fork point, carrying the source's
        input history window up to there; nothing else is shared with the source, so the
        two never touch each other's keys (see the proto's ForkRequest).
        """
        new_id = self._new_id(new_session_id)
        s = await self.loader.session(session_id)
        self.loader.check_capacity(s.model, s.config)
        point = await self.replay.point(s, target, "fork", need_output=False)
        await self._create(
            new_id, s.model, s.model_name, s.config, point.state, point.step, "fork",
            point.history, point.output, point.guards,
        )  # fmt: skip
        log.info(
            "session %s forked from %s at step %d (snapshot %s + %d replayed)",
            new_id, s.id, point.step, point.from_snapshot_id or "-", point.replayed_steps,
        )  # fmt: skip
        return new_id, point

    async def close(self, session_id: str, final_snapshot: bool) -> tuple[int, str]:
        s = await self.loader.session(session_id)
        async with self.residents.hold(s):
            snapshot_id = ""
            if final_snapshot:
                record = await self.checkpoints.write(s, s.step, s.state, "close")
                snapshot_id = record.snapshot_id
            await self.residents.write(
                s, lambda lease: self.store.close_session(lease, snapshot_id)
            )
            s.fail_queued(SessionClosedError(f"session {s.id!r} was closed"))
            self.residents.remove(s.id)
            log.info(
                "session %s closed at step %d", s.id, s.step,
                extra={"session_id": s.id, "step": s.step, "token": s.lease.token,
                       "event": "closed"},
            )  # fmt: skip
            return s.step, snapshot_id

    async def export(self, session_id: str, snapshot_id: str) -> bytes:
        meta = await self.loader.meta(session_id, allow_closed=True)
        if snapshot_id or meta.closed:
            record = (
                await self.store.snapshot_by_id(session_id, snapshot_id)
                if snapshot_id
                else await self.store.snapshot_at_or_before(session_id, meta.step)
            )
            if record is None:
                raise SnapshotMissingError(
                    f"session {session_id!r} has no snapshot {clip(snapshot_id)}"
                )
            return await self.store.read_blob(session_id, record)
        s = await self.loader.session(session_id)
        async with self.residents.hold(s):
            return self.checkpoints.checkpoint(s, s.step, s.state, "export").encode()

    async def import_checkpoint(
        self,
        blob: bytes | memoryview,
        session_id: str,
        model_name: str,
        config: SessionConfig,
        replace: bool,
        adopt_id: Callable[[str], str] = str,
    ) -> str:
        """A new session from a checkpoint (``replace``: in place of one with its id).
        Without ``session_id`` it takes the checkpoint's, as ``adopt_id`` maps it (a
        tenant's import keeps the id in its own tenant)."""
        ckpt = Checkpoint.decode(blob)
        if model_name and "@" not in model_name and self.models.versions(model_name):
            # A bare name: the version of it whose weights made the checkpoint.
            same = [k for k in self.models.versions(model_name)
                    if self.models[k].fingerprint == ckpt.fingerprint]  # fmt: skip
            model_name = same[-1] if same else self.models.resolve(model_name)
        if model_name:
            model_name, model = self._model(model_name)
        else:
            found = [n for n, m in self.models.items() if m.fingerprint == ckpt.fingerprint]
            if not found:
                raise ModelMismatchError(
                    f"no model on this worker has the checkpoint's fingerprint "
                    f"{ckpt.fingerprint[:16]} (model {ckpt.model_id!r}); loaded: "
                    f"{', '.join(sorted(self.models))} (the weights' format is part of a "
                    f"fingerprint: import it where the worker's --quantize is the one it "
                    f"was made with)"
                )
            model_name, model = found[0], self.models[found[0]]
        ckpt.check_model(model)
        if ckpt.step > MAX_STEP:
            raise StepRangeError(
                f"the checkpoint is at step {ckpt.step}, beyond the last step a session can "
                f"take ({MAX_STEP})"
            )
        session_id = self._new_id(session_id or adopt_id(ckpt.session_id))
        config = config.resolve(self.defaults, model.config.output_dim, _input_dim(model))
        self.loader.check_capacity(model, config)
        if replace:
            await self._drop_for_replace(session_id)
        if self.ownership.draining:
            raise await self.loader.elsewhere(model_name, "import sessions")
        # Copies: the decoded arrays are views into ``blob``, which must not stay alive
        # (or stay counted) for the session's life.
        output = None if ckpt.output is None else ckpt.output.copy()
        guards = state_of_checkpoint(
            ckpt, config.guards, _input_dim(model), model.config.output_dim
        )  # its own copies
        await self._create(
            session_id, model, model_name, config, ckpt.state.copy(), ckpt.step, "import",
            ckpt.history, output, guards,
        )  # fmt: skip
        return session_id

    async def upgrade(self, session_id: str, requested: str) -> UpgradeResult:
        """Move a session to another version of its model (default: the newest here) by
        replaying its retained inputs through it: a replay, not a state conversion.

        The new version starts from a fresh state at the oldest step whose input is still
        kept (just after the oldest kept snapshot) and runs every kept input up to the
        session's step; inputs before that are gone, so when retention dropped some the
        new state is what the new version makes of the kept ones only. The session keeps
        its id and step (the next input is step + 1 as before) and starts a new
        incarnation: a new fencing token, the old version's snapshots and log dropped, a
        first snapshot of the new state. Asking for the version it runs changes nothing.
        """
        s = await self.loader.session(session_id)
        old_key = s.model_name
        key, model = self._model(requested or split_key(old_key)[0])
        if key == old_key:
            return UpgradeResult(old_key, s.step, 0)
        c, old = model.config, s.model.config
        if (c.is_token_model, c.input_dim, c.output_dim) != (
            old.is_token_model,
            old.input_dim,
            old.output_dim,
        ):
            raise ModelMismatchError(
                f"model {key!r} takes or gives other shapes than {old_key!r} (inputs "
                f"{c.input_dim}, outputs {c.output_dim}): a session cannot move between them"
            )
        config = s.config
        self.loader.check_capacity(model, config)
        async with self.residents.hold(s):
            _count, oldest = await self.store.snapshot_count_and_oldest(session_id)
            first, step = (oldest or 0) + 1, s.step
            raw = await self.replay.inputs(s, first, step)
            inputs = s.codec.decode_many(raw) if raw else s.codec.empty()
            guards = initial_state(config.guards, _input_dim(model), c.output_dim)
            output = None
            if guards is not None:  # judged again, step by step, from a fresh guard state
                answers, state, guards = await replay_guarded(
                    self.engines[key], config.guards, guards, inputs, model.new_state(), first
                )
                output = answers[-1] if answers else None
            else:
                outputs, state = await self.engines[key].run(inputs, model.new_state())
                if len(outputs):
                    output = check_output(config.guards, step, outputs[-1].copy()).output
            await self.residents.write(s, lambda lease: self.store.close_session(lease))
            s.fail_queued(
                ReloadingError(f"session {session_id!r} moved to model {key!r}; send again")
            )
            self.residents.remove(session_id)
        window = config.history_window
        kept = inputs[max(0, len(inputs) - window) :] if window else inputs[:0]
        history = InputHistory(step - len(kept) + 1, kept)  # empty: first_step = step + 1
        await self._create(
            session_id, model, key, config, state, step, "upgrade", history, output, guards
        )  # fmt: skip
        log.info(
            "session %s upgraded from %s to %s at step %d (%d inputs replayed from step %d)",
            session_id, old_key, key, step, len(inputs), first,
            extra={"session_id": session_id, "step": step, "event": "upgraded", "model": key},
        )  # fmt: skip
        return UpgradeResult(old_key, first if len(inputs) else step + 1, len(inputs))

    async def _drop_for_replace(self, session_id: str) -> None:
        meta = await self.store.get_meta(session_id)
        if meta is None:
            return
        if meta.closed:  # nobody owns a closed session: its last token still fences
            await self.store.close_session(SessionLease(session_id, meta.token, ""))
            return
        s = await self.loader.session(session_id)  # take it over (or be redirected to its owner)
        async with self.residents.hold(s):
            await self.residents.write(s, lambda lease: self.store.close_session(lease))
            s.fail_queued(SessionGoneError(f"session {session_id!r} was replaced by an import"))
            self.residents.remove(session_id)

    # ------------------------------------------------------------------ helpers

    def _model(self, requested: str) -> tuple[str, Engine]:
        """The key and model a request names (``ServedModels.resolve``: a bare name means
        its newest version here)."""
        key = self.models.resolve(requested)
        return key, self.models[key]

    @staticmethod
    def _new_id(session_id: str) -> str:
        return check_session_id(session_id, stored=True) if session_id else secrets.token_hex(8)


def _input_dim(model: Engine) -> int:
    """The model's input width as guard rules see it (0: it takes token ids)."""
    return 0 if model.config.is_token_model else model.config.input_dim
