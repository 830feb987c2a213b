"""ssmserve-client: talk to ssmserve workers from Python, blocking or asyncio.

    from ssmserve.client import Client

    with Client("127.0.0.1:50051") as client:
        sid = client.create_session("demo").session_id
        for out in client.stream_steps(sid, signal):
            ...
        client.rollback(sid, to_step=10)

``Client`` (blocking) and ``AsyncClient`` (asyncio) have the same methods; both follow
sessions between workers (``RetryPolicy``) and raise the typed errors of
``ssmserve.client.errors``. The generated stubs are ``ssmserve.v1``. This distribution
never imports the server's.
"""

from ssmserve.client.aio import AsyncClient, Forecast, StepOutput
from ssmserve.client.errors import SessionMoved, SsmserveClientError, StepFailed
from ssmserve.client.retry import RetryPolicy
from ssmserve.client.sync import Client

__all__ = [
    "AsyncClient",
    "Client",
    "Forecast",
    "RetryPolicy",
    "SessionMoved",
    "SsmserveClientError",
    "StepFailed",
    "StepOutput",
]
