"""HistoryReader: what a session did over a range of its steps (``GetHistory``).

Inputs come from memory or the log, outputs are replayed from the snapshot before the
range (``Replay.series``: bit-exact, guards applied, so they are what was answered),
snapshots and recorded events (``events``) from the store. The session is only read
(held read-only while its snapshot and inputs are read, not while they are replayed).
"""

from __future__ import annotations

import numpy as np

from ssmserve.server.sessions.errors import RollbackRangeError
from ssmserve.server.sessions.events import SessionEvent
from ssmserve.server.sessions.forecaster import ForecastLimitError
from ssmserve.server.sessions.loading import SessionLoader
from ssmserve.server.sessions.memory import WorkerMemory
from ssmserve.server.sessions.records import History
from ssmserve.server.sessions.replay import Replay


class HistoryReader:
    def __init__(
        self,
        loader: SessionLoader,
        replay: Replay,
        memory: WorkerMemory,
        max_steps: int,
        max_output_bytes: int,
    ) -> None:
        self.loader, self.replay, self.memory = loader, replay, memory
        self.store = loader.store
        self.max_steps, self.max_output_bytes = max_steps, max_output_bytes

    async def read(self, session_id: str, from_step: int, to_step: int) -> History:
        """Steps ``from_step..to_step`` (0: from the oldest it can replay, to the current
        step), with its snapshots and events. Past the limits: RESOURCE_EXHAUSTED."""
        s = await self.loader.session(session_id)
        _count, oldest = await self.store.snapshot_count_and_oldest(session_id)
        first_possible = (oldest or 0) + 1
        last = to_step or s.step
        first = from_step or first_possible
        if last > s.step or first < first_possible or first > last + 1:
            raise RollbackRangeError(
                f"session {s.id!r} can show steps {first_possible}..{s.step} (older ones left "
                f"with its oldest kept snapshot); asked for {first}..{last}"
            )
        c = s.model.config
        most = min(self.max_steps, self.max_output_bytes // (4 * c.output_dim))
        count = last - first + 1
        if count > most:
            raise ForecastLimitError(
                f"{count} steps of model {s.model_name!r} are more than one GetHistory call "
                f"returns (at most {most}); ask for a smaller range"
            )
        with self.memory.reserve("history", count * c.output_dim * 4, f"{count} steps of history"):
            raw, outputs = await self.replay.series(s, first, last) if count else ([], [])
            snapshots = await self.store.list_snapshots(session_id)
            recorded = await self.store.read_events(session_id)
            events = [e for e in map(SessionEvent.decode, recorded) if e is not None]
            inputs = s.codec.decode_many(raw) if raw else s.codec.empty()
            out = np.stack(outputs) if outputs else np.zeros((0, c.output_dim), np.float32)
            return History(first, inputs, out, snapshots, events)
