"""A completion's run: its session (from the prefix cache, or new), its generation.

The door drives the same path as gRPC's Generate, in process: a session is created (or
forked, or continued) through the session manager, ``Generations.start`` checks the
request and reads where the session is, ``Generation.run`` feeds the prompt and
generates, and its ``updates`` queue hands each token over as it is drawn. Every step
goes through the session's intake like any other (logged, guarded, batched with every
session of the model), so an HTTP completion is as exact and as durable as a gRPC one.

Sessions are the door's own, named ``http-<hex>`` in the caller's tenant: the one a
request ended cleanly is kept in the prefix cache (``prefix_cache``) for a next request
that extends it; one that ended otherwise (an error, a client that went away before the
end) is closed, since where it stopped is not known for sure.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ssmserve.server.api.auth import Principal
from ssmserve.server.api.budgets import Budgets
from ssmserve.server.api.tenancy import TenantScope
from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.http.prefix_cache import CacheKey, PrefixCache
from ssmserve.server.sessions.config import DOOR_LABELS, SessionConfig
from ssmserve.server.sessions.errors import RollbackRangeError
from ssmserve.server.sessions.generation import (
    Finish,
    GenerateRequest,
    Generation,
    Generations,
    Start,
    Token,
)
from ssmserve.server.sessions.manager import SessionManager
from ssmserve.server.sessions.records import RollbackTarget

log = logging.getLogger(__name__)


class TokenWaitError(SsmserveError):
    """No token came within the bound: the session's steps are stuck (UNAVAILABLE)."""

    kind = ErrorKind.UNAVAILABLE


