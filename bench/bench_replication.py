"""Served steps/s and step latency on Sentinel with one replica, with and without replica
confirmation (``--redis-wait-replicas 0`` against ``auto``), side by side in one run.

Usage: ``.venv/bin/python bench/bench_replication.py [--quick] [--rounds N] [--block-s S]
[--sessions 1,64] [--per-message 1,8] [--json OUT]``

Processes: a Sentinel set on loopback (``tests/redis_topologies.SentinelHarness``: one
master, one replica, three sentinels; AOF on, ``appendfsync always``) and two
``ssmserve-server`` workers (demo model, ``tests/worker_process.WorkerProcess``) on the
same ``redis+sentinel://`` URL: one started with ``--redis-wait-replicas 0`` (no replica
confirmation) and one with ``auto`` (the default: every write waits, Redis WAIT, until
the one replica the master has at start holds it). This process is the client, on bare
grpc.aio stubs (no client retries that could hide a failed step). All of them share this
machine's cores.

Cases: K sessions (``--sessions``, durability ``log``, created on the worker that serves
them), each on a stream of its own, all at once; every message carries ``--per-message``
consecutive steps of its session; ping-pong (the next message is sent when the previous
one is answered). A step's latency is its message's round trip (written -> answer read).

Interleaving: both workers stay up the whole run and only one is driven at a time. Each
round runs every (case, worker) once for ``--block-s`` seconds, in a shuffled order;
each stream's first exchange of a block is not counted (the stream opens). A (case,
worker)'s figures pool its blocks of all rounds, so the machine's drift spreads over both
workers alike; the ratios auto / 0 are what to read. Checked: every step is answered
once, in order, without an error, and the master's ``WAIT`` calls (``INFO
commandstats``) are counted per block: the ``auto`` worker's blocks must have them (the
other worker's see only the idle ``auto`` worker's own, for its lease renewals and
heartbeats); after the rounds the ``auto`` worker is stopped and every case runs once
more on the ``0`` worker alone, which must cause no WAIT at all. The workers' log lines
of their replica confirmation and any WARNING or ERROR lines are printed at the end. The
last line of the output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cpu_seconds, standard_parser, table, write_result

from ssmserve.client.aio import step_input
from ssmserve.server.main import ensure_demo_model
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc
from tests.redis_topologies import SentinelHarness
from tests.worker_process import WorkerProcess

CONFIGS = ("0", "auto")  # --redis-wait-replicas of the two workers
CALL_TIMEOUT_S = 30.0  # the bound of every unary call; a stream's is its block + this


@dataclasses.dataclass(frozen=True)
class Case:
    sessions: int
    per_message: int

    @property
    def label(self) -> str:
        return f"{self.sessions} x {self.per_message}"


@dataclasses.dataclass
class Served:
    """One worker and the sessions it serves (their next step to send)."""

    config: str
    worker: WorkerProcess
    channel: grpc.aio.Channel
    stub: pb_grpc.SessionServiceStub
    next_step: dict[str, int]


@dataclasses.dataclass
class Pool:
    """What one (case, worker) measured over its blocks."""

    rtts: list[float] = dataclasses.field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    waits: int = 0
    messages: int = 0
    blocks: int = 0


def wait_calls(master_port: int) -> int:
    """``WAIT`` commands the master has run since it started."""
    with redis.Redis(port=master_port, socket_timeout=5) as r:
        stats = r.info("commandstats").get("cmdstat_wait", {})
    return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0


async def stream_block(
    served: Served,
    sid: str,
    per_message: int,
    go: asyncio.Event,
    ready: asyncio.Event,
    seconds: float,
    out: Pool,
) -> None:
    """One session's stream for one block: one exchange not counted, then ping-pong from
    ``go`` until ``seconds`` after it."""
    v = np.zeros(4, np.float32)
    call = served.stub.Stream(timeout=seconds + CALL_TIMEOUT_S)

    async def exchange() -> int:
        first = served.next_step[sid]
        steps = [step_input(sid, first + i, v) for i in range(per_message)]
        await call.write(pb.StreamRequest(steps=steps))
        results: list[pb.StepResult] = []
        while len(results) < per_message:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise RuntimeError(f"{served.config}: the stream of {sid} ended early")
            results += reply.results
        for i, r in enumerate(results):
            if r.HasField("error"):
                raise RuntimeError(f"{served.config}: {sid} step {first + i}: {r.error}")
            if r.step != first + i or r.session_id != sid:
                raise RuntimeError(
                    f"{served.config}: answer for {r.session_id} step {r.step}, "
                    f"expected {sid} step {first + i}"
                )
        served.next_step[sid] = first + per_message
        return len(results)

    await exchange()
    ready.set()
    await go.wait()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        answered = await exchange()  # (not `out.steps += await ...`: the streams share out)
        out.steps += answered
        out.rtts.append(time.perf_counter() - t0)
        out.messages += 1
    await call.done_writing()


async def block(served: Served, case: Case, seconds: float, master_port: int, out: Pool) -> None:
    """Every session of ``case`` at once on ``served`` for ``seconds``, added to ``out``."""
    sids = list(served.next_step)[: case.sessions]
    go = asyncio.Event()
    ready = [asyncio.Event() for _ in sids]
    tasks = [
        asyncio.create_task(stream_block(served, sid, case.per_message, go, ready[i], seconds, out))
        for i, sid in enumerate(sids)
    ]
    try:
        # until every stream had its first exchange, or one of them failed
        opened = asyncio.ensure_future(asyncio.gather(*(r.wait() for r in ready)))
        await asyncio.wait(
            [opened, *tasks], timeout=CALL_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        opened.cancel()
        for t in tasks:
            if t.done():
                t.result()  # raises what ended it
        if not all(r.is_set() for r in ready):
            raise RuntimeError(f"{served.config}: streams not open within {CALL_TIMEOUT_S:g} s")
        assert served.worker.proc is not None
        waits0, cpu0 = wait_calls(master_port), cpu_seconds(served.worker.proc.pid)
        t0 = time.perf_counter()
        go.set()
        await asyncio.gather(*tasks)
        out.seconds += time.perf_counter() - t0
        out.cpu_s += cpu_seconds(served.worker.proc.pid) - cpu0
        out.waits += wait_calls(master_port) - waits0
        out.blocks += 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_served(config: str, worker: WorkerProcess, sessions: int) -> Served:
    """A channel to ``worker`` and ``sessions`` demo sessions of log durability on it."""
    channel = grpc.aio.insecure_channel(worker.address)
    stub = pb_grpc.SessionServiceStub(channel)
    served = Served(config, worker, channel, stub, {})
    for _ in range(sessions):
        request = pb.CreateSessionRequest(
            model="demo", config=pb.SessionConfig(durability=pb.DURABILITY_LOG)
        )
        info = await stub.CreateSession(request, timeout=CALL_TIMEOUT_S)
        served.next_step[info.session_id] = info.step + 1
    return served


async def bench(
    workers: dict[str, WorkerProcess],
    cases: list[Case],
    rounds: int,
    seconds: float,
    master_port: int,
    seed: int,
) -> tuple[dict[tuple[Case, str], Pool], int]:
    """The pools of every (case, worker), and the WAITs of the 0 worker's blocks alone."""
    rng = random.Random(seed)
    most = max(c.sessions for c in cases)
    served: dict[str, Served] = {}
    try:
        for config, w in workers.items():
            served[config] = await open_served(config, w, most)
        pools = {(c, config): Pool() for c in cases for config in workers}
        # one short block of each first, not counted: imports, caches, connections
        for c in cases:
            for config in workers:
                await block(served[config], c, min(seconds, 0.3), master_port, Pool())
        for i in range(rounds):
            t0 = time.perf_counter()
            items = [(c, config) for c in cases for config in workers]
            rng.shuffle(items)
            for c, config in items:
                await block(served[config], c, seconds, master_port, pools[(c, config)])
            print(f"(round {i + 1}/{rounds}: {time.perf_counter() - t0:.1f} s)", flush=True)
        # the 0 worker alone (nothing else that could send a WAIT): it must send none
        workers["auto"].kill()
        alone = Pool()
        for c in cases:
            await block(served["0"], c, min(seconds, 0.5), master_port, alone)
        return pools, alone.waits
    finally:
        for s in served.values():
            await s.channel.close()


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q)) if samples else 0.0


