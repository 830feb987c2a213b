"""The HTTP door of one worker: its listener, application and prefix cache, wired.

:class:`HttpDoor` is what ``worker`` holds: ``bind`` at the worker's start (a taken port
refuses the start), ``start`` once the session manager and the gRPC service run (the
door uses the service's ``Generations`` and budgets: the same limits and checks as
Generate), ``stop`` first when the worker stops (requests in flight get their grace, then
the kept sessions are closed), ``abort`` as a crash would (nothing closed).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Protocol

from ssmserve.server.api.auth import Authenticator
from ssmserve.server.api.service import SessionService
from ssmserve.server.http.completions import Completions
from ssmserve.server.http.listener import HttpListener, HttpSettings
from ssmserve.server.http.runs import CompletionRuns, RunSettings
from ssmserve.server.sessions.manager import SessionManager


class Serving(Protocol):
    """What the door uses of the worker (``worker.Worker``), once it serves."""

    manager: SessionManager | None
    service: SessionService | None
    authenticator: Authenticator
    model_paths: dict[str, Path]  # a served key's directory (its tokenizer config)


class HttpDoor:
    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self.listener = HttpListener(settings)
        self.runs: CompletionRuns | None = None

    @property
    def address(self) -> str:
        return self.listener.address

    def bind(self) -> str:
        return self.listener.bind()

    async def start(self, worker: Serving, run_settings: RunSettings | None = None) -> None:
        """Serve, on ``worker``'s session manager, Generate service and tokens (started)."""
        from ssmserve.server.http.app import Limits, build_app  # FastAPI: only with --http

        manager, service = worker.manager, worker.service
        assert manager is not None and service is not None, "the worker serves first"
        self.runs = CompletionRuns(
            manager,
            service.generations,
            service.budgets,
            replace(run_settings or RunSettings(), prefix_cache=self.settings.prefix_cache),
        )
        completions = Completions(
            manager, self.runs, service.settings.generate, worker.model_paths.get
        )
        app = build_app(
            completions,
            worker.authenticator,
            Limits(self.settings.max_requests),
            self.settings.max_body_bytes,
        )
        await self.listener.start(app)

    async def stop(self) -> None:
        await self.listener.stop()
        if self.runs is not None:
            await self.runs.stop()

    async def abort(self) -> None:
        await self.listener.stop(grace=False)
