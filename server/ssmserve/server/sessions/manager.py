"""The session manager: the session operations of one worker, as the API calls them.

Everything that changes a session goes through here, and every change is all-or-nothing:
a request that fails leaves the session exactly as it was. The manager composes the
pieces, one module each, each given what it works with when it is made:

- ``residency``: the resident sessions and the fencing of their writes (a session is
  answered for only while this worker's clock says its lease surely runs);
- ``loading``: load (acquire + rebuild), unload, idle eviction, numerics checks;
- ``checkpoints``: snapshots, periodic ones in the background;
- ``replay``: the one primitive that rebuilds a session's state at a step (newest
  snapshot at or before it, plus replay), behind load, rollback, fork and forecast;
- ``intake``: steps checked and queued on their sessions (the Stream pipeline's);
- ``model_lanes``: per model, its engine lane, ``stepper`` and ``forecaster``.

The worker wires the components that work beside the manager from these (``intake``
for streams; ``residents``, ``loader``, ``checkpoints`` and ``lifecycle`` for
``migration``); the API asks the manager its operations and a few queries (what is
resident, per model and per tenant; the worker's counts).

What it adds: **create / import / fork** write the session's metadata, lease and first
snapshot (step 0, or the imported or forked step) in one script, so every step from
there on can be rebuilt and a session never exists without its base. **Rollback to t**
restores the state at t (``replay``), then cuts history after t in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ssmserve.server.cluster.ownership import Ownership
from ssmserve.server.cluster.store_guard import StoreGuard
from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.tokenizer import ModelTokenizer
from ssmserve.server.errors import SessionMovedError, SsmserveError, clip
from ssmserve.server.observability.metrics import ResidentCounts
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.config import SessionConfig, SessionDefaults
from ssmserve.server.sessions.errors import (
    BadLabelError,
    BadPageTokenError,
    ReloadingError,
    RollbackRangeError,
    lease_lapsed,
)
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.events import record as record_events
from ssmserve.server.sessions.forecaster import (
    BadHorizonError,
    ForecastJob,
    ForecastLimitError,
    ForecastSettings,
    ForecastUnsupportedError,
    feedback,
)
from ssmserve.server.sessions.history import HistoryReader
from ssmserve.server.sessions.intake import StepIntake
from ssmserve.server.sessions.lifecycle import Lifecycle
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.memory import WorkerMemory
from ssmserve.server.sessions.model_lanes import ModelLanes
from ssmserve.server.sessions.models import ServedModels
from ssmserve.server.sessions.records import (
    ForkResult,
    History,
    RollbackResult,
    RollbackTarget,
    SessionView,
    UpgradeResult,
)
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import Session, SessionGoneError
from ssmserve.server.sessions.stepper import StepperSettings
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store import BadSessionIdError, SnapshotRecord, Store
from ssmserve.server.state.store_errors import (
    LabelTakenError,
    SessionMissingError,
    StoreDataError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManagerSettings:
    """Limits of one worker's session manager (documented defaults)."""

    defaults: SessionDefaults = field(default_factory=SessionDefaults)
    stepper: StepperSettings = field(default_factory=StepperSettings)
    forecast: ForecastSettings = field(default_factory=ForecastSettings)
    max_sessions: int = 10_000  # resident sessions; creating or loading more is refused
    # The worker's one memory budget (``memory.WorkerMemory``): what resident sessions
    # may hold (state, input history, recorded outputs and unflushed inputs, each at its
    # bound), running forecasts (state copy and answer) and imports being decoded, all
    # together. None: three quarters of the machine's memory.
    memory_budget_bytes: int | None = None
    max_queued_steps: int = 4096  # per session, waiting for the stepper
    output_window: int = 64  # outputs kept per session to answer resent steps from memory
    idle_check_s: float = 1.0  # how often idle sessions are looked for
    # Background snapshot writes running at once on this worker (all sessions). Sessions
    # that step in lockstep come due together; a bound spreads their writes over the
    # following steps instead of stalling one tick behind dozens of Redis round trips.
    snapshot_writes_in_flight: int = 2
    list_page_size: int = 100
    max_list_page_size: int = 1000
    max_history_steps: int = 65_536  # steps one GetHistory call may return
    max_history_output_bytes: int = 64 << 20  # and their outputs' bytes


