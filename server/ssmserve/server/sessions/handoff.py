"""One hand-off of a resident session to another worker, driven start to finish by its
owner, :class:`HandOff` (as the stepper drives a batch: plan, execute, settle).

:meth:`HandOff.run` is the plan, in order:

1. hold the session between two steps, its lease revalidated (``ResidentSessions.hold``);
2. snapshot it if it moved since its last snapshot (the log is flushed with it);
3. reserve its lease for the target (``Store.handoff``: one script, which also names the
   newest snapshot, the one the target loads from);
4. ask the target to adopt it (``Peers.adopt``: the target acquires it, a new fencing
   token, and loads it from that snapshot and the log);
5. settle what the answer means here:

   * the target took it: the session leaves memory, and the steps queued meanwhile are
     answered with a redirect to the target (``SessionMovedError``);
   * the target failed: the reservation is taken back (``Store.cancel_handoff``, same
     token) and the session goes on here as if nothing happened; a take-back refused as
     stale means the target did acquire it (only its answer was lost): moved; a
     take-back that fails otherwise leaves whether the reservation stands unknown, so
     the session leaves memory (it reloads, or is found at the target);
   * cut short (cancelled): whether the target took the session is unknown, so it
     leaves memory here; nothing is guessed.

Each component is called once with what it needs: the store for the snapshot and the
reservation, the target for the adoption, the resident table for the drop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ssmserve.server.cluster.peers import Peers
from ssmserve.server.errors import SessionMovedError, SsmserveError
from ssmserve.server.sessions.checkpoints import Checkpoints
from ssmserve.server.sessions.errors import HandOffError, ReloadingError
from ssmserve.server.sessions.residency import ResidentSessions
from ssmserve.server.sessions.session import Session, SessionGoneError
from ssmserve.server.state.lease import SessionLease
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_errors import StaleEpochError, StoreOutcomeUnknownError
from ssmserve.server.state.store_records import WorkerRecord


@dataclass(frozen=True)
class HandOffParts:
    """What a hand-off calls on this worker: the same for every hand-off (``Migrator``)."""

    store: Store
    residents: ResidentSessions
    checkpoints: Checkpoints
    peers: Peers
    address: str  # this worker's, the session's address while it stays
    lease_ms: int  # the lease a taken-back reservation runs for again


class HandOff:
    """Hand the resident session ``session_id`` to ``target`` (checked by the caller:
    live, serving the model, same numerics). :meth:`run` once."""

    def __init__(self, parts: HandOffParts, session_id: str, target: WorkerRecord) -> None:
        self.parts = parts
        self.session_id = session_id
        self.target = target

    async def run(self) -> tuple[int, str]:
        """The hand-off; returns the step the session moved at and the id of the snapshot
        the target loaded from. Raises if the session stays here (``HandOffError``: the
        target did not take it) or left memory without a known outcome."""
        p = self.parts
        s = p.residents.by_id.get(self.session_id)
        if s is None or s.gone is not None:
            raise SessionGoneError(f"session {self.session_id!r} is not resident on this worker")
        async with p.residents.hold(s):
            written = ""
            if s.step != s.last_snapshot_step or s.recent.unflushed:
                written = (await p.checkpoints.write(s, s.step, s.state, "migrate")).snapshot_id
            lease = s.lease
            newest = await p.residents.write(
                s, lambda lease: p.store.handoff(lease, self.target, p.lease_ms, s.step)
            )
            await self._adopted_or_taken_back(s, lease)
            p.residents.drop(
                s,
                SessionMovedError(
                    f"session {s.id!r} moved to worker {self.target.address}",
                    owner=self.target.address,
                ),
            )
            return s.step, written or newest

    async def _adopted_or_taken_back(self, s: Session, lease: SessionLease) -> None:
        """Ask the target to adopt ``s``; returns when it did. If it did not, the
        reservation is taken back and this raises (``HandOffError``: ``s`` goes on here),
        unless the take-back shows the target did take it (then this returns)."""
        p, target = self.parts, self.target
        try:
            await p.peers.adopt(target.address, s.id)
        except asyncio.CancelledError:
            # Given up under way (a Migrate whose client went away, a rebalance round
            # stopped): whether the target took the session is unknown, so it is not
            # kept here.
            p.residents.lost(
                s, lease, StoreOutcomeUnknownError("a hand-off was cancelled under way")
            )
            raise
        except Exception as exc:
            try:
                await p.store.cancel_handoff(lease, p.address, target.worker_id, p.lease_ms)
            except asyncio.CancelledError:
                # Cut short while taking the reservation back: whether it was taken back,
                # or the target holds the session, is unknown, so this memory answers
                # nothing more (it holds nothing Redis lacks: the hold snapshotted it).
                p.residents.lost(
                    s, lease, StoreOutcomeUnknownError("a hand-off's take-back was cancelled")
                )
                raise
            except StaleEpochError:
                return  # the target did acquire it (only its answer was lost): moved
            except SsmserveError as cancel_error:
                # Whether the reservation still stands is not known (the target may yet
                # take it): answer nothing more from this memory; the session reloads or
                # is found at the target.
                p.residents.drop(
                    s,
                    ReloadingError(
                        f"session {s.id!r}: its hand-off to {target.address} could not be "
                        f"taken back ({cancel_error}); retry"
                    ),
                )
                raise
            raise HandOffError(
                f"worker {target.address} did not take session {s.id!r} ({exc}); "
                f"it stays on {p.address}"
            ) from None
