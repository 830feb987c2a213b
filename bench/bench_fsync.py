"""Served steps/s and step latency of a ``log``-durability workload with the Redis at
``appendfsync always`` against ``appendfsync everysec``, side by side in one run.

Usage: ``.venv/bin/python bench/bench_fsync.py [--quick] [--rounds N] [--block-s S]
[--sessions 1,64] [--per-message 1,8] [--json OUT]``

What it prices: ``always`` is what loses no acknowledged step when Redis is killed (its
AOF write and fsync happen before it answers; a group commit, the one pipeline of a
tick's appends, waits for one fsync). ``everysec`` answers first and fsyncs in the
background once a second; while that fsync is slow it holds AOF writes back (up to 2 s,
then writes anyway and counts ``aof_delayed_fsync`` in ``INFO persistence``), and what
it holds back is what a kill loses.

Processes: two plain ``redis-server`` on loopback (AOF on, ``--save ""``), one with
``--appendfsync always``, one with ``everysec``, their AOFs in this run's temp dir (the
file system it is on is printed: on tmpfs an fsync costs nothing and the comparison says
nothing); two ``ssmserve-server`` workers (demo model, ``tests/worker_process.
WorkerProcess``), each with ``--redis-url`` to its own Redis. This process is the client,
on bare grpc.aio stubs. All of them share this machine's cores and disk.

Cases, interleaving and checks are bench/bench_replication.py's (its machinery is
imported from there): K sessions (``--sessions``, durability ``log``), one stream each,
all at once, ``--per-message`` consecutive steps of a session per message, ping-pong; a
step's latency is its message's round trip. Both workers stay up the whole run, only one
is driven at a time, every (case, worker) once per round for ``--block-s`` seconds in a
shuffled order, each stream's first exchange of a block not counted; a (case, worker)'s
figures pool its blocks of all rounds, and the ratios always / everysec are what to read.
Every step is answered once, in order, without an error. Around every block both
Redises' ``aof_delayed_fsync`` are read (reported per block in the JSON, summed per
(case, worker) in the table), and each Redis's ``appendfsync`` is read back at the start
(a problem if it is not the one asked for). The workers' WARNING and ERROR lines are
printed at the end. The last line of the output is one JSON object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replication import (
    Case,
    Pool,
    Served,
    block,
    log_lines,
    open_served,
    parse_list,
    pct,
)
from harness import cpu_seconds, standard_parser, table, write_result

from ssmserve.server.main import ensure_demo_model
from tests.redis_topologies import _Processes, free_cluster_port
from tests.worker_process import WorkerProcess

CONFIGS = ("everysec", "always")  # appendfsync of the two Redises (the baseline first)


@dataclasses.dataclass
class FsyncPool(Pool):
    """What one (case, worker) measured over its blocks, and its Redis's part."""

    redis_cpu_s: float = 0.0
    delayed_fsync: int = 0  # aof_delayed_fsync of its own Redis during its blocks
    other_delayed_fsync: int = 0  # ... of the other (idle) Redis during the same blocks


@dataclasses.dataclass
class Redises:
    """The two redis-servers, by appendfsync."""

    processes: _Processes
    ports: dict[str, int]

    def pid(self, config: str) -> int:
        return self.processes.procs[self.ports[config]].pid

    def persistence(self, config: str) -> dict[str, object]:
        with redis.Redis(port=self.ports[config], socket_timeout=5) as r:
            return dict(r.info("persistence"))

    def delayed_fsync(self) -> dict[str, int]:
        """``aof_delayed_fsync`` of each Redis since it started."""
        return {c: int(str(self.persistence(c)["aof_delayed_fsync"])) for c in self.ports}

    def appendfsync(self, config: str) -> str:
        with redis.Redis(port=self.ports[config], socket_timeout=5, decode_responses=True) as r:
            return str(r.config_get("appendfsync").get("appendfsync"))


def start_redises(root: Path) -> Redises:
    processes = _Processes(root)
    ports: dict[str, int] = {}
    for config in CONFIGS:

        def args(port: int, config: str = config) -> list[str]:
            return [
                "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes",
                "--appendfsync", config, "--save", "", "--protected-mode", "no",
            ]  # fmt: skip

        port = free_cluster_port(taken=list(ports.values()))
        ports[config] = processes.start_on_free_port(port, args, list(ports.values()))
    return Redises(processes, ports)


def file_system(path: Path) -> str:
    """The type and device of the mount ``path`` is on (``/proc/mounts``)."""
    path = path.resolve()
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            device, point, kind = line.split()[:3]
            inside = path == Path(point) or Path(point) in path.parents
            if inside and len(point) >= len(best[0]):
                best = (point, kind, device)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


