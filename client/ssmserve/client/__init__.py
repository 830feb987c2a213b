"""ssmserve-client: talk to ssmserve workers from Python, blocking or asyncio.

    from ssmserve.client import Client

    with Client("127.0.0.1:50051") as client:
        session = client.create_session("demo")
        for out in client.stream_steps(session, signal):
            ...
        client.rollback(session, to_step=10)

``Client`` (blocking) and ``AsyncClient`` (asyncio) have the same methods; both follow
sessions between workers (``RetryPolicy``) and raise the typed errors of
``ssmserve.client.errors``. The generated stubs are ``ssmserve.v1``. This distribution
never imports the server's.

The names below are imported on first use (PEP 562): the ``ssmserve`` command imports
modules of this package without paying for gRPC and numpy when it only parses flags.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ssmserve.client.aio import AsyncClient, Forecast, GeneratedToken, StepOutput
    from ssmserve.client.errors import (
        OwnerUnreachable,
        ServerUnreachable,
        SessionMoved,
        SsmserveClientError,
        StepFailed,
    )
    from ssmserve.client.guards import guard_rule
    from ssmserve.client.retry import RetryPolicy
    from ssmserve.client.sync import Client

_HOMES = {
    "AsyncClient": "ssmserve.client.aio",
    "Forecast": "ssmserve.client.aio",
    "GeneratedToken": "ssmserve.client.aio",
    "StepOutput": "ssmserve.client.aio",
    "OwnerUnreachable": "ssmserve.client.errors",
    "ServerUnreachable": "ssmserve.client.errors",
    "SessionMoved": "ssmserve.client.errors",
    "SsmserveClientError": "ssmserve.client.errors",
    "StepFailed": "ssmserve.client.errors",
    "RetryPolicy": "ssmserve.client.retry",
    "guard_rule": "ssmserve.client.guards",
    "Client": "ssmserve.client.sync",
}

__all__ = [
    "AsyncClient",
    "Client",
    "Forecast",
    "GeneratedToken",
    "OwnerUnreachable",
    "RetryPolicy",
    "ServerUnreachable",
    "SessionMoved",
    "SsmserveClientError",
    "StepFailed",
    "StepOutput",
    "guard_rule",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
