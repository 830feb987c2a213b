"""Budgets: how much one tenant, and all imports together, may hold of a worker.

Per tenant (callers with a tenant, that is with ``--auth-tokens``): stored sessions
(counted in Redis, so across workers), imports and forecasts running at once on this
worker, and the bytes its resident sessions here may hold. Per worker: the bytes of
checkpoints being received at once (staged in Redis, ``api.imports``). Memory is the
worker's one budget (``sessions.memory``), which sessions, forecasts and decoding imports
share. Past a budget the call gets RESOURCE_EXHAUSTED naming the budget and the current
use, before it changes anything; other tenants never notice.

The session count is checked before a create, and two creates racing past it can go one
over: a soft limit, cheap to check (one ZLEXCOUNT).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.state.store import Store


class BudgetExceededError(SsmserveError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class BudgetSettings:
    sessions_per_tenant: int = 1000  # stored sessions of one tenant, on all workers
    imports_per_tenant: int = 2  # ImportCheckpoint calls of one tenant running here
    forecasts_per_tenant: int = 32  # Forecast calls of one tenant running here
    # Checkpoint bytes being received by this worker's imports (staged in Redis) at once.
    import_buffer_bytes: int = 2 << 30
    # What one tenant's sessions resident here may hold (each at its bound); 0: a share
    # of the worker's memory budget only.
    resident_bytes_per_tenant: int = 0


class Budgets:
    def __init__(
        self,
        settings: BudgetSettings,
        store: Store,
        resident_bytes: Callable[[str], int] = lambda _prefix: 0,
    ) -> None:
        self.settings = settings
        self.store = store
        self.resident_bytes = resident_bytes  # of the sessions with a prefix, resident here
        self._imports: Counter[str] = Counter()
        self._forecasts: Counter[str] = Counter()
        self.import_bytes = 0  # reserved by imports being received now

    async def check_new_session(self, tenant: str | None, prefix: str) -> None:
        """Before a create, fork or import of ``tenant`` (None: no tenant, no budget)."""
        if not tenant:
            return
        limit_bytes, held = self.settings.resident_bytes_per_tenant, self.resident_bytes(prefix)
        if limit_bytes and held >= limit_bytes:
            raise BudgetExceededError(
                f"tenant {tenant!r} has sessions here that may hold {held:,} bytes, its "
                f"budget is {limit_bytes:,}: close some before making more"
            )
        count = await self.store.count_sessions(prefix)
        limit = self.settings.sessions_per_tenant
        if count >= limit:
            raise BudgetExceededError(
                f"tenant {tenant!r} has {count} sessions, its budget is {limit}: close some "
                f"(or ask for a larger budget) before making more"
            )

    @contextlib.contextmanager
    def importing(self, tenant: str | None) -> Iterator[ImportBuffer]:
        """One import of ``tenant`` running; its bytes are reserved as they are declared."""
        slot = TenantSlot(self._imports, tenant, self.settings.imports_per_tenant, "imports")
        slot.take()
        buffer = ImportBuffer(self)
        try:
            yield buffer
        finally:
            self.import_bytes -= buffer.reserved
            slot.release()

    @contextlib.contextmanager
    def forecasting_or_none(self, tenant: str | None) -> Iterator[TenantSlot]:
        """A forecast of ``tenant`` running for the block; ``take()`` takes its slot (so
        that the refusal is raised where the caller maps errors to statuses)."""
        limit = self.settings.forecasts_per_tenant
        slot = TenantSlot(self._forecasts, tenant, limit, "forecasts")
        try:
            yield slot
        finally:
            slot.release()


class TenantSlot:
    """One of ``limit`` calls of a kind a tenant may run at once (no tenant: no limit)."""

    def __init__(self, running: Counter[str], tenant: str | None, limit: int, what: str) -> None:
        self.running, self.tenant, self.limit, self.what = running, tenant, limit, what
        self.held = False

    def take(self) -> None:
        if not self.tenant:
            return
        if self.running[self.tenant] >= self.limit:
            raise BudgetExceededError(
                f"tenant {self.tenant!r} already runs {self.running[self.tenant]} {self.what} "
                f"on this worker, its budget is {self.limit}: wait for one to finish"
            )
        self.running[self.tenant] += 1
        self.held = True

    def release(self) -> None:
        if self.held:
            self.running[self.tenant or ""] -= 1
            self.held = False


class ImportBuffer:
    """The bytes one import will hold, reserved against the worker's import budget."""

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets
        self.reserved = 0

    def reserve(self, size: int) -> None:
        limit = self.budgets.settings.import_buffer_bytes
        held = self.budgets.import_bytes
        if held + size > limit:
            raise BudgetExceededError(
                f"this worker is receiving {held:,} bytes of checkpoints already; {size:,} more "
                f"would pass its import budget of {limit:,} bytes: retry later"
            )
        self.budgets.import_bytes += size
        self.reserved += size