async def fsync_block(
    served: Served,
    case: Case,
    seconds: float,
    redises: Redises,
    out: FsyncPool,
) -> dict[str, object]:
    """bench_replication's block on ``served`` (its WAIT count read on its own Redis), with
    both Redises' ``aof_delayed_fsync`` and its Redis's CPU around it; what it measured."""
    config = served.config
    delayed0, steps0, seconds0 = redises.delayed_fsync(), out.steps, out.seconds
    cpu0 = cpu_seconds(redises.pid(config))
    await block(served, case, seconds, redises.ports[config], out)
    out.redis_cpu_s += cpu_seconds(redises.pid(config)) - cpu0
    delayed = {c: n - delayed0[c] for c, n in redises.delayed_fsync().items()}
    out.delayed_fsync += delayed[config]
    out.other_delayed_fsync += sum(n for c, n in delayed.items() if c != config)
    steps, took = out.steps - steps0, out.seconds - seconds0
    return {
        "sessions": case.sessions, "per_message": case.per_message, "appendfsync": config,
        "steps": steps, "steps_per_s": steps / took if took else 0.0,
        "aof_delayed_fsync": delayed,
    }  # fmt: skip


async def bench(
    workers: dict[str, WorkerProcess],
    redises: Redises,
    cases: list[Case],
    rounds: int,
    seconds: float,
    seed: int,
) -> tuple[dict[tuple[Case, str], FsyncPool], list[dict[str, object]]]:
    """The pools of every (case, worker), and every counted block in the order run."""
    rng = random.Random(seed)
    most = max(c.sessions for c in cases)
    served: dict[str, Served] = {}
    blocks: list[dict[str, object]] = []
    try:
        for config, w in workers.items():
            served[config] = await open_served(config, w, most)
        pools = {(c, config): FsyncPool() for c in cases for config in workers}
        # one short block of each first, not counted: imports, caches, connections
        for c in cases:
            for config in workers:
                await fsync_block(served[config], c, min(seconds, 0.3), redises, FsyncPool())
        for i in range(rounds):
            t0 = time.perf_counter()
            items = [(c, config) for c in cases for config in workers]
            rng.shuffle(items)
            for c, config in items:
                done = await fsync_block(served[config], c, seconds, redises, pools[(c, config)])
                blocks.append({"round": i + 1, **done})
            print(f"(round {i + 1}/{rounds}: {time.perf_counter() - t0:.1f} s)", flush=True)
        return pools, blocks
    finally:
        for s in served.values():
            await s.channel.close()


def figures(pools: dict[tuple[Case, str], FsyncPool]) -> list[dict[str, object]]:
    rows = []
    for (case, config), p in pools.items():
        rows.append({
            "sessions": case.sessions, "per_message": case.per_message, "appendfsync": config,
            "blocks": p.blocks, "steps": p.steps, "seconds": p.seconds,
            "steps_per_s": p.steps / p.seconds if p.seconds else 0.0,
            "p50_ms": pct(p.rtts, 50) * 1e3, "p99_ms": pct(p.rtts, 99) * 1e3,
            "server_cpu_us_per_step": p.cpu_s / p.steps * 1e6 if p.steps else 0.0,
            "redis_cpu_us_per_step": p.redis_cpu_s / p.steps * 1e6 if p.steps else 0.0,
            "aof_delayed_fsync": p.delayed_fsync,
            "other_redis_aof_delayed_fsync": p.other_delayed_fsync,
            "waits": p.waits,
        })  # fmt: skip
    return rows


RATIO_OF = ("steps_per_s", "p50_ms", "p99_ms", "server_cpu_us_per_step", "redis_cpu_us_per_step")


