"""Served latency and throughput beside the machine's limits, in one run.

Usage: ``.venv/bin/python bench/bench_service.py [--quick]``

Processes: one redis-server (private, AOF on, appendfsync everysec), one
``ssmserve-server`` serving the demo model, one bare grpc.aio echo server; this process is
the client (grpc.aio). On this 2-core machine client and server share the cores, as they
would on one box.

Measured:
- step latency p50/p99: one session, one step per message, ping-pong on one stream,
  durability ``log`` (input in Redis before the answer) and ``none``, each with the
  server's CPU per step (``/proc``; the echo server's per message beside them);
- aggregate steps/s with 1, 16, 64 sessions: one stream per session, ping-pong; and the
  same sessions multiplexed on one stream (one message carries a step of each session);
- snapshot write of a 2.8 MiB (mamba-130m-shaped) state: encode + SET pieces + commit;
- rollback latency with 0, 8, 32 replayed steps (demo model);
- limits in the same run: a bare grpc.aio echo of the same bytes (ping-pong and
  concurrent streams), bare Redis SET of a log entry and of the 2.8 MiB blob;
- where a served step's time goes: the served p50 (durability log) beside the sum of its
  parts measured in this run, bare echo p50 + the demo model's engine step at batch 1 (in
  this process) + the log append p50, and issue 19's budget (that sum + 0.1 ms); beside
  it the same engine step timed after an idle gap of the echo's p50, as a served step's
  engine call comes (this host runs work right after an idle 2-3x slower).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
from bench_checkpoint import mamba130m_checkpoint
from harness import cpu_seconds, private_redis, standard_parser, start_server, table, write_result

from ssmserve.client.aio import step_input
from ssmserve.server.main import ensure_demo_model
from ssmserve.server.state.input_log import InputBlock
from ssmserve.server.state.store import Store
from ssmserve.server.state.store_calls import StoreSettings
from ssmserve.server.state.store_records import SnapshotRecord
from ssmserve.v1 import ssmserve_pb2 as pb
from ssmserve.v1 import ssmserve_pb2_grpc as pb_grpc

ECHO = Path(__file__).resolve().parent / "tools" / "echo_server.py"


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples) * 1e3, q))


# ---------------------------------------------------------------------------- served


async def ping_pong(stub: pb_grpc.SessionServiceStub, sid: str, steps: int) -> list[float]:
    """Per-step round trips on one stream, one step per message."""
    call = stub.Stream()
    x = np.random.default_rng(0).standard_normal((steps, 4)).astype(np.float32)
    info = await stub.GetSession(pb.GetSessionRequest(session_id=sid))
    samples = []
    for t in range(steps):
        req = pb.StreamRequest(steps=[step_input(sid, info.step + t + 1, x[t])])
        t0 = time.perf_counter()
        await call.write(req)
        reply = await call.read()
        samples.append(time.perf_counter() - t0)
        assert not reply.results[0].HasField("error"), reply.results[0].error
    await call.done_writing()
    return samples


async def aggregate(stub: pb_grpc.SessionServiceStub, sids: list[str], seconds: float) -> float:
    """Steps/s with one ping-pong stream per session, all at once."""
    deadline = time.perf_counter() + seconds
    counts = [0] * len(sids)

    async def run(i: int, sid: str) -> None:
        call = stub.Stream()
        step = (await stub.GetSession(pb.GetSessionRequest(session_id=sid))).step
        v = np.zeros(4, np.float32)
        while time.perf_counter() < deadline:
            step += 1
            await call.write(pb.StreamRequest(steps=[step_input(sid, step, v)]))
            await call.read()
            counts[i] += 1
        await call.done_writing()

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i, s) for i, s in enumerate(sids)))
    return sum(counts) / (time.perf_counter() - t0)


async def multiplexed(stub: pb_grpc.SessionServiceStub, sids: list[str], seconds: float) -> float:
    """Steps/s with all sessions on one stream, a step of each in every message."""
    call = stub.Stream()
    steps = {s: (await stub.GetSession(pb.GetSessionRequest(session_id=s))).step for s in sids}
    v = np.zeros(4, np.float32)
    done = 0
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < deadline:
        for s in sids:
            steps[s] += 1
        await call.write(pb.StreamRequest(steps=[step_input(s, steps[s], v) for s in sids]))
        await call.read()
        done += len(sids)
    await call.done_writing()
    return done / (time.perf_counter() - t0)


async def pipelined(
    stub: pb_grpc.SessionServiceStub,
    sids: list[str],
    seconds: float,
    per_session: int,
    depth: int = 2,
) -> tuple[float, list[float]]:
    """All sessions on one stream, ``per_session`` steps of each in every message, with
    ``depth`` messages in flight. Returns (steps/s, per-message round trips in s)."""
    call = stub.Stream()
    steps = {s: (await stub.GetSession(pb.GetSessionRequest(session_id=s))).step for s in sids}
    v = np.zeros(4, np.float32)
    sent: list[float] = []
    rtts: list[float] = []
    done = 0

    def message() -> pb.StreamRequest:
        out = []
        for s in sids:
            for _ in range(per_session):
                steps[s] += 1
                out.append(step_input(s, steps[s], v))
        return pb.StreamRequest(steps=out)

    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    for _ in range(depth):
        sent.append(time.perf_counter())
        await call.write(message())
    while sent:
        reply = await call.read()
        rtts.append(time.perf_counter() - sent.pop(0))
        done += len(reply.results)
        bad = [r for r in reply.results if r.HasField("error")]
        assert not bad, bad[0].error
        if time.perf_counter() < deadline:
            sent.append(time.perf_counter())
            await call.write(message())
    elapsed = time.perf_counter() - t0
    await call.done_writing()
    return done / elapsed, rtts


async def rollbacks(
    stub: pb_grpc.SessionServiceStub, sid: str, reps: int
) -> dict[int, list[float]]:
    """Rollback RPC latency with 0, 8, 32 logged steps to replay on top of a snapshot."""
    call = stub.Stream()
    x = np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32)
    base = (await stub.GetSession(pb.GetSessionRequest(session_id=sid))).step
    await stub.Snapshot(pb.SnapshotRequest(session_id=sid))
    at = base
    out: dict[int, list[float]] = {0: [], 8: [], 32: []}
    for _ in range(reps):
        for replay in out:
            # advance to base + 40 (re-sending what a rollback cut), then go back
            need = [step_input(sid, s, x[s - base - 1]) for s in range(at + 1, base + 41)]
            await call.write(pb.StreamRequest(steps=need))
            await call.read()
            t0 = time.perf_counter()
            reply = await stub.Rollback(pb.RollbackRequest(session_id=sid, step=base + replay))
            out[replay].append(time.perf_counter() - t0)
            assert reply.replayed_steps == replay, reply
            at = base + replay
    await call.done_writing()
    return out


# ---------------------------------------------------------------------------- limits


async def echo_ping_pong(address: str, payload: bytes, steps: int) -> list[float]:
    channel = grpc.aio.insecure_channel(address)
    call = channel.stream_stream("/bench.Echo/Echo")()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        await call.write(payload)
        await call.read()
        samples.append(time.perf_counter() - t0)
    await call.done_writing()
    await channel.close()
    return samples


async def echo_aggregate(address: str, payload: bytes, streams: int, seconds: float) -> float:
    channel = grpc.aio.insecure_channel(address)
    deadline = time.perf_counter() + seconds
    counts = [0] * streams

    async def run(i: int) -> None:
        call = channel.stream_stream("/bench.Echo/Echo")()
        while time.perf_counter() < deadline:
            await call.write(payload)
            await call.read()
            counts[i] += 1
        await call.done_writing()

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(streams)))
    rate = sum(counts) / (time.perf_counter() - t0)
    await channel.close()
    return rate


async def store_limits(url: str, reps: int) -> dict[str, list[float]]:
    store = Store(StoreSettings(url=url, key_prefix="bench"))
    r = store.redis
    ckpt = mamba130m_checkpoint()
    blob = ckpt.encode()
    out: dict[str, list[float]] = {
        "log": [], "set16": [], "big": [], "setbig": [], "enc": [], "big1": [], "enc1": [],
    }  # fmt: skip
    from ssmserve.server.state.lease import SessionLease, new_incarnation
    from ssmserve.server.state.store_records import SessionMeta

    lease = SessionLease("big", f"{new_incarnation()}.1", "bench")
    meta = SessionMeta(
        "big", "m", "f", 0, 1, b"c", 0.0, 0.0, False, epoch=1, owner="bench", token=lease.token
    )
    await store.create_session(
        meta, 60_000, SnapshotRecord("base", 0, "", "b", 0.0, 1, 1), b"x", 64
    )
    for i in range(reps):
        t0 = time.perf_counter()
        await store.append_logs([(lease, InputBlock.of(i + 1, [b"x" * 16]))], 0.0)
        out["log"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await r.set("bench:plain", b"x" * 16)
        out["set16"].append(time.perf_counter() - t0)
    for i in range(max(10, reps // 20)):
        t0 = time.perf_counter()
        data = ckpt.encode()
        rec = SnapshotRecord(f"s{i}", i, "", "bench", 0.0, len(data), 1)
        await store.commit_snapshot(lease, rec, data, 4)
        out["big"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckpt.encode()
        out["enc"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await r.set("bench:blob", blob)
        out["setbig"].append(time.perf_counter() - t0)
        # the same write in checkpoint format 1 (sha256), taking turns with format 2
        t0 = time.perf_counter()
        data = ckpt.encode(format_version=1)
        rec = SnapshotRecord(f"v1-{i}", i, "", "bench", 0.0, len(data), 1)
        await store.commit_snapshot(lease, rec, data, 4)
        out["big1"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckpt.encode(format_version=1)
        out["enc1"].append(time.perf_counter() - t0)
    await store.aclose()
    out["size"] = [len(blob)]
    return out


async def snapshot_p99(
    session: Any, stub: Any, secs: float, rounds: int, report: dict[str, object], server_pid: int
) -> None:
    """p99 while snapshots are written: 64 sessions ping-pong (1 step each per message),
    without snapshots during the run, then with one due every 8 steps of every session:
    all in the same phase (every session's snapshot comes due on the same tick), and with
    the phases spread over the 8 steps (as --spread-snapshots does at random). Also the
    server's CPU per message in each group (``/proc``): what the snapshots cost, less
    noisy than a p99 on a shared machine."""
    print("\n# step latency while snapshots are written (64 sessions, one stream, log)\n")
    groups = {
        "no snapshot due": [await session(pb.DURABILITY_LOG) for _ in range(64)],
        "snapshot every 8 steps, one phase": [
            await session(pb.DURABILITY_LOG, snapshot_every=8) for _ in range(64)
        ],
        "snapshot every 8 steps, phases spread": [
            await session(pb.DURABILITY_LOG, snapshot_every=8, phase=i % 8) for i in range(64)
        ],
    }
    lat: dict[str, list[float]] = {name: [] for name in groups}
    cpu = dict.fromkeys(groups, 0.0)
    for _ in range(rounds):  # interleaved, so drift in machine load hits them alike
        for name, sids in groups.items():
            before = cpu_seconds(server_pid)
            _rate, rtts = await pipelined(stub, sids, secs / 2, per_session=1, depth=1)
            cpu[name] += cpu_seconds(server_pid) - before
            lat[name].extend(rtts)
    quiet_p99 = pct(lat["no snapshot due"], 99)
    quiet_cpu = cpu["no snapshot due"] / len(lat["no snapshot due"])
    rows = [
        [name, pct(v, 50), pct(v, 99), round(pct(v, 99) / quiet_p99, 3),
         cpu[name] / len(v) * 1e3, round(cpu[name] / len(v) / quiet_cpu, 3), len(v)]
        for name, v in lat.items()
    ]  # fmt: skip
    headers = ["64 sessions, a step of each per message", "p50 ms", "p99 ms", "p99 / none",
               "server CPU ms/msg", "CPU / none"]  # fmt: skip
    print(table([*headers, "messages"], rows))
    aligned = pct(lat["snapshot every 8 steps, one phase"], 99) / quiet_p99
    spread = pct(lat["snapshot every 8 steps, phases spread"], 99) / quiet_p99
    report["snapshot_p99_rise"] = aligned
    report["snapshot_p99_rise_spread"] = spread
    report["snapshot_p99_ms"] = {name: pct(v, 99) for name, v in lat.items()}
    report["snapshot_server_cpu_ms_per_message"] = {
        name: cpu[name] / len(v) * 1e3 for name, v in lat.items()
    }


# ---------------------------------------------------------------------------- main


def engine_step_ms(model_dir: Path, reps: int, idle_s: float = 0.0) -> float:
    """p50 of one engine step of the model at batch 1, here (what a served step computes):
    back to back, or each after ``idle_s`` of sleep (a served step's engine call comes after
    the loop waited for the next message; on this host a vCPU that idled even 50 us runs
    the next tens of microseconds of work 2-3x slower)."""
    from ssmserve.server.engine.loader import load_model
    from ssmserve.server.engine.recurrent_state import BatchState

    model = load_model(model_dir)
    state = BatchState.stack([model.new_state()])
    x = np.zeros((1, model.config.input_dim), np.float32)
    times = []
    for i in range(reps + 50):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        state, _ = model.step(state, x)
        if i >= 50:  # the first calls compile or load the kernels
            times.append(time.perf_counter() - t0)
    return pct(times, 50)


async def bench(
    address: str,
    echo: str,
    redis_url: str,
    quick: bool,
    model_dir: Path,
    server_pid: int,
    only_snapshots: bool = False,
    rounds: int = 2,
    echo_pid: int = 0,
) -> dict[str, object]:
    report: dict[str, object] = {}
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.SessionServiceStub(channel)
    n = 500 if quick else 3000
    secs = 1.0 if quick else 3.0

    async def session(durability: int, snapshot_every: int = 1 << 20, phase: int = 0) -> str:
        cfg = pb.SessionConfig(durability=durability, snapshot_every=snapshot_every)
        cfg.snapshot_phase = phase
        reply = await stub.CreateSession(pb.CreateSessionRequest(model="demo", config=cfg))
        return reply.session_id

    if only_snapshots:
        await snapshot_p99(session, stub, secs, rounds, report, server_pid)
        await channel.close()
        return report

    log_sid, none_sid = await session(pb.DURABILITY_LOG), await session(pb.DURABILITY_NONE)

    async def server_cpu_us(pid: int, run: Awaitable[list[float]]) -> tuple[list[float], float]:
        """(latencies, the server's CPU per step in us) of one ping-pong run."""
        before = cpu_seconds(pid) if pid else 0.0
        samples = await run
        used = cpu_seconds(pid) - before if pid else float("nan")
        return samples, used / len(samples) * 1e6

    await ping_pong(stub, log_sid, 100)  # warm up
    lat_log, cpu_log = await server_cpu_us(server_pid, ping_pong(stub, log_sid, n))
    lat_none, cpu_none = await server_cpu_us(server_pid, ping_pong(stub, none_sid, n))
    one_step = pb.StreamRequest(steps=[step_input("x" * 16, 1, np.zeros(4, np.float32))])
    payload = one_step.SerializeToString()
    await echo_ping_pong(echo, payload, 100)
    lat_echo, cpu_echo = await server_cpu_us(echo_pid, echo_ping_pong(echo, payload, n))

    print("# served step latency (one session, one step per message, ping-pong)\n")
    rows = [
        ["ssmserve, durability log", pct(lat_log, 50), pct(lat_log, 99), len(lat_log), cpu_log],
        ["ssmserve, durability none", pct(lat_none, 50), pct(lat_none, 99), len(lat_none),
         cpu_none],
        ["bare grpc.aio echo, same bytes", pct(lat_echo, 50), pct(lat_echo, 99), len(lat_echo),
         cpu_echo],
    ]  # fmt: skip
    print(table(["what", "p50 ms", "p99 ms", "steps", "server CPU us per step"], rows))
    report["server_cpu_us_per_step"] = {"log": cpu_log, "none": cpu_none, "echo": cpu_echo}
    report["latency_ms"] = {
        "log": [pct(lat_log, 50), pct(lat_log, 99)],
        "none": [pct(lat_none, 50), pct(lat_none, 99)],
        "echo": [pct(lat_echo, 50), pct(lat_echo, 99)],
    }
    print(
        f"\nlog vs none: {np.median(lat_log) / np.median(lat_none):.2f}x; "
        f"none vs bare echo: {np.median(lat_none) / np.median(lat_echo):.2f}x (p50)\n"
    )

    rows = []
    report["throughput"] = {}
    for count in (1, 16, 64, 256):
        sids = [await session(pb.DURABILITY_LOG) for _ in range(count)]
        streams = await aggregate(stub, sids, secs)
        mux = await multiplexed(stub, sids, secs)
        many, rtts = await pipelined(stub, sids, secs, per_session=8)
        echo_rate = await echo_aggregate(echo, payload, min(count, 64), secs)
        rows.append([count, streams, mux, many, pct(rtts, 50), pct(rtts, 99), echo_rate,
                     many / echo_rate])  # fmt: skip
        report["throughput"][count] = {
            "stream_per_session": streams, "mux_1": mux, "mux_8_pipelined": many,
            "mux_8_msg_p50_ms": pct(rtts, 50), "mux_8_msg_p99_ms": pct(rtts, 99),
            "echo_msgs_per_s": echo_rate,
        }  # fmt: skip
    print("# aggregate steps/s, durability log (demo model)\n")
    print(
        table(
            [
                "sessions",
                "stream per session",
                "one stream, 1 step of each per message",
                "one stream, 8 steps of each per message, 2 in flight",
                "  message p50 ms",
                "  message p99 ms",
                "bare echo msgs/s (<= 64 streams)",
                "best / echo msgs",
            ],
            rows,
        )
    )

    await snapshot_p99(session, stub, secs, rounds, report, server_pid)

    rb = await rollbacks(stub, log_sid, 10 if quick else 40)
    print("\n# rollback latency (demo model, Rollback RPC; snapshot + replay)\n")
    print(
        table(
            ["replayed steps", "p50 ms", "p99 ms", "runs"],
            [[k, pct(v, 50), pct(v, 99), len(v)] for k, v in rb.items()],
        )
    )
    snap_times = []
    for _ in range(50 if quick else 200):
        t0 = time.perf_counter()
        await stub.Snapshot(pb.SnapshotRequest(session_id=log_sid))
        snap_times.append(time.perf_counter() - t0)
    await channel.close()

    lim = await store_limits(redis_url, 200 if quick else 1000)
    size = lim["size"][0]
    print("\n# snapshots and the store (same redis-server)\n")
    rows = [
        ["Snapshot RPC, demo model (20 KB state)", pct(snap_times, 50), pct(snap_times, 99)],
        [f"snapshot write, {size / 2**20:.2f} MiB: encode + SET + commit", pct(lim["big"], 50),
         pct(lim["big"], 99)],
        ["  of which encode (format 2: copy + xxh3_128)", pct(lim["enc"], 50),
         pct(lim["enc"], 99)],
        ["the same write, checkpoint format 1", pct(lim["big1"], 50), pct(lim["big1"], 99)],
        ["  of which encode (format 1: copy + sha256)", pct(lim["enc1"], 50),
         pct(lim["enc1"], 99)],
        [f"bare SET of the same {size / 2**20:.2f} MiB", pct(lim["setbig"], 50),
         pct(lim["setbig"], 99)],
        ["log append (Lua script, 16 B input)", pct(lim["log"], 50), pct(lim["log"], 99)],
        ["bare SET, 16 B", pct(lim["set16"], 50), pct(lim["set16"], 99)],
    ]  # fmt: skip
    print(table(["what", "p50 ms", "p99 ms"], rows))
    report["redis"] = {
        "set16_p50_ms": pct(lim["set16"], 50),
        "log_append_p50_ms": pct(lim["log"], 50),
        "setbig_p50_ms": pct(lim["setbig"], 50),
        "snapshot_big_p50_ms": pct(lim["big"], 50),
        "snapshot_big_format1_p50_ms": pct(lim["big1"], 50),
    }
    report["rollback_p50_ms"] = {k: pct(v, 50) for k, v in rb.items()}

    served, echo_p50 = pct(lat_log, 50), pct(lat_echo, 50)
    reps = 200 if quick else 2000
    engine, append = engine_step_ms(model_dir, reps), pct(lim["log"], 50)
    engine_idle = engine_step_ms(model_dir, reps, idle_s=echo_p50 / 1e3)
    parts = echo_p50 + engine + append
    print("\n# where a served step goes (one session, durability log, p50)\n")
    rows = [
        ["served step", served],
        ["  bare grpc.aio echo of the same bytes", echo_p50],
        ["  engine step, demo model, batch 1 (in this process)", engine],
        ["  log append (Lua script, 16 B input)", append],
        ["  the rest (stepper, stream, answer, event loop hops)", served - parts],
        ["issue 19 budget: echo + engine + append + 0.1 ms", parts + 0.1],
        ["engine step after an idle gap of the echo's p50 (served cadence)", engine_idle],
        ["the rest with the engine at served cadence", served - parts + engine - engine_idle],
    ]
    print(table(["what", "ms"], rows))
    print(f"\nserved / budget: {served / (parts + 0.1):.2f}\n")
    report["served_p50_parts_ms"] = {
        "served": served, "echo": echo_p50, "engine": engine, "append": append,
        "budget": parts + 0.1, "engine_after_idle": engine_idle,
    }  # fmt: skip
    return report


def main() -> int:
    parser = standard_parser(__doc__, quick="fewer samples (smoke run)", rounds=2)
    parser.add_argument(
        "--only-snapshots", action="store_true", help="only the p99-while-snapshots section"
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        private_redis(Path(tmp) / "redis") as redis_server,
    ):
        model_dir = ensure_demo_model(Path(tmp) / "demo")
        server, address = start_server(
            [sys.executable, "-m", "ssmserve.server.main", "--model", f"demo={model_dir}",
             "--listen", "127.0.0.1:0", "--redis-url", redis_server.url]
        )  # fmt: skip
        echo, echo_address = start_server([sys.executable, str(ECHO)])
        try:
            report = asyncio.run(
                bench(
                    address,
                    echo_address,
                    redis_server.url,
                    args.quick,
                    model_dir,
                    server.pid,
                    args.only_snapshots,
                    args.rounds,
                    echo.pid,
                )
            )
            if args.json:
                write_result(args.json, report, line=False)
        finally:
            for proc in (server, echo):
                proc.terminate()
                proc.wait(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
