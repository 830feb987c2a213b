"""ModelLanes: what runs each served model, and adding or removing a model at runtime.

Per served model key (``models``): its :class:`EngineLane` (the engine thread, shared by
steps, forecasts and replays), its :class:`Stepper` and its :class:`Forecaster`. The
dictionaries are shared with the components that look a model up (``Replay`` and
``Lifecycle`` take ``engines``, which the session manager makes and this fills;
``SessionLoader`` takes the steppers' notifiers, ``StepIntake`` the steppers), so adding
or removing a key here is seen by all of them at once. Each stepper gets the session
components it works with (``residents``, ``checkpoints``, ``replay``) from here.

Adding compiles the model's kernels off the event loop before it is served (ready means
warm, as at start). Removing is refused while a resident session runs the model; a
request for it after removal is answered like any model this worker does not serve.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ssmserve.server.engine.allocator import return_freed_memory
from ssmserve.server.engine.interface import Engine
from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.errors import UnknownModelError
from ssmserve.server.sessions.forecaster import Forecaster, ForecastSettings
from ssmserve.server.sessions.models import ServedModels
from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.stepper import Stepper, StepperSettings
from ssmserve.server.state.store import Store

log = logging.getLogger(__name__)


class ModelExistsError(SsmserveError):
    kind = ErrorKind.ALREADY_EXISTS


class ModelInUseError(SsmserveError):
    kind = ErrorKind.FAILED_PRECONDITION


class ModelLanes:
    def __init__(
        self,
        models: ServedModels,
        engines: dict[str, EngineLane],
        store: Store,
        residents: ResidentSessions,
        checkpoints: Checkpoints,
        replay: Replay,
        stepper_settings: StepperSettings,
        forecast_settings: ForecastSettings,
    ) -> None:
        self.models = models
        self.store = store
        self.residents, self.checkpoints, self.replay = residents, checkpoints, replay
        self.stepper_settings, self.forecast_settings = stepper_settings, forecast_settings
        self.engines = engines  # filled here, one per served model
        self.steppers: dict[str, Stepper] = {}
        self.forecasters: dict[str, Forecaster] = {}
        self.notifiers: dict[str, Callable[[], None]] = {}  # wakes a model's stepper
        self.started = False
        for key, model in models.items():
            self._build(key, model)

    def _build(self, key: str, model: Engine, engine: EngineLane | None = None) -> None:
        engine = engine or EngineLane(model, self.stepper_settings.offload_min_flop)
        stepper = Stepper(
            model, self.store, self.residents, self.checkpoints, self.replay,
            self.stepper_settings, engine,
        )  # fmt: skip
        self.engines[key], self.steppers[key] = engine, stepper
        self.forecasters[key] = Forecaster(model, engine, self.forecast_settings)
        self.notifiers[key] = stepper.notify

    async def warm_up(self) -> None:
        """Compile every model's kernels (off the event loop) before the worker serves, then
        give back what compiling freed (no session steps yet)."""
        for key, engine in self.engines.items():
            seconds = await engine.warm_up_on_thread()
            log.info("model %s: kernels ready in %.2f s", key, seconds)
        return_freed_memory()

    def start(self) -> None:
        self.started = True
        for key in self.models:
            self.steppers[key].start()
            self.forecasters[key].start()

    async def stop(self) -> None:
        for forecaster in self.forecasters.values():
            await forecaster.stop()
        for stepper in self.steppers.values():
            await stepper.stop()

    async def add(self, key: str, model: Engine) -> None:
        """Serve ``model`` as ``key`` from now on, its kernels compiled first."""
        if key in self.models:
            raise ModelExistsError(f"model {key!r} is served here already; unload it first")
        engine = EngineLane(model, self.stepper_settings.offload_min_flop)
        seconds = await engine.warm_up_on_thread()
        if key in self.models:  # loaded by a concurrent call meanwhile
            raise ModelExistsError(f"model {key!r} is served here already; unload it first")
        self._build(key, model, engine)  # the warm engine
        if self.started:
            self.steppers[key].start()
            self.forecasters[key].start()
        self.models.add(key, model)  # last: requests see it only when it can run
        log.info(
            "model %s loaded (%s), kernels ready in %.2f s", key, model.fingerprint[:16], seconds
        )

    async def remove(self, key: str, resident: int) -> None:
        """Stop serving ``key``; ``resident`` sessions run it here (then refused)."""
        if key not in self.models:
            raise UnknownModelError(f"model {key!r} is not served here")
        if resident:
            raise ModelInUseError(
                f"{resident} sessions resident here run model {key!r}: migrate or close "
                f"them (or let them go idle) before unloading it"
            )
        if len(self.models) == 1:
            raise ModelInUseError(f"model {key!r} is the last one this worker serves")
        self.models.remove(key)  # first: no new session or load picks it
        await self.forecasters.pop(key).stop()
        await self.steppers.pop(key).stop()
        self.engines.pop(key, None)
        self.notifiers.pop(key, None)
        log.info("model %s unloaded", key)
