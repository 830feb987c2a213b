"""One Redis connection kept by the store for single commands sent one after another.

A lone session's step makes one EVALSHA per step (its log append), and that round trip
is the served step's longest wait. Through ``Redis.evalsha`` each call also takes a
connection from the pool and gives it back (an ``asyncio.Lock`` each way, a health check,
redis-py's event dispatch and operation metrics, its retry wrapper): ~35-40 us of the
worker's CPU per call on top of the ~55 us the send and the reply cost themselves. The
served process is CPU-bound on that path, so the saving comes off every lone step
(docs/benchmark-history.md, "Issue 19, stop 38": a lone step's server CPU beside the build
without it).

``HeldConnection`` keeps one connection out of the pool (made by the pool, so it has the
pool's address, credentials, TLS and, behind Sentinel, its master lookup) and sends on
it directly. It serves one command at a time: a caller that finds it busy uses the pool
(``busy``), so concurrent callers never queue behind it.

Same failure rules as redis-py's own path (and ``StoreCalls._call`` above both): the command
is sent once, never retried; any error but an error reply, a cancellation included,
closes the connection (a reply may still be on its way), and the next call connects
again. Before each send, a connection with unread data or a closed socket is closed and
opened again, as the pool's ``ensure_connection`` does.
"""

from __future__ import annotations

from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio.connection import AbstractConnection, ConnectionPool


class HeldConnection:
    """One connection of ``pool``, used for one command at a time (see the module)."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._connection: AbstractConnection | None = None
        #: True while a command is on the connection: callers then use the pool instead.
        self.busy = False

    async def execute(self, *args: Any) -> Any:
        """Send one command and read its reply; an error reply is raised as redis-py
        raises it (``ResponseError`` and its subclasses, e.g. ``NoScriptError``)."""
        if self.busy:
            raise RuntimeError("the held connection is in use: check busy first")
        self.busy = True
        try:
            connection = self._connection
            if connection is None:
                connection = self._connection = self._pool.make_connection()
            # Behind Sentinel, the pool closes its idle connections once a new one learns
            # that the master moved; this one is not the pool's to close: follow it here.
            master = getattr(self._pool, "master_address", None)
            moved = master is not None and (connection.host, connection.port) != master
            if moved and connection.is_connected:
                await connection.disconnect()
            # As the pool's ensure_connection: connect() (behind Sentinel it asks for the
            # master; a no-op when connected), and a connection with data nobody asked
            # for, or that the server closed, is opened again.
            await connection.connect()
            try:
                stale = await connection.can_read()
            except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
                stale = True
            if stale:
                await connection.disconnect()
                await connection.connect()
                if await connection.can_read():
                    raise redis_errors.ConnectionError("a new connection has data nobody asked for")
            await connection.send_packed_command(connection.pack_command(*args), False)
            return await connection.read_response()
        except redis_errors.ResponseError:
            raise  # an error reply: the connection is in step
        except BaseException:
            # Anything else, a cancellation included, also one inside connect() (its
            # handshake's reply may still come): never read this connection again.
            if self._connection is not None:
                await self._connection.disconnect(nowait=True)
            raise
        finally:
            self.busy = False

    async def aclose(self) -> None:
        if self._connection is not None:
            await self._connection.disconnect()
            self._connection = None