class SessionManager:
    """The session operations of one worker (``memory``: the worker's one budget, which
    the API's imports share; ``guard``: the store's identity checks, whose resets drop the
    sessions the store lost)."""

    def __init__(
        self,
        models: Mapping[str, Engine],
        store: Store,
        ownership: Ownership,
        memory: WorkerMemory,
        settings: ManagerSettings,
        guard: StoreGuard | None = None,
    ) -> None:
        self.models = ServedModels(models)
        self.store = store
        self.ownership = ownership
        self.memory = memory
        self.settings = settings
        self.metrics = store.metrics  # the worker's, handed to its store
        self.residents = ResidentSessions(store, ownership, memory, guard)
        self.checkpoints = Checkpoints(store, self.residents, settings.snapshot_writes_in_flight)
        # One engine lane per served model: ``ModelLanes`` fills it (later models too),
        # replays and upgrades run on it.
        engines: dict[str, EngineLane] = {}
        self.replay = Replay(store, self.residents, self.checkpoints, engines)
        self.lanes = ModelLanes(
            self.models, engines, store, self.residents, self.checkpoints, self.replay,
            settings.stepper, settings.forecast,
        )  # fmt: skip
        self.loader = SessionLoader(
            self.models, self.residents, self.checkpoints, self.replay,
            self.lanes.notifiers,
            settings.max_sessions, settings.output_window,
            memory, settings.stepper.max_unflushed,
        )  # fmt: skip
        self.histories = HistoryReader(
            self.loader, self.replay, memory,
            settings.max_history_steps, settings.max_history_output_bytes,
        )  # fmt: skip
        self.lifecycle = Lifecycle(
            self.models, self.residents, self.checkpoints, self.replay, self.loader,
            engines, settings.defaults,
        )  # fmt: skip
        self.intake = StepIntake(self.loader, self.lanes.steppers, settings.max_queued_steps)
        self._reaper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def warm_up(self) -> None:
        """Compile every model's kernels (off the event loop) before the worker serves."""
        await self.lanes.warm_up()

    async def load_model(
        self,
        key: str,
        model: Engine,
        tokenizer: ModelTokenizer | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        """Serve another model (version) from now on (``ModelLanes.add``), with its
        tokenizer if it has one and its end-of-sequence ids (in place before requests can
        see the model)."""
        if key not in self.models:
            self.models.set_tokenizer(key, tokenizer)
            self.models.set_eos_ids(key, eos_ids)
        try:
            await self.lanes.add(key, model)
        except BaseException:
            if key not in self.models:
                self.models.set_tokenizer(key, None)
            raise

    async def unload_model(self, key: str) -> None:
        """Stop serving ``key``; refused while a resident session runs it."""
        resident = sum(1 for s in self.residents.by_id.values() if s.model_name == key)
        await self.lanes.remove(key, resident)

    def start(self) -> None:
        self.intake.start()
        self.lanes.start()
        self._reaper = asyncio.create_task(
            self.loader.evict_idle(self.settings.idle_check_s), name="idle-eviction"
        )

    async def stop(self) -> None:
        """Snapshot every resident session that moved since its last snapshot, then stop."""
        await self._stop_reaper()
        await self.loader.close()  # no load lands after the unloads
        await asyncio.gather(
            *(self.loader.unload(s, "shutdown") for s in list(self.residents.by_id.values())),
            return_exceptions=True,
        )
        self.checkpoints.close()
        await self._stop_engines()

    async def abandon(self) -> None:
        """Stop at once and write nothing: what a crash leaves behind in Redis."""
        await self._stop_reaper()
        self.checkpoints.close()
        await self.loader.close()
        await self._stop_engines()
        for s in list(self.residents.by_id.values()):
            s.fail_queued(SessionGoneError(f"session {s.id!r}: the worker stopped"))
        self.residents.clear()

    async def _stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    async def _stop_engines(self) -> None:
        await self.lanes.stop()

    # ------------------------------------------------------------------ residency

    @property
    def resident_count(self) -> int:
        return len(self.residents.by_id)

    def resident_ids(self) -> list[str]:
        return list(self.residents.by_id)

    def resident(self, session_id: str) -> Session | None:
        """The session ``session_id`` if it is in memory here (and not leaving it)."""
        return self.residents.get(session_id)

    def resident_models(self, prefix: str = "") -> Counter[str]:
        """Resident sessions per model key, of the ids that start with ``prefix``."""
        return Counter(
            s.model_name for s in self.residents.by_id.values() if s.id.startswith(prefix)
        )

    def resident_bytes(self, prefix: str) -> int:
        """Bytes the resident sessions of ids starting with ``prefix`` ('tenant~') may hold."""
        return self.residents.footprint_of(prefix)

    def resident_counts(self) -> ResidentCounts:
        """Resident sessions per (model, tenant) and their queued steps per model, for a
        metrics scrape (it runs on the HTTP server's thread: a copy of the table is read)."""
        counts = ResidentCounts()
        for s in list(self.residents.by_id.values()):  # a copy, made under the GIL
            key = (s.model_name, s.id.split("~", 1)[0] if "~" in s.id else "")
            counts.sessions[key] = counts.sessions.get(key, 0) + 1
            queued = counts.queued_steps.get(s.model_name, 0)
            counts.queued_steps[s.model_name] = queued + s.queued_steps
        return counts

    @property
    def steps_taken(self) -> int:
        """Steps this worker's steppers applied since it started."""
        return sum(stepper.steps for stepper in self.lanes.steppers.values())

    @property
    def snapshots_committed(self) -> int:
        return self.checkpoints.committed

    def forecasts_running(self) -> dict[str, int]:
        """Forecasts running per model key."""
        return {key: f.running for key, f in self.lanes.forecasters.items()}

    # What ``Ownership`` reports about the leases it renews.

    def held(self) -> list[SessionLease]:
        return self.residents.held()

    def lost_lease(self, lease: SessionLease, error: SsmserveError) -> None:
        self.residents.lost_lease(lease, error)

    def expired_lease(self, lease: SessionLease) -> None:
        self.residents.expired_lease(lease)

    # ------------------------------------------------------------------ create / get / list

    async def create(self, model_name: str, session_id: str, config: SessionConfig) -> SessionView:
        return await self.view(await self.lifecycle.create(model_name, session_id, config))

    async def view(self, session_id: str, owner_only: bool = False) -> SessionView:
        """What the session is now. ``owner_only`` (GetSession): a session another live
        worker holds is answered by that worker (SESSION_MOVED, which clients follow),
        never from the store here, which lacks its steps since its last flush; one no
        worker holds, with the step its replicas confirm (a client resumes after it)."""
        await self.checkpoints.settled(session_id)
        s = self.residents.by_id.get(session_id)
        if s is not None and s.gone is None and not s.answerable():
            # What memory says counts only while the lease is surely ours.
            with contextlib.suppress(SessionMovedError, SessionGoneError, ReloadingError):
                async with self.residents.hold(s, read_only=True):
                    pass
            s = self.residents.by_id.get(session_id)
        if s is not None and s.gone is not None:
            s = None
        lease = None if s else await self.store.lease_holder(session_id)
        if owner_only and lease is not None and lease.owner_addr != self.ownership.address:
            raise lease.redirect(session_id)
        # Memory's step is confirmed (each append waited for replicas); the master's may not be.
        read = self.store.meta_confirmed if owner_only and s is None else self.store.get_meta
        meta = await read(session_id)
        if meta is None:  # NOT_FOUND, or DATA_LOSS when a wiped store took it
            raise await self.residents.resets.missing(session_id)
        count, oldest = await self.store.snapshot_count_and_oldest(session_id)
        model = self.models.get(meta.model)
        config = s.config if s else SessionConfig.from_bytes(meta.config)
        step = s.step if s else meta.step
        if s is not None and not s.lease.valid():  # memory's step, read past its proof
            raise lease_lapsed(session_id, "its description")
        return SessionView(
            session_id=session_id,
            model=meta.model,
            fingerprint=meta.fingerprint,
            step=step,
            config=config,
            created_at=meta.created_at,
            updated_at=s.updated_at if s else meta.updated_at,
            snapshot_count=count,
            oldest_rollback_step=step if oldest is None else oldest,
            owner=self.ownership.address if s else (lease.owner_addr if lease else ""),
            resident=s is not None or lease is not None,
            input_dim=0 if model is None or model.config.is_token_model else model.config.input_dim,
            output_dim=0 if model is None else model.config.output_dim,
            token_input=model is not None and model.config.is_token_model,
            closed=meta.closed,
        )

    async def list(
        self, page_size: int, page_token: str, model: str, prefix: str = ""
    ) -> tuple[list[SessionView], str]:
        """A page of sessions after ``page_token``; only ids starting with ``prefix``."""
        if len(page_token) > 200:
            raise BadPageTokenError("a page token is at most 200 characters (a session id)")
        size = min(page_size or self.settings.list_page_size, self.settings.max_list_page_size)
        ids = await self.store.list_session_ids(page_token, size, prefix)
        views = []
        for session_id in ids:
            try:
                v = await self.view(session_id)
            except SessionMissingError:  # closed meanwhile
                continue
            except (BadSessionIdError, StoreDataError) as exc:  # one bad entry, not the page
                log.warning("list: session %s skipped: %s", clip(session_id), exc)
                continue
            if not model or v.model == model:
                views.append(v)
        return views, (ids[-1] if len(ids) == size else "")

    # ------------------------------------------------------------------ snapshots

    async def snapshot(self, session_id: str, label: str) -> SnapshotRecord:
        if len(label) > 128:
            raise BadLabelError("snapshot labels are at most 128 characters")
        s = await self.loader.session(session_id)
        async with self.residents.hold(s):
            if label and await self.store.snapshot_by_label(s.id, label) is not None:
                raise LabelTakenError(f"label {clip(label)} already names a snapshot of {s.id!r}")
            if not label and s.last_snapshot_step == s.step:
                newest = await self.store.snapshot_at_or_before(s.id, s.step)
                if newest is not None and newest.step == s.step:
                    return newest  # nothing moved since: the same snapshot, not a copy
            # retention never drops the snapshot it commits, so this record is current
            return await self.checkpoints.write(s, s.step, s.state, "manual", label)

    async def list_snapshots(self, session_id: str) -> list[SnapshotRecord]:
        await self.loader.meta(session_id)
        await self.checkpoints.settled(session_id)
        return await self.store.list_snapshots(session_id)

    # ------------------------------------------------------------------ rollback

    async def rollback(self, session_id: str, target: RollbackTarget) -> RollbackResult:
        s = await self.loader.session(session_id)
        async with self.residents.hold(s):
            t, record = await self.replay.resolve(s, target, "roll back")
            before = s.step
            step, snapshot_id, replayed = await self.replay.restore_to(s, t, record)
            self.metrics.rollbacks.labels("monitor").inc()
            await record_events(
                self.store, s.lease, [SessionEvent.rollback(before, step, "monitor")]
            )
            log.info(
                "session %s rolled back to step %d (%d replayed)", s.id, step, replayed,
                extra={"session_id": s.id, "step": step, "token": s.lease.token,
                       "event": "rolled_back", "cause": "monitor"},
            )  # fmt: skip
            return RollbackResult(step, snapshot_id, replayed)

    # ------------------------------------------------------------------ forecast and fork

    async def forecast(
        self, session_id: str, horizon: int, at_step: int | None = None
    ) -> ForecastJob:
        """Start a forecast of ``horizon`` steps from the session's current step (or
        ``at_step``); read its steps with :meth:`ForecastJob.batches`. The session is not
        changed: its state is read between two steps and the forecast runs on a copy.
        """
        limits = self.settings.forecast
        if horizon < 1:
            raise BadHorizonError("a forecast needs a horizon of at least 1 step")
        if horizon > limits.max_horizon:
            raise ForecastLimitError(
                f"a horizon of {horizon} steps is over this server's limit of "
                f"{limits.max_horizon}; ask for fewer steps, or continue from a fork"
            )
        s = await self.loader.session(session_id)
        c = s.model.config
        if not c.is_token_model and c.output_dim != c.input_dim:
            raise ForecastUnsupportedError(
                f"model {s.model_name!r} maps {c.input_dim} input values to {c.output_dim} "
                f"output values, so its outputs cannot be fed back as its inputs; forecasts "
                f"need output_dim == input_dim (or a token model)"
            )
        size = horizon * c.output_dim * 4
        if size > limits.max_output_bytes:
            raise ForecastLimitError(
                f"a forecast of {horizon} steps of model {s.model_name!r} would hold "
                f"{size / 2**20:.1f} MiB of outputs (limit {limits.max_output_bytes / 2**20:.0f} "
                f"MiB); ask for at most {limits.max_output_bytes // (c.output_dim * 4)} steps"
            )
        forecaster = self.lanes.forecasters[s.model_name]
        forecaster.check_room()  # before the (maybe long) replay, not after
        # Its state copy and the answer it may buffer count against the worker's memory
        # until the caller closes the job.
        memory = self.memory.reserve(
            "forecasts", c.state_bytes + size, f"a forecast of {horizon} steps"
        )
        try:
            job = await self._forecast_job(s, horizon, at_step)
            job.memory = memory
            forecaster.submit(job)
            self.metrics.forecasts.labels(s.model_name).inc()
        except BaseException:
            memory.release()
            raise
        return job

    async def _forecast_job(self, s: Session, horizon: int, at_step: int | None) -> ForecastJob:
        point = await self.replay.point(
            s, RollbackTarget(step=at_step), "forecast", need_output=True
        )
        if point.output is None:
            raise RollbackRangeError(
                f"session {s.id!r} is at step 0 and has no output yet to feed back; send it "
                f"one input first"
                if point.step == 0
                else f"the output of step {point.step} of session {s.id!r} is not known (it is "
                f"older than the kept history, or the session came from a checkpoint without "
                f"it), so a forecast cannot start there; forecast from a later step"
            )
        return ForecastJob(
            session_id=s.id,
            lease=s.lease,
            guards=s.config.guards,
            from_step=point.step,
            horizon=horizon,
            state=point.state,
            next_input=feedback(s.model, point.step, point.output),
            message_bytes=self.settings.forecast.message_bytes,
            guard_state=point.guards,
        )

    async def upgrade(self, session_id: str, model: str) -> tuple[SessionView, UpgradeResult]:
        """Move a session to another version of its model (``Lifecycle.upgrade``)."""
        result = await self.lifecycle.upgrade(session_id, model)
        return await self.view(session_id), result

    async def history(self, session_id: str, from_step: int, to_step: int) -> History:
        """Steps ``from_step..to_step`` as they were answered (``HistoryReader``)."""
        return await self.histories.read(session_id, from_step, to_step)

    async def fork(
        self, session_id: str, target: RollbackTarget, new_session_id: str = ""
    ) -> ForkResult:
        new_id, point = await self.lifecycle.fork(session_id, target, new_session_id)
        self.metrics.forks.inc()
        return ForkResult(
            await self.view(new_id), session_id, point.step, point.from_snapshot_id,
            point.replayed_steps,
        )  # fmt: skip

    # ------------------------------------------------------------------ close, export, import

    async def close(self, session_id: str, final_snapshot: bool) -> tuple[int, str]:
        return await self.lifecycle.close(session_id, final_snapshot)

    async def export(self, session_id: str, snapshot_id: str) -> bytes:
        return await self.lifecycle.export(session_id, snapshot_id)

    async def import_checkpoint(
        self,
        blob: bytes | memoryview,
        session_id: str,
        model_name: str,
        config: SessionConfig,
        replace: bool,
        adopt_id: Callable[[str], str] = str,
    ) -> SessionView:
        return await self.view(
            await self.lifecycle.import_checkpoint(
                blob, session_id, model_name, config, replace, adopt_id
            )
        )
