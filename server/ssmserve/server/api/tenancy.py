"""Session ids per tenant: how a caller's ids map to the ids sessions are stored under.

Ids are scoped by tenant, so two tenants can use the same id without seeing or
disturbing each other, and no answer reveals that another tenant's session exists: a
session of tenant ``acme`` with the id ``robot-7`` is stored as ``acme~robot-7`` (``~``
cannot appear in an id a client gives). A ``client`` names its own sessions by their
plain id and sees only them; anything else it names is simply not found. Operators,
admins and workers see every tenant and name sessions by their stored id. Without
``--auth-tokens`` nobody has a tenant and stored ids are the plain ids (as before).

The tenant of a stored session is the part of its id before ``~`` ('' when none).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from ssmserve.server.api.auth import Principal
from ssmserve.server.state.session_ids import check_session_id

SEPARATOR = "~"


def tenant_of(stored_id: str) -> str:
    tenant, sep, _ = stored_id.partition(SEPARATOR)
    return tenant if sep else ""


@dataclass(frozen=True)
class TenantScope:
    """The ids one caller may use. ``tenant`` None: every tenant, ids as stored."""

    tenant: str | None = None

    @classmethod
    def of(cls, principal: Principal | None) -> TenantScope:
        if principal is None or principal.sees_every_tenant:
            return cls(None)
        return cls(principal.tenant)

    @property
    def prefix(self) -> str:
        return f"{self.tenant}{SEPARATOR}" if self.tenant else ""

    def stored(self, session_id: str) -> str:
        """The stored id of a session the caller names (validated as a client id)."""
        if not self.tenant:
            return session_id
        check_session_id(session_id)  # a plain id: no tenant, no '~'
        return self.prefix + session_id

    def new_id(self, session_id: str) -> str:
        """The stored id of a session the caller creates ('' = pick one)."""
        if not self.tenant:
            return session_id
        return self.stored(session_id or secrets.token_hex(8))

    def adopted(self, checkpoint_id: str) -> str:
        """A checkpoint's session id, taken into the caller's tenant (an import)."""
        if not self.tenant:
            return checkpoint_id
        return self.prefix + checkpoint_id.rpartition(SEPARATOR)[2]

    def shown(self, stored_id: str) -> str:
        """A stored id as the caller names it."""
        return stored_id.removeprefix(self.prefix) if self.tenant else stored_id

    def clean(self, text: str) -> str:
        """A message with the caller's own tenant prefix taken out of the ids in it."""
        return text.replace(self.prefix, "") if self.tenant else text
