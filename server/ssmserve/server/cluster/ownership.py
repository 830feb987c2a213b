"""Who serves what: this worker's entry in the registry, and the leases of its sessions.

A worker registers itself (id, advertised address, models, load, numerics signature)
under a key that expires ``worker_ttl_s`` after its last heartbeat, so the registry lists
live workers only. Each resident session is held by a :class:`SessionLease`
that expires ``lease_ttl_s`` after its last renewal; one background task renews the
worker's entry and all of its leases (one pipeline) every ``renew_every_s``.

A renewal that finds the session someone else's (its fencing token moved on) means this
worker lost it: ``on_lost`` drops it at once. A renewal that finds the lease ran out
(nobody took the session yet) never re-creates it: ``on_expired`` has the session manager
acquire it again, which makes a new token. Between renewals each lease knows, by this
worker's monotonic clock, until when it certainly still runs; past that the session
answers nothing until it is revalidated (``ssmserve.server.state.lease``).

The fencing itself is in Redis (``ssmserve.server.state.store_layout``): every write carries the
owner's token, so even a worker that has not noticed yet cannot change a session it lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from ssmserve.server.cluster.takeover import Takeovers
from ssmserve.server.errors import (
    SessionMovedError,
    SsmserveError,
    TakeoverPendingError,
    clip,
)
from ssmserve.server.state.lease import SessionLease, lease_clock
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_errors import (
    LeaseExpiredError,
    LeaseHeldError,
    SessionClosedError,
    SessionMissingError,
    SessionVanishedError,
    StaleEpochError,
)
from ssmserve.server.state.store_records import WorkerRecord, WorkerStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnershipSettings:
    """Lease and heartbeat timing (documented defaults)."""

    # A session's lease runs this long after its last renewal: the longest a crashed or
    # frozen worker's sessions wait before another worker may take them over.
    lease_ttl_s: float = 5.0
    # The registry entry of a worker that stopped heartbeating disappears after this.
    worker_ttl_s: float = 5.0
    # How often the heartbeat and the lease renewal run; 0: a third of the shorter TTL.
    renew_every_s: float = 0.0
    # A worker trusts a lease for the TTL minus this share of it after the renewal was
    # sent (clock rate differences between this host and Redis's, scheduling delays).
    lease_margin: float = 0.1

    @property
    def lease_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    @property
    def period_s(self) -> float:
        return self.renew_every_s or min(self.lease_ttl_s, self.worker_ttl_s) / 3

    @property
    def margin_s(self) -> float:
        return self.lease_ttl_s * self.lease_margin

    @property
    def lease_valid_s(self) -> float:
        """How long after the call that set it was sent a new lease is trusted."""
        return self.lease_ttl_s - self.margin_s


#: Renewal outcomes that mean the session is not this worker's any more.
_NOT_OURS = (SessionMovedError, SessionMissingError, SessionClosedError)


def new_worker_id() -> str:
    return f"{socket.gethostname()[:32]}-{secrets.token_hex(4)}"


class Ownership:
    """This worker's identity and its leases.

    ``held`` returns the lease of every resident session; ``on_lost`` is called with a
    lease and the error when it turned out to be someone else's, and ``on_expired`` with a
    lease that ran out before it was renewed (a session re-acquired meanwhile has a new
    lease object, which the callbacks leave alone).
    """

    def __init__(
        self,
        store: Store,
        settings: OwnershipSettings,
        address: str,
        models: Sequence[str],
        numerics: str,
        held: Callable[[], list[SessionLease]],
        on_lost: Callable[[SessionLease, SsmserveError], None],
        on_expired: Callable[[SessionLease], None],
        worker_id: str = "",
        stats: Callable[[], WorkerStats] = WorkerStats,
    ) -> None:
        self._stats = stats  # what the heartbeat reports of the work done
        self.store = store
        self.settings = settings
        self.worker_id = worker_id or new_worker_id()
        self.address = address
        self.models = tuple(models)
        self.numerics = numerics
        self.draining = False
        self.started_at = time.time()
        self.renewals = 0  # rounds that reached Redis (tests, operators)
        self.worst_late_s = 0.0  # the latest start of a round after its due time (tests)
        # Sessions found held by others, watched until they may be taken over.
        self.takeovers = Takeovers(settings.lease_ttl_s)
        # Ids of earlier workers at this address known dead (``advertise_lock``): their
        # sessions are taken over at once, their beats needing no watch.
        self.predecessors: frozenset[str] = frozenset()
        # Read alongside each round's heartbeat (``store_guard``: the store's eviction
        # policy and identity); never raises.
        self.store_checks: Callable[[], Awaitable[None]] | None = None
        self._held = held
        self._on_lost = on_lost
        self._on_expired = on_expired
        self._task: asyncio.Task[None] | None = None

    @property
    def lease_ms(self) -> int:
        return self.settings.lease_ms

    def new_lease(self, session_id: str, token: str, sent_at: float) -> SessionLease:
        """The lease a create or acquire sent at ``sent_at`` (monotonic) just gave us: it
        runs until ``sent_at`` plus the TTL, less the margin (``SessionLease.extend``)."""
        valid_until = max(0.0, sent_at + self.settings.lease_valid_s)
        return SessionLease(session_id, token, self.worker_id, valid_until)

    async def start(self) -> None:
        await self.heartbeat()
        self._task = asyncio.create_task(self._keep(), name="ownership")

    async def stop(self, deregister: bool = True) -> None:
        """Stop renewing; ``deregister`` removes the registry entry (a crash leaves it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if deregister:
            with contextlib.suppress(SsmserveError):
                await self.store.deregister_worker(self.worker_id, self.address)

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.worker_id,
            address=self.address,
            models=self.models,
            load=len(self._held()),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            draining=self.draining,
            numerics=self.numerics,
            stats=self._stats(),
        )

    async def heartbeat(self) -> None:
        await self.store.register_worker(self.record(), int(self.settings.worker_ttl_s * 1000))

    async def set_draining(self, draining: bool = True) -> None:
        self.draining = draining
        await self.heartbeat()

    async def renew(self, leases: Sequence[SessionLease] | None = None) -> None:
        """Extend ``leases`` (default: every held one); report the ones lost or expired."""
        held = list(self._held() if leases is None else leases)
        if not held:
            return
        sent_at = lease_clock()
        results = await self.store.renew_leases(held, self.lease_ms)
        for lease, error in zip(held, results, strict=True):
            if error is None:
                lease.extend(sent_at, self.settings.lease_ttl_s, self.settings.margin_s)
            elif isinstance(error, LeaseExpiredError):
                log.warning("session %s: lease ran out before its renewal", lease.session_id)
                lease.expire()
                self._on_expired(lease)
            elif isinstance(error, _NOT_OURS):
                # A session closed while its renewal was on the way is gone as it should
                # be; only a lease lost to another worker is worth a warning.
                level = logging.INFO if isinstance(error, SessionMissingError) else logging.WARNING
                log.log(
                    level, "session %s: lease not renewed: %s", lease.session_id, error,
                    extra={"session_id": lease.session_id, "token": lease.token,
                           "event": "fenced" if level == logging.WARNING else "gone"},
                )  # fmt: skip
                lease.expire()
                self._on_lost(lease, error)
            else:
                # Not renewed, and nothing says the session is someone else's (an unknown
                # outcome, a refusal such as READONLY or OOM): a renewal changes no session
                # data, so memory stays; the lease's own clock bound runs out unextended,
                # and the session is revalidated before its next answer.
                log.warning(
                    "session %s: lease renewal failed: %s", lease.session_id, error,
                    extra={"session_id": lease.session_id, "token": lease.token,
                           "event": "renewal_failed"},
                )  # fmt: skip

    async def revalidate(
        self, leases: Sequence[SessionLease]
    ) -> list[SessionLease | SsmserveError]:
        """Renew ``leases`` now; one that ran out while nobody took the session is acquired
        again, only if its token is still the session's (which proves nobody else owned
        it meanwhile). One entry per lease: the lease to use from now on (the same one,
        extended, or a new one), or the error that stands in the way."""
        sent_at = lease_clock()
        try:
            results = await self.store.renew_leases(leases, self.lease_ms)
        except SsmserveError as exc:
            return [exc] * len(leases)
        out: list[SessionLease | SsmserveError] = []
        for lease, error in zip(leases, results, strict=True):
            if error is None:
                lease.extend(sent_at, self.settings.lease_ttl_s, self.settings.margin_s)
                out.append(lease)
            elif isinstance(error, LeaseExpiredError):
                lease.expire()
                again = lease_clock()
                try:
                    token = await self.store.acquire(
                        lease.session_id, self.worker_id, self.address, self.lease_ms,
                        expect=lease.token, numerics=self.numerics,
                    )  # fmt: skip
                except SsmserveError as exc:
                    out.append(exc)
                    continue
                log.info("session %s: lease acquired again after it ran out", lease.session_id)
                out.append(self.new_lease(lease.session_id, token, again))
            else:
                lease.expire()
                out.append(error)
        return out

    async def reacquire(self, lease: SessionLease) -> SessionLease | SsmserveError:
        """Acquire ``lease``'s session again as its holder (only while its token is still
        the session's): a new token, so a write of this worker still in flight under the
        old one is refused wherever it lands. The new lease, or what stands in the way.

        A token that moved on to one this very worker made (a re-acquisition of its own
        whose answer was lost: the session's owner is this worker's id, which no other
        process has) is taken over after a renewal proves it."""
        sent_at = lease_clock()
        try:
            token = await self.store.acquire(
                lease.session_id, self.worker_id, self.address, self.lease_ms,
                expect=lease.token, numerics=self.numerics,
            )  # fmt: skip
        except SessionMissingError as gone:  # while held: a later owner closed it, or a wipe
            return SessionVanishedError(
                f"{gone} while this worker held it (closed by a later owner, or the store "
                f"was wiped: the worker checks which); retry"
            )
        except StaleEpochError as moved:
            try:
                meta = await self.store.get_meta(lease.session_id)
                if meta is None or meta.owner != self.worker_id or meta.token == lease.token:
                    return moved
                own = self.new_lease(lease.session_id, meta.token, 0.0)
                (renewed,) = await self.store.renew_leases([own], self.lease_ms)
            except SsmserveError as exc:
                return exc
            if renewed is not None:
                return renewed
            own.extend(sent_at, self.settings.lease_ttl_s, self.settings.margin_s)
            return own
        except SsmserveError as exc:
            return exc
        return self.new_lease(lease.session_id, token, sent_at)

    async def _keep(self) -> None:
        """Heartbeat and renew on a fixed schedule (monotonic, so it does not drift)."""
        period = self.settings.period_s
        due = time.monotonic() + period
        finished = 0.0  # when the last round's store calls were done
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            self.worst_late_s = max(self.worst_late_s, now - due)
            if now - due > period:
                # Late because the last round's calls ran past this round's time (Redis
                # slow or away: each call waits up to --redis-timeout), or because the
                # sleep overslept its time.
                why = (
                    "the last round waited for Redis"
                    if finished > due
                    else "the event loop was blocked"
                )
                log.warning("lease renewal ran %.2f s late (%s)", now - due, why)
            due = max(due + period, now)
            checks = self.store_checks() if self.store_checks else asyncio.sleep(0)
            try:
                await asyncio.gather(self.heartbeat(), self.renew(), checks)
                self.renewals += 1
            except SsmserveError as exc:  # Redis away: keep trying; leases self-fence
                self.store.metrics.lease_renewals_failed.inc()
                log.warning("heartbeat/lease renewal failed: %s", exc)
            finally:
                finished = time.monotonic()

    def not_to_self(self, session_id: str, error: SsmserveError) -> SsmserveError:
        """``error``, unless it is a redirect naming this worker's own address: that one
        came from the store, written by another worker id at this address (a predecessor
        this worker cannot prove dead, or a twin that slipped past the start checks), and
        would send the caller back here. It becomes :class:`TakeoverPendingError`: retry
        here once this worker may take the session over."""
        if not isinstance(error, SessionMovedError) or error.owner != self.address:
            return error
        holder = "another worker"
        wait_ms = error.retry_after_ms or self.lease_ms
        if isinstance(error, LeaseHeldError) and error.owner_id:
            holder = f"worker {clip(error.owner_id, 64)}"
        return TakeoverPendingError(
            f"session {clip(session_id)} is still held by {holder}, which registered this "
            f"worker's own address ({self.address}): an earlier worker here that this one "
            f"cannot prove dead. This worker takes the session over once that lease has "
            f"stood unrenewed for a whole TTL on its clock (a takeover is pending); retry "
            f"here in {wait_ms} ms",
            retry_after_ms=wait_ms,
        )

    # ------------------------------------------------------------------ peers

    async def live_workers(self) -> list[WorkerRecord]:
        return await self.store.live_workers()

    async def worker_at(self, address: str) -> WorkerRecord | None:
        return await self.store.worker_at(address)

    async def targets(self, model: str, numerics: str = "") -> list[WorkerRecord]:
        """Other live, non-draining workers serving ``model``, least loaded first; with
        ``numerics``, only those whose engine gives the same bits."""
        return self.targets_among(await self.live_workers(), model, numerics)

    def targets_among(
        self, workers: Sequence[WorkerRecord], model: str, numerics: str = ""
    ) -> list[WorkerRecord]:
        """:meth:`targets`, from a registry read the caller already made."""
        return sorted(
            (
                w
                for w in workers
                if w.worker_id != self.worker_id
                and w.address != self.address  # a dead predecessor's entry: this worker
                and not w.draining
                and model in w.models
                and (not numerics or w.numerics == numerics)
            ),
            key=lambda w: (w.load, w.address),
        )


def least_loaded(targets: Sequence[WorkerRecord], planned: dict[str, int]) -> WorkerRecord:
    """The target with the fewest sessions, counting ``planned`` (address -> sessions
    already sent there by the caller since the registry read) on top of its heartbeat's
    load; ties go to the lower address, so every caller picks alike."""
    return min(targets, key=lambda w: (w.load + planned.get(w.address, 0), w.address))