class LeaseLapsedError(SsmserveError):
    """This worker's lease of the session lapsed while it generated: what it answers
    now might not be kept (UNAVAILABLE; send the request again)."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class Caller:
    """Who sends a request: its principal (None: no auth) and session ids."""

    principal: Principal | None
    scope: TenantScope

    @property
    def namespace(self) -> str:
        """The stored-id prefix of the sessions the caller makes ('': none, as for an
        admin or without auth, whatever the principal's tenant): the prefix cache's key,
        so a caller only ever continues sessions of its own namespace."""
        return self.scope.prefix


@dataclass(frozen=True)
class RunSettings:
    prefix_cache: int = 8  # sessions kept per namespace and model (0: none; each is closed)
    # A kept session is forked at a shorter common prefix only from this many ids: a fork
    # reads a snapshot and replays up to a snapshot interval, more than a short prefill.
    min_fork_prefix: int = 32
    token_wait_s: float = 300.0  # the longest wait for one update (the prompt's included)
    close_timeout_s: float = 10.0


@dataclass(frozen=True)
class Placed:
    """Where a request runs: its session, at which step, how it got there."""

    session_id: str
    step: int  # the prompt's first ``step`` ids are the session's history already
    how: str  # "continued", "forked" or "new"


class CompletionRuns:
    """Runs completions on the door's sessions, with the prefix cache."""

    def __init__(
        self,
        manager: SessionManager,
        generations: Generations,
        budgets: Budgets,
        settings: RunSettings,
    ) -> None:
        self.manager, self.generations, self.budgets = manager, generations, budgets
        self.settings = settings
        self.cache = PrefixCache(settings.prefix_cache, self._close_later)
        self._closing: set[asyncio.Task[None]] = set()
        # Generations running, by session: what ``stop`` ends and closes, whether or not
        # their responses are ever finalized (a stream cut while it writes is not).
        self._running: dict[str, asyncio.Task[None]] = {}
        self._stopped = False

    async def run(
        self, caller: Caller, model_key: str, ids: np.ndarray, request: GenerateRequest
    ) -> AsyncGenerator[Token | Finish, None]:
        """The tokens of one completion of ``ids`` on ``model_key``, then its Finish.
        ``request`` gives everything but the session and the prompt. Raises what refuses
        the request before any token (a typed error), as ``Generations.start`` does."""
        key: CacheKey = (caller.namespace, model_key)
        placed, generation = await self._start(caller, key, model_key, ids, request)
        task = asyncio.create_task(generation.run(), name="http-generate")
        self._running[placed.session_id] = task
        generated: list[int] = []
        finish: Finish | None = None
        try:
            while True:
                try:
                    update = await asyncio.wait_for(
                        generation.updates.get(), self.settings.token_wait_s
                    )
                except TimeoutError:
                    raise TokenWaitError(
                        f"no token within {self.settings.token_wait_s:g} s; the model's "
                        f"steps are stuck: try again"
                    ) from None
                if isinstance(update, Token):
                    if not generation.session.lease.valid():
                        raise LeaseLapsedError(
                            "this worker's lease of the completion's session lapsed; send "
                            "the request again"
                        )
                    generated.append(update.token)
                    generation.handover.offer(update.step)  # the client may get it now
                    yield update
                    # Taken by the response: the generation may take its next step.
                    generation.handover.hand(update.step)
                elif isinstance(update, Start):
                    generation.handover.hand(update.session_step)
                elif isinstance(update, Finish):
                    finish = update
                    yield update
                    return
        finally:
            # Started before anything here awaits: a dropped stream's task is cancelled
            # again at every wait (anyio's cancel scope), and the session must still be
            # kept or closed. The request waits for it (a next one finds it kept), the
            # settling goes on whatever cancels that wait.
            history = np.concatenate([ids, np.asarray(generated, np.int64)])
            settling = self._in_background(
                self._settle(key, placed.session_id, task, history, finish),
                f"http-settle-{placed.session_id}",
            )
            await asyncio.shield(settling)

    async def _settle(
        self,
        key: CacheKey,
        session_id: str,
        task: asyncio.Task[None],
        history: np.ndarray,
        finish: Finish | None,
    ) -> None:
        """Stop a completion's generation (done, or the client went away), then keep its
        session (it ended cleanly where ``history`` says) or close it."""
        task.cancel()
        ended = True
        try:
            await asyncio.wait_for(
                asyncio.gather(task, return_exceptions=True), self.settings.close_timeout_s
            )
        except TimeoutError:
            ended = False
            log.warning("http: generation on %s did not stop within the bound", session_id)
        if self._running.pop(session_id, None) is None:
            return  # ``stop`` took it, and closes it
        clean = (
            ended
            and finish is not None
            and finish.error is None
            and finish.reason != "cancelled"  # cut short: not where the answer ended
            and not self._stopped
        )
        if clean and finish is not None and finish.session_step == len(history):
            self.cache.keep(key, session_id, history)
        else:
            self._close_later(session_id)

    async def _start(
        self,
        caller: Caller,
        key: CacheKey,
        model_key: str,
        ids: np.ndarray,
        request: GenerateRequest,
    ) -> tuple[Placed, Generation]:
        """The request's session and its started generation. A kept session that cannot
        be used (moved, unloaded, closed) is dropped and a new one made instead."""
        placed = await self._reuse(caller, key, ids)
        if placed is not None:
            try:
                return placed, await self._generation(placed, ids, request)
            except SsmserveError as exc:
                if exc.kind is ErrorKind.INVALID_ARGUMENT:
                    # The request's fault, found before anything was queued: the session
                    # is as it was, and kept again.
                    self.cache.keep(key, placed.session_id, ids[: placed.step])
                    raise
                log.info("http: kept session %s not used (%s)", placed.session_id, exc)
                self._close_later(placed.session_id)
            except BaseException:
                # Cancelled (the client went away) while the generation started: where
                # the session stands is not known for sure.
                self._close_later(placed.session_id)
                raise
        placed = await self._new(caller, model_key)
        self.cache.counts.missed += 1
        try:
            return placed, await self._generation(placed, ids, request)
        except BaseException:
            self._close_later(placed.session_id)
            raise

    async def _generation(
        self, placed: Placed, ids: np.ndarray, request: GenerateRequest
    ) -> Generation:
        return await self.generations.start(
            replace(
                request,
                session_id=placed.session_id,
                prompt=ids[placed.step :],
                at_step=placed.step,
            )
        )

    async def _reuse(self, caller: Caller, key: CacheKey, ids: np.ndarray) -> Placed | None:
        """A kept session continued, or forked at the longest common prefix; None: none
        fits (or the fork failed)."""
        found = self.cache.match(key, ids, self.settings.min_fork_prefix)
        if found is None:
            return None
        sid = found.kept.session_id
        if found.whole:
            self.cache.take(key, sid)
            self.cache.counts.continued += 1
            return Placed(sid, found.length, "continued")
        new_id = self._new_id(caller)
        try:
            await self.budgets.check_new_session(caller.scope.tenant, caller.scope.prefix)
            result = await self.manager.fork(sid, RollbackTarget(step=found.length), new_id)
        except asyncio.CancelledError:
            self._close_later(new_id)  # the fork may have made it (not found: nothing)
            raise
        except RollbackRangeError as exc:
            # The common prefix is older than the session's snapshots reach: it stays
            # kept (a request that extends it continues it), this one prefills afresh.
            log.info("http: kept session %s not forked (%s)", sid, exc)
            return None
        except SsmserveError as exc:
            log.info("http: could not fork kept session %s (%s)", sid, exc)
            if exc.kind in (ErrorKind.NOT_FOUND, ErrorKind.FAILED_PRECONDITION):
                self.cache.forget(key, sid)  # closed, as whatever leaves the cache is
            return None
        self.cache.counts.forked += 1
        return Placed(result.view.session_id, found.length, "forked")

    async def _new(self, caller: Caller, model_key: str) -> Placed:
        await self.budgets.check_new_session(caller.scope.tenant, caller.scope.prefix)
        new_id = self._new_id(caller)
        try:
            view = await self.manager.create(model_key, new_id, SessionConfig(labels=DOOR_LABELS))
        except asyncio.CancelledError:
            self._close_later(new_id)  # the create may have made it (not found: nothing)
            raise
        return Placed(view.session_id, 0, "new")

    @staticmethod
    def _new_id(caller: Caller) -> str:
        return caller.scope.new_id(f"http-{secrets.token_hex(8)}")

    # ------------------------------------------------------------------ closing

    def _close_later(self, session_id: str) -> None:
        """Close a session the door no longer keeps, in the background (bounded)."""
        self._in_background(self._close(session_id), f"http-close-{session_id}")

    def _in_background(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """``work`` as a task of its own (no cancel of a request's reaches it), held
        until it ends; ``forget`` and ``stop`` wait for it."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def _close(self, session_id: str) -> None:
        try:
            await asyncio.wait_for(
                self.manager.close(session_id, final_snapshot=False),
                self.settings.close_timeout_s,
            )
        except (SsmserveError, TimeoutError) as exc:
            # Moved to another worker, or gone already: nothing of it is the door's.
            log.info("http: session %s not closed (%s)", session_id, exc)

    async def forget(self) -> None:
        """Close every kept session (the next requests prefill afresh); wait for the
        closes (each bounded)."""
        for session_id in self.cache.drain():
            self._close_later(session_id)
        await self._closed()

    async def stop(self) -> None:
        """End the generations still running, close their sessions and every kept one;
        wait for the closes (each bounded). Nothing is kept after."""
        self._stopped = True
        running, self._running = self._running, {}
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        for session_id in running:
            self._close_later(session_id)
        await self.forget()

    async def _closed(self) -> None:
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
