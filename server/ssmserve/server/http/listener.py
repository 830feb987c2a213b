"""The door's listener: uvicorn, in the worker's process and event loop.

The socket is bound first, when the worker starts (:meth:`HttpListener.bind`, before models
load): a port in use refuses the start with a message that names it. Serving begins once
the worker serves (:meth:`HttpListener.start`) and ends first when it stops
(:meth:`HttpListener.stop`): uvicorn stops taking connections, gives requests in flight
(streams included) ``shutdown_grace_s`` to finish and cancels the rest, as its own
``server.py`` shuts down on a signal; then the door closes the sessions it kept. The
worker owns the process's signals (SIGTERM drains it), so uvicorn installs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ssmserve.server.errors import ErrorKind, SsmserveError, clip

log = logging.getLogger(__name__)


class HttpListenError(SsmserveError):
    """``--http``'s address cannot be listened on (its port in use, or not an address)."""

    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class HttpSettings:
    """``--http`` and its bounds (documented in docs/serving.md)."""

    listen: str = ""  # host:port; "": no HTTP door; port 0 picks a free one
    max_body_bytes: int = 4 << 20  # a request body past this is a 413
    max_requests: int = 256  # requests running at once; past it a 429
    prefix_cache: int = 8  # kept sessions per tenant and model (0: none)
    start_timeout_s: float = 10.0  # uvicorn's start, at most
    shutdown_grace_s: float = 5.0  # requests in flight when it stops (the worker's own)


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise HttpListenError(f"--http {clip(listen)}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def bind(listen: str) -> socket.socket:
    """A listening socket on ``listen``, or HttpListenError naming what is wrong."""
    host, port = split_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise HttpListenError(f"--http {listen}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn binds: a restart may reuse a port whose old connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise HttpListenError(
                f"--http {listen}: port {port} is already in use; pick another port or "
                f"stop what holds it"
            ) from None
        raise HttpListenError(f"--http {listen}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


class HttpListener:
    """The uvicorn server of one worker's HTTP door."""

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self.socket: socket.socket | None = None
        self.address = ""  # host:port once bound
        self._server: object | None = None
        self._task: asyncio.Task[None] | None = None

    def bind(self) -> str:
        """Take the port (at the worker's start); returns host:port."""
        self.socket = bind(self.settings.listen)
        host = split_listen(self.settings.listen)[0]
        port = self.socket.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    async def start(self, app: object) -> None:
        """Serve ``app`` (an ASGI application) on the bound socket."""
        import uvicorn

        assert self.socket is not None, "bind() first"

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # the worker handles SIGTERM and SIGINT (a drain)

        config = uvicorn.Config(
            app,  # type: ignore[arg-type]
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=max(1, round(self.settings.shutdown_grace_s)),
            timeout_keep_alive=5,
        )
        server = Server(config)
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[self.socket]), name="http-door")
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise HttpListenError(f"--http {self.address}: the server stopped at start")
            if time.monotonic() > deadline:
                raise HttpListenError(
                    f"--http {self.address}: not serving after {self.settings.start_timeout_s:g} s"
                )
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on http://%s/v1", self.address)

    async def stop(self, grace: bool = True) -> None:
        """Stop taking requests; those in flight get the grace (none without ``grace``)."""
        server, task = self._server, self._task
        if server is not None and task is not None:
            server.should_exit = True  # type: ignore[attr-defined]
            if not grace:
                server.force_exit = True  # type: ignore[attr-defined]
            bound = self.settings.shutdown_grace_s + 5.0
            try:
                await asyncio.wait_for(asyncio.shield(task), bound)
            except TimeoutError:
                log.warning("http: the server did not stop within %.0f s; cancelled", bound)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            except Exception:
                log.exception("http: the server failed while stopping")
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        self._server = self._task = None
