"""A TCP proxy on a loopback port that can black-hole its traffic, for fault tests.

``black_hole()`` stops moving bytes in both directions without closing anything: senders
see their writes accepted (into kernel buffers) and never an answer, as behind a network
that drops packets. ``heal(deliver=True)`` moves the held bytes on (late: a command sent
during the outage then runs after its sender gave up on it); ``heal(deliver=False)``
resets every connection instead (the held bytes are lost, as when a partition outlives
the connections). New connections made during an outage are accepted and then hang.
``slow(delay_s)`` holds each chunk that long before passing it on (a congested or distant
link: everything arrives, late); ``heal()`` makes the link fast again.

The proxy runs its own asyncio loop on a daemon thread; every method is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit

from ssmserve.server.embedded_redis import free_port


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0  # accepted so far
        self.auth = ""  # ':password@' of the Redis behind it
        self.delay_s = 0.0  # each chunk waits this long before it is passed on (slow())

    @classmethod
    def to_url(cls, redis_url: str) -> TcpProxy:
        """A proxy in front of ``redis://[:password@]host:port``; ``proxy.url`` reaches
        the same Redis (with the same password) through it."""
        parsed = urlsplit(redis_url)
        assert parsed.hostname and parsed.port, redis_url
        proxy = cls(parsed.hostname, parsed.port)
        proxy.auth = f":{parsed.password}@" if parsed.password else ""
        return proxy.start()

    @property
    def url(self) -> str:
        return f"redis://{self.auth}{self.address}"

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def black_hole(self) -> None:
        self._call(self._set(False))

    def heal(self, deliver: bool = True) -> None:
        if not deliver:
            self._call(self._reset())
        self.delay_s = 0.0
        self._call(self._set(True))

    def slow(self, delay_s: float) -> None:
        """Pass every chunk on ``delay_s`` late, in both directions (order is kept: each
        direction's pump waits before each write)."""
        self.delay_s = delay_s

    def retarget(self, host: str, port: int) -> None:
        """Send new connections to ``host:port`` and reset the open ones: what a client
        sees when the address it dials now leads to another server (a failover behind a
        virtual IP or a DNS name)."""
        self._call(self._retarget((host, port)))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ loop side

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _set(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _retarget(self, target: tuple[str, int]) -> None:
        self.target = target
        await self._reset()

    async def _reset(self) -> None:
        for writer in list(self._conns):
            transport = writer.transport
            with contextlib.suppress(Exception):
                transport.abort()  # RST: what was buffered is dropped
        self._conns.clear()

    async def _stop(self) -> None:
        await self._reset()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        assert self._flowing is not None
        await self._flowing.wait()  # a connection made during an outage hangs
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()
                data = await src.read(1 << 16)
                if not data:
                    break
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                await self._flowing.wait()  # read just before an outage: hold it
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()
            self._conns.discard(dst)