def ratios(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Per case: always / everysec of steps/s, p50, p99, and worker and Redis CPU per step."""
    by = {(r["sessions"], r["per_message"], r["appendfsync"]): r for r in rows}
    out: list[dict[str, object]] = []
    for (k, m, config), always in by.items():
        everysec = by.get((k, m, "everysec"))
        if config != "always" or everysec is None:
            continue
        ratio: dict[str, object] = {}
        for q in RATIO_OF:
            a, b = float(str(always[q])), float(str(everysec[q]))
            ratio[f"{q}_always_over_everysec"] = a / b if b else None
        out.append({"sessions": k, "per_message": m, **ratio})
    return out


def main() -> int:
    parser = standard_parser(__doc__, quick="2 rounds of 0.5 s blocks")
    parser.add_argument("--rounds", type=int, help="rounds (default 20; --quick 2)")
    parser.add_argument("--block-s", type=float, help="seconds per block (default 2; quick 0.5)")
    parser.add_argument("--sessions", type=parse_list, default=[1, 64], help="K (1,64)")
    parser.add_argument("--per-message", type=parse_list, default=[1, 8],
                        help="steps of a session per message (1,8)")  # fmt: skip
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 20)
    seconds = args.block_s or (0.5 if args.quick else 2.0)
    cases = [Case(k, m) for k in args.sessions for m in args.per_message]
    started = time.perf_counter()
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-fsync-") as name:
        tmp = Path(name)
        models = {"demo": ensure_demo_model(tmp / "models" / "demo")}
        where = file_system(tmp)
        redises = start_redises(tmp / "redis")
        try:
            policies = {c: redises.appendfsync(c) for c in CONFIGS}
            problems += [f"the {c} Redis runs appendfsync {p}" for c, p in policies.items()
                         if p != c]  # fmt: skip
            workers = {
                config: WorkerProcess(
                    models, f"redis://127.0.0.1:{redises.ports[config]}",
                    tmp / f"worker-{config}", lease_ttl_s=5.0,
                )
                for config in CONFIGS
            }  # fmt: skip
            try:
                for w in workers.values():
                    w.start(timeout_s=120)
                print(f"(2 Redises and {len(workers)} workers up in "
                      f"{time.perf_counter() - started:.1f} s; {rounds} rounds of "
                      f"{seconds:g} s blocks; AOFs on {where}; {os.cpu_count()} CPUs)\n",
                      flush=True)  # fmt: skip
                pools, blocks = asyncio.run(bench(workers, redises, cases, rounds, seconds, 0))
                logs = {config: log_lines(w) for config, w in workers.items()}
            finally:
                for w in workers.values():
                    w.kill()
            persistence = {c: redises.persistence(c) for c in CONFIGS}
        finally:
            redises.processes.stop_all()
    rows = figures(pools)  # in the order of the cases, everysec before always
    compared = ratios(rows)
    aof = {
        c: {q: p.get(q) for q in ("aof_delayed_fsync", "aof_rewrites", "aof_current_size",
                                  "aof_last_write_status", "aof_last_bgrewrite_status")}
        for c, p in persistence.items()
    }  # fmt: skip

    print("\n# served on one plain Redis each (AOF on), durability log, per worker\n")
    print(table(
        ["sessions x steps per message", "appendfsync", "blocks", "steps", "steps/s",
         "p50 ms", "p99 ms", "server CPU us/step", "Redis CPU us/step",
         "aof_delayed_fsync (own / other Redis)"],
        [[f"{r['sessions']} x {r['per_message']}", r["appendfsync"], r["blocks"], r["steps"],
          r["steps_per_s"], r["p50_ms"], r["p99_ms"], r["server_cpu_us_per_step"],
          r["redis_cpu_us_per_step"],
          f"{r['aof_delayed_fsync']} / {r['other_redis_aof_delayed_fsync']}"] for r in rows],
    ))  # fmt: skip
    print("\n# appendfsync always against everysec, same run\n")
    print(table(
        ["sessions x steps per message", "steps/s always / everysec", "p50 always / everysec",
         "p99 always / everysec", "server CPU always / everysec", "Redis CPU always / everysec"],
        [[f"{r['sessions']} x {r['per_message']}",
          *(f"{r[f'{q}_always_over_everysec']:.2f}"
            if r[f"{q}_always_over_everysec"] is not None else "-" for q in RATIO_OF)]
         for r in compared],
    ))  # fmt: skip
    print("\nlatency: a message's round trip (its steps are answered together); one stream "
          "per session, ping-pong; aof_delayed_fsync: AOF writes the Redis held back 2 s "
          "behind a slow fsync, then wrote anyway, during the worker's blocks (own: the "
          "driven worker's Redis; other: the idle one's)")  # fmt: skip
    for config, a in aof.items():
        print(f"\nRedis appendfsync {config}: " + ", ".join(f"{k} {v}" for k, v in a.items()))
    for config, (store_line, bad) in logs.items():
        print(f"\nworker on the {config} Redis: {store_line.strip()}")
        print(f"  {len(bad)} WARNING/ERROR lines" + "".join(f"\n    {b}" for b in bad[-10:]))
    elapsed = time.perf_counter() - started
    print(f"\n(whole benchmark: {elapsed:.0f} s)")
    problems += [f"{c} Redis: aof_last_write_status {a['aof_last_write_status']}"
                 for c, a in aof.items() if a["aof_last_write_status"] != "ok"]  # fmt: skip
    if problems:
        print(f"\nRedis not as configured: {problems}", file=sys.stderr)
    report = {"rows": rows, "ratios": compared, "blocks": blocks, "rounds": rounds,
              "block_s": seconds, "seconds": round(elapsed, 1), "problems": problems,
              "aof_file_system": where, "cpus": os.cpu_count(), "redis": aof,
              "worker_logs": {c: {"store": v[0], "warnings_or_errors": len(v[1])}
                              for c, v in logs.items()}}  # fmt: skip
    if args.json:
        write_result(args.json, report, line=False)
    print(json.dumps(report))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