def figures(pools: dict[tuple[Case, str], Pool]) -> list[dict[str, object]]:
    rows = []
    for (case, config), p in pools.items():
        rows.append({
            "sessions": case.sessions, "per_message": case.per_message, "wait_replicas": config,
            "blocks": p.blocks, "steps": p.steps, "seconds": p.seconds,
            "steps_per_s": p.steps / p.seconds if p.seconds else 0.0,
            "p50_ms": pct(p.rtts, 50) * 1e3, "p99_ms": pct(p.rtts, 99) * 1e3,
            "server_cpu_us_per_step": p.cpu_s / p.steps * 1e6 if p.steps else 0.0,
            "waits_per_message": p.waits / p.messages if p.messages else 0.0,
        })  # fmt: skip
    return rows


def ratios(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Per case: auto / 0 of steps/s, p50, p99 and server CPU per step."""
    by = {(r["sessions"], r["per_message"], r["wait_replicas"]): r for r in rows}
    out: list[dict[str, object]] = []
    for (k, m, config), auto in by.items():
        off = by.get((k, m, "0"))
        if config != "auto" or off is None:
            continue
        ratio: dict[str, object] = {}
        for q in ("steps_per_s", "p50_ms", "p99_ms", "server_cpu_us_per_step"):
            a, b = float(str(auto[q])), float(str(off[q]))
            ratio[f"{q}_auto_over_0"] = a / b if b else None
        out.append({"sessions": k, "per_message": m, **ratio})
    return out


def log_lines(worker: WorkerProcess) -> tuple[str, list[str]]:
    """The worker's line saying what replica confirmation it runs with, and its WARNING and
    ERROR lines."""
    lines = worker.log_text().splitlines()
    confirmation = next((line for line in lines if "store: " in line), "(no 'store:' line)")
    bad = [line for line in lines if " WARNING " in line or " ERROR " in line]
    return confirmation, bad


def parse_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want positive integers a,b,..., got {text!r}")
    return values


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
    with tempfile.TemporaryDirectory(prefix="bench-replication-") as name:
        tmp = Path(name)
        models = {"demo": ensure_demo_model(tmp / "models" / "demo")}
        with SentinelHarness(tmp / "sentinel", replicas=1) as sentinel:
            workers = {
                config: WorkerProcess(
                    models, sentinel.url, tmp / f"wait-{config}", lease_ttl_s=5.0,
                    extra_args=("--redis-wait-replicas", config),
                )
                for config in CONFIGS
            }  # fmt: skip
            try:
                for w in workers.values():
                    w.start(timeout_s=120)
                print(f"(Sentinel set and {len(workers)} workers up in "
                      f"{time.perf_counter() - started:.1f} s; {rounds} rounds of "
                      f"{seconds:g} s blocks)\n", flush=True)  # fmt: skip
                master = sentinel.master()
                pools, alone_waits = asyncio.run(
                    bench(workers, cases, rounds, seconds, master, seed=0)
                )
                logs = {config: log_lines(w) for config, w in workers.items()}
            finally:
                for w in workers.values():
                    w.kill()
    rows = figures(pools)  # in the order of the cases, 0 before auto
    compared = ratios(rows)

    print("\n# served on Sentinel (master + 1 replica), durability log, per worker\n")
    print(table(
        ["sessions x steps per message", "--redis-wait-replicas", "blocks", "steps",
         "steps/s", "p50 ms", "p99 ms", "server CPU us/step", "WAITs per message"],
        [[f"{r['sessions']} x {r['per_message']}", r["wait_replicas"], r["blocks"], r["steps"],
          r["steps_per_s"], r["p50_ms"], r["p99_ms"], r["server_cpu_us_per_step"],
          r["waits_per_message"]] for r in rows],
    ))  # fmt: skip
    print("\n# replica confirmation (auto) against none (0), same run\n")
    print(table(
        ["sessions x steps per message", "steps/s auto / 0", "p50 auto / 0", "p99 auto / 0",
         "server CPU auto / 0"],
        [[f"{r['sessions']} x {r['per_message']}",
          *(f"{r[q]:.2f}" if r[q] is not None else "-"
            for q in ("steps_per_s_auto_over_0", "p50_ms_auto_over_0", "p99_ms_auto_over_0",
                      "server_cpu_us_per_step_auto_over_0"))] for r in compared],
    ))  # fmt: skip
    print("\nlatency: a message's round trip (its steps are answered together); one stream "
          "per session, ping-pong; WAITs per message: the master's WAIT calls during the "
          "worker's blocks (the 0 worker's: the idle auto worker's renewals) / its "
          "messages")  # fmt: skip
    for config, (confirmation, bad) in logs.items():
        print(f"\nworker --redis-wait-replicas {config}: {confirmation.strip()}")
        print(f"  {len(bad)} WARNING/ERROR lines" + "".join(f"\n    {b}" for b in bad[-10:]))
    print(f"\nWAIT calls while the 0 worker ran alone (every case once): {alone_waits}")
    elapsed = time.perf_counter() - started
    print(f"\n(whole benchmark: {elapsed:.0f} s)")
    problems = [f"auto, {r['sessions']} x {r['per_message']}: no WAIT" for r in rows
                if r["wait_replicas"] == "auto" and not r["waits_per_message"]]  # fmt: skip
    if alone_waits:
        problems.append(f"0, alone: {alone_waits} WAIT calls")
    if problems:
        print(f"\nreplica confirmation not as configured: {problems}", file=sys.stderr)
    report = {"rows": rows, "ratios": compared, "rounds": rounds, "block_s": seconds,
              "seconds": round(elapsed, 1), "problems": problems, "alone_waits_0": alone_waits,
              "worker_logs": {c: {"confirmation": v[0], "warnings_or_errors": len(v[1])}
                              for c, v in logs.items()}}  # fmt: skip
    if args.json:
        write_result(args.json, report, line=False)
    print(json.dumps(report))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
