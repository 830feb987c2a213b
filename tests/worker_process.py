"""A worker as a real ``ssmserve-server`` process, for crash, pause and signal tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ssmserve.server.embedded_redis import free_port


class WorkerProcess:
    """``python -m ssmserve.server.main`` on a fixed loopback port (kept across restarts)."""

    def __init__(
        self,
        models: dict[str, Path],
        redis_url: str | None,  # None: the worker runs its embedded Redis in data_dir
        data_dir: Path,
        lease_ttl_s: float = 1.0,
        port: int = 0,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.models = models
        self.redis_url = redis_url
        self.data_dir = data_dir
        self.lease_ttl_s = lease_ttl_s
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = data_dir / f"worker-{self.port}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.extra_args = extra_args
        self.env = env
        self.starts = 0
        self.ready = False  # serving (started and not killed since)

    def start(self, timeout_s: float = 30.0) -> WorkerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "ssmserve.server.main", "--listen", self.address]
        if self.redis_url is not None:
            args += ["--redis-url", self.redis_url]
        args += ["--data-dir", str(self.data_dir)]
        args += ["--lease-ttl", str(self.lease_ttl_s)]
        for name, directory in self.models.items():
            args += ["--model", f"{name}={directory}"]
        args += self.extra_args
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "listening on" in line:
                self.starts += 1
                self.ready = True
                return self
            if not line and self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"worker {self.address} did not start; see {self.log}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no drain, no snapshots, leases left to expire."""
        self.ready = False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies only when it runs
            self.proc.kill()
            self.proc.wait()

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain, then stop); returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
