"""One process per data directory: an exclusive lock, held for the owner's life.

The embedded Redis keeps its AOF in ``DATA_DIR/redis``; two redis-servers appending to
the same AOF corrupt it, and two workers each with its own Redis on one directory make
two stores that each believe they hold every session. So whoever starts the embedded
Redis (a worker, or the ``--workers`` supervisor) first takes ``DATA_DIR/ssmserve.lock``
with ``flock``; a second one is refused with the directory and the pid that holds it.

The redis-server inherits the lock's file (``EmbeddedRedis(hold_fd=...)``), so the
directory stays locked as long as either process runs: a worker killed with SIGKILL
leaves its Redis a moment to flush and exit (it gets SIGTERM when its owner dies, on
Linux), and a worker started again meanwhile waits for that instead of starting a second
Redis on the same files. The file says which pids hold it (``owner PID`` and
``redis PID`` lines); the kernel releases the lock when the last of them exits, so a
stale file never blocks anyone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ssmserve.server.errors import ErrorKind, SsmserveError

log = logging.getLogger(__name__)

LOCK_FILE = "ssmserve.lock"


class DataDirInUseError(SsmserveError):
    """Another live process holds the data directory."""

    kind = ErrorKind.FAILED_PRECONDITION


@dataclass(frozen=True)
class DataDirLockSettings:
    data_dir: Path
    # How long to wait when the recorded owner is dead but the lock is still held: its
    # redis-server is then shutting down (SIGTERM on its owner's death flushes the AOF
    # and exits within a second or two; 10 s is redis-server's own stop bound here).
    orphan_wait_s: float = 10.0
    poll_s: float = 0.05


class DataDirLock:
    def __init__(self, settings: DataDirLockSettings) -> None:
        self.settings = settings
        self.path = settings.data_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        assert self._fd is not None, "acquire() first"
        return self._fd

    def acquire(self) -> DataDirLock:
        """Take the lock or raise :class:`DataDirInUseError` naming who holds it."""
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline: float | None = None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holders = _read_holders(fd)
                    owner = holders.get("owner")
                    if owner is not None and _alive(owner):
                        raise DataDirInUseError(self._message(holders)) from None
                    # The owner died; its redis-server (which holds the lock too) is on
                    # its way out. Wait a bounded time for it.
                    if deadline is None:
                        deadline = time.monotonic() + self.settings.orphan_wait_s
                        log.warning(
                            "data dir %s is still locked by the Redis of a process that "
                            "ended (%s); waiting up to %.0f s for it to exit",
                            self.settings.data_dir, _describe(holders),
                            self.settings.orphan_wait_s,
                        )  # fmt: skip
                    if time.monotonic() >= deadline:
                        raise DataDirInUseError(self._message(holders)) from None
                    time.sleep(self.settings.poll_s)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.note(owner=os.getpid())
        return self

    def note(self, owner: int | None = None, redis: int | None = None) -> None:
        """Record who holds the lock (read by a process that is refused)."""
        holders = _read_holders(self.fd)
        if owner is not None:
            holders["owner"] = owner
        if redis is not None:
            holders["redis"] = redis
        text = "".join(f"{k} {v}\n" for k, v in holders.items()).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the lock goes when every process holding this file closes it

    def _message(self, holders: dict[str, int]) -> str:
        return (
            f"--data-dir {self.settings.data_dir} is in use by {_describe(holders)}: two "
            f"embedded Redis servers on one AOF would corrupt it; stop that process or pick "
            f"another --data-dir"
        )


def _read_holders(fd: int) -> dict[str, int]:
    holders: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in os.pread(fd, 4096, 0).decode(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            if key in ("owner", "redis") and value.strip().isdigit():
                holders[key] = int(value)
    return holders


def _describe(holders: dict[str, int]) -> str:
    owner, redis = holders.get("owner"), holders.get("redis")
    if owner is not None and _alive(owner):
        its = f", whose redis-server is process {redis}" if redis else ""
        return f"process {owner} (another ssmserve-server?){its}"
    if redis is not None and _alive(redis):
        gone = f", left by process {owner} that has ended" if owner else ""
        return f"redis-server process {redis}{gone}"
    return "another process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
