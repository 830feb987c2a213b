"""The fault scheduler: a thread that injects faults drawn from ``random.Random(seed)``.

Each fault is injected, held for a drawn time and repaired by the same call (a killed
process is started again, a frozen one thawed, a link healed, the clock set back), so a
fault never outlives its call. Up to ``parallel`` faults run at once, never two on one
target (a worker, a link, a Redis node), so faults overlap (a worker killed while
another's Redis link is cut) without undoing each other. Every fault is counted by kind
and recorded in the history with its start and end.

The draws are seeded, but the run is not replayable step for step: the processes'
scheduling is the machine's. A seed replays the same plan of faults (kinds, targets,
durations, gaps), which is what makes a failing seed worth trying again.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import redis

from tests.nemesis.history import History
from tests.nemesis.topology import Topology
from tests.tcp_proxy import TcpProxy


@dataclass
class FaultKind:
    name: str
    weight: float
    targets: Callable[[], list[str]]  # what it may hit now (empty: not now)
    run: Callable[[str, random.Random, threading.Event], str]  # returns a detail


class Nemesis:
    """Draws and injects faults on ``topology`` until :meth:`stop`."""

    def __init__(self, topology: Topology, history: History, seed: int, parallel: int = 2) -> None:
        self.topo = topology
        self.history = history
        self.rng = random.Random(seed)
        self.parallel = parallel
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._main = threading.Thread(target=self._loop, name="nemesis", daemon=True)
        self.errors: list[str] = []  # a fault that could not be injected or repaired
        self.kinds = self._kinds()

    # ------------------------------------------------------------------ scheduling

    def start(self) -> Nemesis:
        self._main.start()
        return self

    def stop(self, timeout_s: float = 90.0) -> None:
        """Stop drawing faults and wait (bounded) for those under way to be repaired."""
        self._stop.set()
        self._main.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def _loop(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.3, 2.0)):
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) >= self.parallel:
                continue
            with self._lock:
                choices = [(k, t) for k in self.kinds for t in k.targets() if t not in self._busy]
                if not choices:
                    continue
                weights = [k.weight / len(k.targets()) for k, _ in choices]
                kind, target = self.rng.choices(choices, weights)[0]
                self._busy.add(target)
            # Each fault draws from its own generator, seeded from the scheduler's, so a
            # fault's draws do not depend on how the threads interleave.
            rng = random.Random(self.rng.getrandbits(64))
            t = threading.Thread(
                target=self._one, args=(kind, target, rng), name=f"fault-{kind.name}", daemon=True
            )
            self._threads.append(t)
            t.start()

    def _one(self, kind: FaultKind, target: str, rng: random.Random) -> None:
        record = self.history.fault(kind.name, target)
        self.counts[kind.name] += 1
        try:
            record.detail = kind.run(target, rng, self._stop)
        except Exception as exc:  # a harness failure is reported, not fatal
            self.errors.append(f"{kind.name} on {target}: {type(exc).__name__}: {exc}")
            record.detail = f"FAILED: {exc}"
        finally:
            record.end = time.time()
            with self._lock:
                self._busy.discard(target)

    # ------------------------------------------------------------------ the faults

    def _kinds(self) -> list[FaultKind]:
        topo = self.topo
        workers = [f"w{i}" for i in range(len(topo.workers))]

        def live_workers() -> list[str]:
            # Never the last live worker: the clients need someone to answer eventually.
            live = [w for w, p in zip(workers, topo.workers, strict=True) if p.alive]
            return live if len(live) > 1 else []

        kinds = [
            FaultKind("worker-kill-9", 3, live_workers, self._worker_kill),
            FaultKind("worker-sigstop", 3, live_workers, self._worker_pause),
            FaultKind("client-link-black-hole", 2, lambda: [f"in:{w}" for w in workers],
                      self._black_hole),
            FaultKind("client-link-slow", 1.5, lambda: [f"in:{w}" for w in workers], self._slow),
            FaultKind("cpu-hog", 1, lambda: ["cpu"], self._cpu_hog),
        ]  # fmt: skip
        if topo.single is not None:
            links = [f"redis:{w}" for w in workers]
            kinds += [
                FaultKind("redis-link-black-hole", 2, lambda: links, self._black_hole),
                FaultKind("redis-link-slow", 1.5, lambda: links, self._slow),
                FaultKind("redis-kill-9", 1, lambda: ["redis"], self._redis_kill),
                FaultKind("redis-sigstop", 1.5, lambda: ["redis"], self._redis_pause),
                FaultKind("redis-restart", 1, lambda: ["redis"], self._redis_restart),
                FaultKind("redis-restart-wiped", 0.1, lambda: ["redis"], self._redis_wipe),
            ]
            if topo.single.faketime:
                kinds.append(FaultKind("redis-clock-step", 1.5, lambda: ["clock"], self._clock))
        else:
            nodes = lambda: [f"node:{p}" for p in topo.redis_processes()]  # noqa: E731
            kinds += [
                FaultKind("redis-node-kill-9", 1, nodes, self._node_kill),
                FaultKind("redis-node-sigstop", 1.5, nodes, self._node_pause),
            ]
            if topo.sentinel is not None:
                kinds.append(
                    FaultKind("sentinel-failover", 1, lambda: ["failover"], self._failover)
                )
            else:
                kinds.append(
                    FaultKind("cluster-failover", 1, lambda: ["failover"], self._cluster_failover)
                )
        return kinds

    def _worker(self, target: str) -> int:
        return int(target.split("w")[-1])

    def _worker_kill(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        w = self.topo.workers[self._worker(target)]
        w.kill()
        down = rng.uniform(0.2, 4.0)
        stop.wait(down)
        # Not under the topology's lock: a start can wait a minute for a Redis that is
        # down, and a Redis fault running meanwhile needs the lock to start Redis again
        # (held here, it kept Redis down 3 minutes and the worker from starting). No other
        # fault touches this worker while this one runs.
        self.topo.restart_worker(w)
        return f"down {down:.1f}s"

    def _worker_pause(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        w = self.topo.workers[self._worker(target)]
        w.pause()
        held = rng.choice([rng.uniform(0.1, 0.9), rng.uniform(1.0, 4.0)])  # < and > the TTL
        stop.wait(held)
        if w.alive:
            w.resume()
        return f"frozen {held:.1f}s"

    def _proxy(self, target: str) -> TcpProxy:
        side, worker = target.split(":")
        i = int(worker[1:])
        return (self.topo.client_proxies if side == "in" else self.topo.redis_proxies)[i]

    def _black_hole(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        proxy = self._proxy(target)
        proxy.black_hole()
        held = rng.choice([rng.uniform(0.1, 0.9), rng.uniform(1.0, 5.0)])
        deliver = rng.random() < 0.5
        stop.wait(held)
        proxy.heal(deliver=deliver)
        return f"{held:.1f}s, then {'delivered late' if deliver else 'reset'}"

    def _slow(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        proxy = self._proxy(target)
        delay = rng.uniform(0.02, 0.4)
        held = rng.uniform(1.0, 5.0)
        proxy.slow(delay)
        stop.wait(held)
        proxy.heal()
        return f"+{delay * 1000:.0f} ms a chunk for {held:.1f}s"

    def _cpu_hog(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        held = rng.uniform(1.0, 4.0)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        try:
            stop.wait(held)
        finally:
            for h in hogs:
                h.kill()
                h.wait(10)
        return f"2 hogs for {held:.1f}s"

    # ------------------------------------------------------------------ single Redis

    def _redis_kill(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        assert self.topo.single is not None
        down = rng.uniform(0.1, 3.0)
        with self.topo.lock:
            self.topo.single.kill()
        stop.wait(down)
        with self.topo.lock:
            self.topo.single.start()
        return f"down {down:.1f}s (AOF kept)"

    def _redis_pause(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        assert self.topo.single is not None
        held = rng.choice([rng.uniform(0.1, 0.9), rng.uniform(1.0, 3.0)])
        self.topo.single.signal(signal.SIGSTOP)
        stop.wait(held)
        self.topo.single.signal(signal.SIGCONT)
        return f"frozen {held:.1f}s"

    def _redis_restart(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        assert self.topo.single is not None
        with self.topo.lock:
            self.topo.single.stop()
            self.topo.single.start()
        return "SIGTERM, started again with its AOF"

    def _redis_wipe(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        assert self.topo.single is not None
        with self.topo.lock:
            self.topo.single.kill()
            self.topo.single.wipe()
            self.topo.single.start()
        self.history.note("store wiped: every session it held is lost (documented)")
        return "kill -9, data removed, started empty"

    def _clock(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        assert self.topo.single is not None
        offset = rng.choice([-1, 1]) * rng.uniform(5, 120)
        held = rng.uniform(1.0, 6.0)
        self.topo.single.step_clock(offset)
        stop.wait(held)
        self.topo.single.step_clock(0)
        return f"Redis's wall clock {offset:+.0f}s for {held:.1f}s"

    # ------------------------------------------------------------------ Sentinel, Cluster

    def _node(self, target: str) -> int:
        return int(target.split(":")[1])

    def _node_kill(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        port = self._node(target)
        with self.topo.lock:
            proc = self.topo.redis_processes().get(port)
            if proc is None:
                return "already down"
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
            harness = self.topo.sentinel or self.topo.cluster
            assert harness is not None
            harness.processes.procs.pop(port, None)
        down = rng.uniform(3.0, 8.0)  # long enough for a failover to happen
        stop.wait(down)
        with self.topo.lock:
            self.topo.restart_redis_nodes()
        return f"down {down:.1f}s"

    def _node_pause(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        proc = self.topo.redis_processes().get(self._node(target))
        if proc is None:
            return "down"
        held = rng.choice([rng.uniform(0.1, 0.9), rng.uniform(1.0, 3.0)])
        proc.send_signal(signal.SIGSTOP)
        stop.wait(held)
        with suppress(OSError):
            proc.send_signal(signal.SIGCONT)
        return f"frozen {held:.1f}s"

    def _failover(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        assert self.topo.sentinel is not None
        if len(self.topo.redis_processes()) < 2:
            return "skipped: a node is down"
        old = self.topo.sentinel.master()
        new = self.topo.sentinel.failover(timeout_s=30.0)
        return f"master {old} -> {new}"

    def _cluster_failover(self, target: str, rng: random.Random, stop: threading.Event) -> str:
        assert self.topo.cluster is not None
        replicas = []
        for port in self.topo.redis_processes():
            with suppress(redis.RedisError), redis.Redis(port=port, socket_timeout=1) as r:
                if r.info("replication")["role"] == "slave":
                    replicas.append(port)
        if not replicas:
            return "skipped: no replica up"
        port = rng.choice(sorted(replicas))
        with redis.Redis(port=port, socket_timeout=5) as r:
            try:
                r.execute_command("CLUSTER", "FAILOVER")
            except redis.ResponseError as exc:
                if "FORCE" not in str(exc):
                    raise
                # Its master is down: what an operator does then (the cluster's own
                # failover may not have run yet).
                r.execute_command("CLUSTER", "FAILOVER", "FORCE")
                return f"replica {port} promoted (FORCE: its master is down)"
        return f"replica {port} promoted"
