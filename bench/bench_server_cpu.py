"""Server CPU per step, throughput and memory per resident session, at several session
counts, in one run.

Usage: ``.venv/bin/python bench/bench_server_cpu.py [--sessions 64,256,3000] [--steps 40]
[--quick] [--json OUT.json] [--baseline OTHER/.venv/bin/python] [--orders session,step]``

Processes: one redis-server (private, as in ``bench_service.py``), one ``ssmserve-server``
serving the demo model (log level WARNING); this process is the client (grpc.aio). On a
2-core machine client and server share the cores, so wall time and steps/s include the
client's own work; the server's CPU is read from ``/proc/PID/stat`` and is its own.

Each round (session counts ascending, the same server process throughout):

1. RSS of the server (``VmRSS``) is read, then N new sessions of the demo model are
   created (durability LOG, default snapshot_every), at most 64 CreateSession calls at
   once; RSS again.
2. Timed phase: the N sessions are spread over ceil(N / 50) streams, 50 sessions each.
   Every message of a stream carries 8 consecutive steps of each of its sessions (400
   steps); a stream sends a message, reads all its answers (a response may be split into
   several with ``continued``), then sends the next, until each session has done
   ``--steps`` steps. All streams run at once; inputs are packed vectors and requests ask
   for ``packed_outputs``. A message lists each session's steps together (the server
   steps them as one run); with ``--orders session,step`` each round is also run with
   the steps ordered step by step across the sessions (the server's per-step path),
   labelled "by step", side by side on the same server. The messages (random float32
   inputs of the model's input_dim) are built before the phase.
   Server CPU (utime + stime) is read right before and right after.
3. RSS right after the phase and again after 6 s idle (by then the manager has given
   each idle session state arrays of its own instead of views into its last batch's
   buffers, the background snapshot writes the phase started have ended, and the worker
   has returned the heap both freed); then server CPU over 5 s more with the sessions
   resident and idle (lease renewals of every held session every 1.7 s, heartbeats, idle
   checks: upkeep that grows with N, not with steps); then the round's sessions are closed (no final
   snapshot), so rounds do not accumulate.

Reported per N: steps, wall s, steps/s, server CPU s and us per step, the idle server
CPU (% of one core) and the us per step net of it (server CPU - idle rate * wall, / steps),
client CPU s (this process, for reference), server RSS growth per session (RSS after the
phase, and after the idle wait, minus RSS before this round's CreateSession calls, / N)
and the session's own data: state bytes (``MambaConfig.state_bytes``) + input history
(min(history_window, steps) * input_dim * 4) + recorded outputs (min(output_window,
steps) * output_dim * 4), and the ratios of the two. As ``bench_memory.py`` explains,
RSS/session also holds the Python objects around a session and the buffers its state and
outputs keep alive; and a later round may reuse heap that an earlier round freed (glibc
keeps it), which lowers its growth: read the growth of the first round as the cleanest
figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from harness import cpu_seconds, private_redis, standard_parser, start_server, table, write_result

from ssmserve.client.aio import step_input
from ssmserve.server.engine.loader import read_config
from ssmserve.server.main import ensure_demo_model
from ssmserve.server.sessions.config import SessionDefaults
from ssmserve.server.sessions.manager import ManagerSettings
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

SESSIONS_PER_STREAM = 50
STEPS_PER_MESSAGE = 8  # consecutive steps of each session in one message
STREAMS_PER_CHANNEL = 50  # below the server's default of 100 concurrent streams/connection
CREATE_AT_ONCE = 64
UNARY_TIMEOUT_S = 10.0
STREAM_TIMEOUT_S = 60.0  # plus MESSAGE_TIMEOUT_S per message of the stream
MESSAGE_TIMEOUT_S = 5.0  # a bound for long rounds on a loaded machine, not an expectation
SETTLE_S = 6.0  # idle time before the second RSS reading of a round (2.5 s ended
# before the snapshot writes of 3,000 sessions had, on a loaded 2-core host)
IDLE_S = 5.0  # then server CPU over this long with the sessions resident and idle


# ---------------------------------------------------------------------------- /proc


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---------------------------------------------------------------------------- server


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        print(f"server pid {proc.pid} did not exit 30 s after SIGTERM; killing it")
        proc.kill()
        proc.wait()


def server_variants(baseline: Path | None) -> dict[str, list[str]]:
    """The server commands to run side by side: this checkout's, and ``baseline``'s Python."""
    variants = {"as shipped": [sys.executable, "-m", "ssmserve.server.main"]}
    if baseline is not None:
        variants["baseline"] = [str(baseline), "-m", "ssmserve.server.main"]
    return variants


def start_demo_server(
    stack: contextlib.ExitStack, cmd: list[str], model_dir: Path, redis_dir: Path
) -> tuple[str, int]:
    """A server (``cmd``) of the demo model on a Redis of its own in ``redis_dir`` (two
    workers on one Redis would form a cluster and share sessions), both stopped when
    ``stack`` closes; returns its address and pid."""
    redis_server = stack.enter_context(private_redis(redis_dir))
    proc, address = start_server(
        [*cmd, "--model", f"demo={model_dir}", "--listen", "127.0.0.1:0",
         "--redis-url", redis_server.url]
    )  # fmt: skip
    stack.callback(stop, proc)
    return address, proc.pid


# ---------------------------------------------------------------------------- rounds


@dataclass
class Round:
    server: str
    sessions: int
    streams: int
    steps: int
    create_s: float
    create_server_cpu_s: float
    wall_s: float
    steps_per_s: float
    server_cpu_s: float
    server_cpu_us_per_step: float
    idle_server_cpu_per_s: float
    net_server_cpu_us_per_step: float
    client_cpu_s: float
    rss_before: int
    rss_created: int
    rss_after: int
    rss_settled: int
    rss_per_session: float
    rss_settled_per_session: float
    own_bytes_per_session: int
    rss_over_own: float
    rss_settled_over_own: float


async def bounded(calls: list[Callable[[], Awaitable[object]]], at_once: int) -> list[object]:
    """Run the calls, at most ``at_once`` at a time; results in order."""
    gate = asyncio.Semaphore(at_once)

    async def one(call: Callable[[], Awaitable[object]]) -> object:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


def messages(
    sids: list[str], steps: int, input_dim: int, rng: np.random.Generator, order: str
) -> list[pb.StreamRequest]:
    """One stream's requests: each with STEPS_PER_MESSAGE consecutive steps of each session
    (fewer in the last one when ``steps`` is not a multiple). ``order`` "session": a
    session's steps next to each other (the server runs them as one run); "step": the
    first step of every session, then the second, ... (the server steps them one by one)."""
    out = []
    for first in range(1, steps + 1, STEPS_PER_MESSAGE):
        last = min(first + STEPS_PER_MESSAGE - 1, steps)
        x = rng.standard_normal((len(sids), last - first + 1, input_dim)).astype(np.float32)
        pairs = [(i, step) for i in range(len(sids)) for step in range(first, last + 1)]
        if order == "step":
            pairs.sort(key=lambda pair: pair[1])
        inputs = [step_input(sids[i], step, x[i, step - first], packed=True) for i, step in pairs]
        out.append(pb.StreamRequest(steps=inputs, packed_outputs=True))
    return out


async def run_stream(
    stub: pb_grpc.SessionServiceStub, requests: list[pb.StreamRequest], output_bytes: int
) -> int:
    """Ping-pong the requests on one stream; every answer checked. Returns steps answered."""
    call = stub.Stream(timeout=STREAM_TIMEOUT_S + MESSAGE_TIMEOUT_S * len(requests))
    answered = 0
    for req in requests:
        await call.write(req)
        got = 0
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise RuntimeError(f"stream ended after {got} of {len(req.steps)} answers")
            for r in reply.results:
                if r.HasField("error"):
                    e = r.error
                    raise RuntimeError(
                        f"step {r.step} of {r.session_id}: {e.reason} ({e.code}) {e.message}"
                    )
                if len(r.output.packed) != output_bytes:
                    raise RuntimeError(
                        f"step {r.step} of {r.session_id}: {len(r.output.packed)} packed "
                        f"output bytes, expected {output_bytes}"
                    )
            got += len(reply.results)
            if not reply.continued:
                break
        if got != len(req.steps):
            raise RuntimeError(f"{got} answers to a message of {len(req.steps)} steps")
        answered += got
    await call.done_writing()
    return answered


async def one_round(
    server: str,
    stubs: list[pb_grpc.SessionServiceStub],
    pid: int,
    n: int,
    steps: int,
    model_state_bytes: int,
    rng: np.random.Generator,
    order: str = "session",
) -> Round:
    stub = stubs[0]
    rss_before = rss_bytes(pid)
    cfg = pb.SessionConfig(durability=pb.DURABILITY_LOG)
    create_req = pb.CreateSessionRequest(model="demo", config=cfg)
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    infos: list[pb.SessionInfo] = await bounded(  # type: ignore[assignment]
        [lambda: stub.CreateSession(create_req, timeout=UNARY_TIMEOUT_S)] * n, CREATE_AT_ONCE
    )
    create_s = time.perf_counter() - t0
    create_cpu = cpu_seconds(pid) - cpu0
    rss_created = rss_bytes(pid)
    sids = [info.session_id for info in infos]
    info = await stub.GetSession(pb.GetSessionRequest(session_id=sids[0]), timeout=UNARY_TIMEOUT_S)
    input_dim, output_dim = info.input_dim, info.output_dim
    history_window = info.config.history_window or SessionDefaults().history_window
    output_window = ManagerSettings().output_window

    groups = [sids[i : i + SESSIONS_PER_STREAM] for i in range(0, n, SESSIONS_PER_STREAM)]
    plans = [messages(g, steps, input_dim, rng, order) for g in groups]

    client0 = time.process_time()
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    done = await asyncio.gather(
        *(
            run_stream(stubs[i // STREAMS_PER_CHANNEL], plan, output_dim * 4)
            for i, plan in enumerate(plans)
        )
    )
    wall = time.perf_counter() - t0
    server_cpu = cpu_seconds(pid) - cpu0
    client_cpu = time.process_time() - client0
    rss_after = rss_bytes(pid)
    total = sum(done)
    assert total == n * steps, (total, n * steps)
    # A session idle for over a second gets state arrays of its own instead of views into
    # its last batch's buffers (the manager's idle check, every second): RSS once it did.
    await asyncio.sleep(SETTLE_S)
    rss_settled = rss_bytes(pid)
    # What the N resident sessions cost the server while nobody steps them (lease
    # renewals, heartbeats, idle checks), to tell per-step work from per-session upkeep.
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    await asyncio.sleep(IDLE_S)
    idle_rate = (cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)

    await bounded(
        [
            lambda sid=sid: stub.CloseSession(
                pb.CloseSessionRequest(session_id=sid), timeout=UNARY_TIMEOUT_S
            )
            for sid in sids
        ],
        CREATE_AT_ONCE,
    )

    own = (
        model_state_bytes
        + min(history_window, steps) * input_dim * 4
        + min(output_window, steps) * output_dim * 4
    )
    per_session = (rss_after - rss_before) / n
    settled_per_session = (rss_settled - rss_before) / n
    return Round(
        server=server if order == "session" else f"{server}, by step",
        sessions=n,
        streams=len(groups),
        steps=total,
        create_s=create_s,
        create_server_cpu_s=create_cpu,
        wall_s=wall,
        steps_per_s=total / wall,
        server_cpu_s=server_cpu,
        server_cpu_us_per_step=server_cpu / total * 1e6,
        idle_server_cpu_per_s=idle_rate,
        net_server_cpu_us_per_step=(server_cpu - idle_rate * wall) / total * 1e6,
        client_cpu_s=client_cpu,
        rss_before=rss_before,
        rss_created=rss_created,
        rss_after=rss_after,
        rss_settled=rss_settled,
        rss_per_session=per_session,
        rss_settled_per_session=settled_per_session,
        own_bytes_per_session=own,
        rss_over_own=per_session / own,
        rss_settled_over_own=settled_per_session / own,
    )


async def bench(
    servers: list[tuple[str, str, int]],
    counts: list[int],
    steps: int,
    model_state_bytes: int,
    orders: list[str],
) -> tuple[list[Round], str]:
    """Rounds of every size against each server (label, address, pid) in each message
    order, alternating servers and orders within a size so drift on a shared machine hits
    them alike."""
    streams = max(math.ceil(n / SESSIONS_PER_STREAM) for n in counts)
    channels = {
        # separate connections: a local subchannel pool each, so they are not shared
        label: [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(math.ceil(streams / STREAMS_PER_CHANNEL))
        ]
        for label, address, _pid in servers
    }
    try:
        stubs = {
            label: [pb_grpc.SessionServiceStub(c) for c in cs] for label, cs in channels.items()
        }
        label0, address0, _ = servers[0]
        try:
            workers = await pb_grpc.ClusterServiceStub(channels[label0][0]).ListWorkers(
                pb.ListWorkersRequest(), timeout=UNARY_TIMEOUT_S
            )
            numerics = next((w.numerics for w in workers.workers if w.address == address0), "")
        except grpc.aio.AioRpcError:
            numerics = ""
        rng = np.random.default_rng(0)
        for label, _address, pid in servers:  # warm-up (first-call paths), not reported
            await one_round(
                label, stubs[label], pid, min(counts[0], 16), STEPS_PER_MESSAGE,
                model_state_bytes, rng,
            )  # fmt: skip
        rounds = []
        for n in counts:
            for label, _address, pid in servers:
                for order in orders:
                    r = await one_round(
                        label, stubs[label], pid, n, steps, model_state_bytes, rng, order
                    )
                    print(
                        f"  {r.server}: {n} sessions: {r.steps} steps in {r.wall_s:.2f} s, "
                        f"server CPU {r.server_cpu_s:.2f} s",
                        flush=True,
                    )
                    rounds.append(r)
        return rounds, numerics
    finally:
        for cs in channels.values():
            for c in cs:
                await c.close()


def report(rounds: list[Round]) -> str:
    rows = [
        [
            r.server,
            r.sessions,
            r.streams,
            r.steps,
            r.wall_s,
            r.steps_per_s,
            r.server_cpu_s,
            r.server_cpu_us_per_step,
            r.idle_server_cpu_per_s * 100,
            r.net_server_cpu_us_per_step,
            r.client_cpu_s,
            r.rss_per_session / 1024,
            r.own_bytes_per_session / 1024,
            r.rss_over_own,
            r.rss_settled_per_session / 1024,
            r.rss_settled_over_own,
        ]
        for r in rounds
    ]
    headers = [
        "server",
        "sessions",
        "streams",
        "steps",
        "wall s",
        "steps/s",
        "server CPU s",
        "server CPU us/step",
        "idle server CPU %",
        "us/step net of idle",
        "client CPU s",
        "RSS growth/session KiB",
        "own data/session KiB",
        "RSS / own",
        f"RSS growth/session KiB, {SETTLE_S:g} s idle",
        "settled / own",
    ]
    return table(headers, rows)


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--sessions", default="64,256,3000", help="comma-separated session counts")
    parser.add_argument("--steps", type=int, default=40, help="steps per session per round")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: sessions 64,256,500, 16 steps"
    )
    parser.add_argument(
        "--orders",
        default="session",
        help="comma-separated message orders: 'session' (each session's steps together: "
        "the server runs them as one run) and/or 'step' (step by step across sessions: "
        "the per-step path), alternated within each round size",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="PYTHON",
        help="also run the server of another checkout side by side: the Python of its "
        "venv (e.g. a clone of main before a change, set up with ./dev lint)",
    )
    args = parser.parse_args()
    if args.quick:
        counts, steps = [64, 256, 500], 16
    else:
        counts, steps = sorted(int(s) for s in args.sessions.split(",")), args.steps
    if not counts or min(counts) < 1 or steps < 1:
        parser.error("session counts and --steps must be positive")
    orders = args.orders.split(",")
    if not orders or not set(orders) <= {"session", "step"}:
        parser.error("--orders takes 'session', 'step' or both")

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model_dir = ensure_demo_model(Path(tmp) / "demo")
        state_bytes = read_config(model_dir).state_bytes
        servers = []
        for i, (label, cmd) in enumerate(server_variants(args.baseline).items()):
            address, pid = start_demo_server(stack, cmd, model_dir, Path(tmp) / f"redis{i}")
            servers.append((label, address, pid))
        rounds, numerics = asyncio.run(bench(servers, counts, steps, state_bytes, orders))

    print("\n# server CPU per step, demo model, durability log, multiplexed streams\n")
    print(
        f"{SESSIONS_PER_STREAM} sessions per stream, {STEPS_PER_MESSAGE} steps of each per "
        f"message, ping-pong per stream, all streams at once; {steps} steps per session\n"
    )
    print(report(rounds))
    print(
        f"\nown data = state {state_bytes} B + history + recorded outputs; "
        f"RSS growth = RSS after the timed phase (and after {SETTLE_S:g} s idle) - RSS "
        "before the round's CreateSession"
    )
    try:
        version = metadata.version("ssmserve")
    except metadata.PackageNotFoundError:
        version = "?"
    print(f"ssmserve {version}, server numerics signature {numerics or '?'}, {os.cpu_count()} CPUs")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    if args.json:
        result = {
            "version": version,
            "numerics": numerics,
            "state_bytes": state_bytes,
            "steps_per_session": steps,
            "rounds": [asdict(r) for r in rounds],
        }
        write_result(args.json, result, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
