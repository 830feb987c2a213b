"""Rebalancing: sessions spread over the workers as they join.

A session stays on the worker that created or loaded it until something moves it, so a
worker that joins a busy cluster would get only new sessions. With rebalancing on
(``--rebalance-every S``), every worker looks at the registry every ``S`` seconds (with
jitter, so workers do not act in step) and, when it holds at least ``min_excess`` more
sessions than the least loaded other worker that can take one (live, not draining,
serving the model, same numerics), hands sessions over to it (a migration: exact, and
clients follow). Only the more loaded side acts, it stops at the cluster's mean, and it
moves at most ``max_moves`` per round, so sessions never go back and forth between two
workers and a newcomer is filled over a few rounds rather than all at once by everyone.

The loads are the registry's (each worker's resident sessions as of its last
heartbeat, a few seconds old); the moves of the current round are counted on top of them.
Sessions the HTTP door keeps as its prefix cache stay (``config.stays_here``): the door
closes them itself, and one moved away would be left open on the other worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from dataclasses import dataclass

from ssmserve.server.cluster.ownership import Ownership, least_loaded
from ssmserve.server.errors import SsmserveError
from ssmserve.server.sessions.config import stays_here
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.migration import Migrator
from ssmserve.server.sessions.residency import ResidentSessions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceSettings:
    every_s: float = 0.0  # seconds between rounds (jittered +-25%); 0: never rebalance
    min_excess: int = 2  # act only when this many more sessions than the least loaded peer
    max_moves: int = 4  # sessions handed off per round at most


class Rebalancer:
    """Runs :meth:`round` every ``settings.every_s`` until stopped: looks at ``residents``
    and the registry (``ownership``), and moves sessions with ``migrator``."""

    def __init__(
        self,
        migrator: Migrator,
        residents: ResidentSessions,
        loader: SessionLoader,
        ownership: Ownership,
        settings: RebalanceSettings,
    ) -> None:
        self.migrator = migrator
        self.residents = residents
        self.loader = loader
        self.ownership = ownership
        self.settings = settings
        self.moved = 0  # sessions handed off by rebalancing since start
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()

    def start(self) -> None:
        if self.settings.every_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="rebalance")

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the hand-off under way, if any (a hand-off cut in the middle would
        leave its session reserved for a target that never takes it, until the lease
        runs out); cancelled if that takes longer than ``timeout_s``."""
        self._closing.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while not self._closing.is_set():
            pause = self.settings.every_s * random.uniform(0.75, 1.25)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), pause)
            if self._closing.is_set():
                return
            try:
                await self.round()
            except SsmserveError as exc:  # the store is away, a target vanished: next round
                log.warning("rebalance: round failed: %s", exc)
            except Exception:  # a bug must not end rebalancing for the worker's lifetime
                log.exception("rebalance: round failed")

    async def round(self) -> int:
        """Hand off sessions to less loaded workers, as the registry shows them now;
        returns how many moved."""
        ownership = self.ownership
        if ownership.draining:
            return 0
        resident = list(self.residents.by_id)
        workers = [w for w in await ownership.live_workers() if not w.draining]
        others = [w for w in workers if w.worker_id != ownership.worker_id]
        if not others:
            return 0
        mine = len(resident)
        mean = (mine + sum(w.load for w in others)) / (1 + len(others))
        planned: dict[str, int] = {}  # address -> sessions sent there in this round
        moved = 0
        for session_id in resident:
            if self._closing.is_set():
                break
            if moved >= self.settings.max_moves or mine - moved <= math.ceil(mean):
                break
            try:
                s = await self.loader.session(session_id)
                if stays_here(s.config.labels):
                    continue
                targets = ownership.targets_among(workers, s.model_name, ownership.numerics)
                if not targets:
                    continue
                target = least_loaded(targets, planned)
                theirs = target.load + planned.get(target.address, 0)
                if mine - moved - theirs < self.settings.min_excess:
                    continue
                await self.migrator.hand_off(session_id, target)
            except SsmserveError as exc:  # closed, moved or refused meanwhile: the next one
                log.info("rebalance: session %s stays: %s", session_id, exc)
                continue
            planned[target.address] = planned.get(target.address, 0) + 1
            moved += 1
        if moved:
            self.moved += moved
            log.info(
                "rebalance: %d sessions handed off (%d here, cluster mean %.1f): %s",
                moved, mine - moved, mean, planned,
            )  # fmt: skip
        return moved
