"""A big model served on one machine: load time, resident memory, decode, many sessions.

    python bench/bench_big_model.py --json bench/results/big_model.json
    python bench/bench_big_model.py --preset falcon-mamba-7b --quantize q8_0 \\
        --json bench/results/big_model_7b_q8.json

1. Writes the preset (random weights, BF16: ``ssmserve model init-demo DIR --preset``)
   into ``--model-dir`` (default ``bench/results/models/PRESET``), unless it is there.
2. Starts a real ``ssmserve-server --model lm=DIR [--quantize q8_0]`` on loopback with its
   own embedded Redis, and measures through the gRPC client (``AsyncClient``):

   - load: seconds from the process's start to the model loaded (its log line) and to
     serving (``listening on``: the kernels compiled, Redis up);
   - resident memory: the worker process's VmRSS once serving (and VmHWM, its peak while
     loading), against ``model.safetensors``'s bytes; the redis-server's apart;
   - decode at batch 1: one session fed a 4-token prompt, then ``--tokens`` tokens of one
     Generate (greedy), after 2 untimed ones: ms per token (the whole call over its
     tokens, and the median gap between tokens);
   - 16 sessions at once: 16 sessions fed their prompts, then 16 Generate calls of
     ``--tokens-16`` tokens each, all running together (the worker batches their steps):
     tokens/s over the wall time of the calls;
   - 64 sessions at once: 64 sessions created and fed their prompts, then each
     generating ``--tokens-64`` tokens, all at once; every one must get all its tokens. Resident
     memory per session (RSS growth over the 64, against what each may hold: its state
     and the 64 outputs the worker keeps to answer resent steps).

   No session passes step 64, so no periodic snapshot (a 25 MiB state at mamba-2.8b's
   shape) is written in the timed parts.
3. Stops the server, then times the engine alone on the same directory in a fresh process
   (``engine.bench.bench_model``: batch 1 and batch 16), the peer of the served figures.

Nothing here depends on the weights' values: the preset's shapes set every cost.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness import standard_parser, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ssmserve.client.aio import AsyncClient
from ssmserve.client.retry import RetryPolicy
from ssmserve.server.engine.loader import WEIGHTS_FILE, read_config

PROMPT = [11, 7, 5, 3]
ROOT = Path(__file__).resolve().parent.parent
#: A big model's step at batch 64 takes seconds: the client waits, rather than retrying.
PATIENT = RetryPolicy(stall_timeout_s=900.0, give_up_after_s=900.0, call_timeout_s=300.0)

ENGINE_PEER = """
import json, sys
from ssmserve.server.engine.bench import bench_model
from ssmserve.server.engine.loader import load_model
model = load_model(sys.argv[1], quantize=sys.argv[2])
out = {}
for batch, steps in ((1, int(sys.argv[3])), (16, int(sys.argv[4]))):
    out[str(batch)] = bench_model(model, batch, steps, warmup=2).as_dict()
print(json.dumps(out))
"""


def ensure_model(directory: Path, preset: str) -> float | None:
    """Write ``preset`` into ``directory`` unless a model is there; the seconds it took."""
    if (directory / WEIGHTS_FILE).exists():
        print(f"{directory}: already written", flush=True)
        return None
    started = time.monotonic()
    subprocess.run(
        [str(_bin("ssmserve")), "model", "init-demo", str(directory), "--preset", preset],
        check=True,
    )
    return time.monotonic() - started


def _bin(name: str) -> Path:
    """This venv's console script ``name`` (the real commands, as a user runs them)."""
    return Path(sys.executable).parent / name


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1])
    return out


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the worker's redis-server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


class Server:
    """``ssmserve-server --model lm=DIR`` with its log (INFO, stderr) read as it comes."""

    def __init__(self, model_dir: Path, data_dir: Path, quantize: str) -> None:
        cmd = [
            str(_bin("ssmserve-server")), "--model", f"lm={model_dir}",
            "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--quantize", quantize,
            "--metrics-listen", "127.0.0.1:0",
        ]  # fmt: skip
        self.command = shlex.join(cmd)
        env = {**os.environ, "SSMSERVE_LOG_LEVEL": "INFO"}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.log: list[tuple[float, str]] = []
        threading.Thread(target=self._read_log, daemon=True).start()
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.ready_s = time.monotonic() - self.started
        if "listening on" not in line:
            self.stop()
            tail = "\n".join(text for _, text in self.log[-20:])
            raise SystemExit(f"{self.command} did not start:\n{tail}")
        self.address = line.split()[-1]
        metrics = next(text for _, text in self.log if "metrics on http://" in text)
        self.metrics_url = metrics[metrics.index("http://") :].split()[0]

    def engine_batches(self) -> tuple[float, float, float]:
        """The stepper's engine calls so far: (calls, sessions they advanced, seconds),
        from the worker's metrics (``ssmserve_engine_batch_size`` / ``_seconds``)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=30).read().decode()
        values = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in (
                "ssmserve_engine_batch_size_count", "ssmserve_engine_batch_size_sum",
                "ssmserve_engine_batch_seconds_sum",
            ):  # fmt: skip
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return (
            values.get("ssmserve_engine_batch_size_count", 0.0),
            values.get("ssmserve_engine_batch_size_sum", 0.0),
            values.get("ssmserve_engine_batch_seconds_sum", 0.0),
        )

    def engine_batches_since(self, before: tuple[float, float, float]) -> dict[str, float]:
        """The engine calls since ``before``: how many, the sessions each advanced on
        average, and their seconds."""
        now = self.engine_batches()
        calls, advanced, seconds = (b - a for a, b in zip(before, now, strict=True))
        return {"calls": calls, "mean_batch": advanced / max(calls, 1), "seconds": seconds}

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append((time.monotonic() - self.started, line.rstrip()))

    def logged_at(self, text: str) -> float | None:
        return next((at for at, line in self.log if text in line), None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def feed_prompt(client: AsyncClient, sid: str) -> None:
    async for _ in client.stream_steps(sid, PROMPT, steps_per_message=len(PROMPT)):
        pass


async def generate(client: AsyncClient, sid: str, tokens: int) -> int:
    """``tokens`` tokens (greedy) after the prompt; how many came."""
    return len([t async for t in client.generate(sid, tokens, at_step=len(PROMPT))])


async def decode_batch_1(client: AsyncClient, tokens: int) -> dict[str, float]:
    sid = (await client.create_session("lm")).session_id
    await feed_prompt(client, sid)
    async for _ in client.generate(sid, 2, at_step=len(PROMPT)):  # untimed
        pass
    started = time.perf_counter()
    times = [time.perf_counter()]
    async for _ in client.generate(sid, tokens, at_step=len(PROMPT) + 2):
        times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]
    await client.close_session(sid)
    return {
        "tokens": tokens,
        "ms_per_token": (times[-1] - started) / tokens * 1e3,
        "ms_per_token_median_gap": statistics.median(gaps) * 1e3,
    }


async def at_once(
    client: AsyncClient, server: Server, sessions: int, tokens: int
) -> dict[str, Any]:
    """``sessions`` sessions created and fed their prompts (untimed, all at once), then
    all generating together (timed, with the engine calls the stepper made for it)."""
    pid = server.proc.pid
    before = memory_kib(pid)["VmRSS"]
    sids = [(await client.create_session("lm")).session_id for _ in range(sessions)]
    await asyncio.gather(*(feed_prompt(client, sid) for sid in sids))
    calls = server.engine_batches()
    started = time.perf_counter()
    counts = await asyncio.gather(*(generate(client, sid, tokens) for sid in sids))
    wall = time.perf_counter() - started
    calls = server.engine_batches_since(calls)
    after = memory_kib(pid)["VmRSS"]
    for sid in sids:
        await client.close_session(sid)
    return {
        "sessions": sessions,
        "served": sum(1 for n in counts if n == tokens),
        "tokens_each": tokens,
        "wall_s": wall,
        "tokens_per_s": sessions * tokens / wall,
        "rss_growth_per_session_bytes": (after - before) * 1024 / sessions,
        "engine_calls": calls,
    }


async def served(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    async with AsyncClient(server.address, retry=PATIENT, discover=False) as client:
        print("decode at batch 1 ...", flush=True)
        calls = server.engine_batches()
        batch_1 = await decode_batch_1(client, args.tokens)
        batch_1["engine_calls"] = server.engine_batches_since(calls)  # the prompt's too
        print(f"  {batch_1['ms_per_token']:.0f} ms a token", flush=True)
        parts = {"batch_1": batch_1}
        for n, tokens in ((16, args.tokens_16), (64, args.tokens_64)):
            print(f"{n} sessions at once ...", flush=True)
            part = parts[f"sessions_{n}"] = await at_once(client, server, n, tokens)
            print(
                f"  {part['served']}/{n} served, {part['tokens_per_s']:.2f} tokens/s; engine "
                f"calls of {part['engine_calls']['mean_batch']:.1f} sessions on average",
                flush=True,
            )
    return parts


def engine_alone(model_dir: Path, quantize: str, steps_1: int, steps_16: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_PEER, str(model_dir), quantize, str(steps_1),
         str(steps_16)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--preset", default="mamba-2.8b")
    parser.add_argument("--quantize", choices=("none", "q8_0"), default="none")
    parser.add_argument("--model-dir", type=Path, help="default bench/results/models/PRESET")
    parser.add_argument("--tokens", type=int, default=32, help="batch-1 tokens timed")
    parser.add_argument("--tokens-16", type=int, default=16, help="tokens each of 16 sessions")
    parser.add_argument("--tokens-64", type=int, default=8, help="tokens each of 64 sessions")
    parser.add_argument("--no-engine-peer", action="store_true", help="skip the engine alone")
    args = parser.parse_args()
    if max(len(PROMPT) + 2 + args.tokens, len(PROMPT) + args.tokens_16) >= 64:
        parser.error("keep every session below step 64 (its first periodic snapshot)")
    model_dir = args.model_dir or ROOT / "bench" / "results" / "models" / args.preset
    write_s = ensure_model(model_dir, args.preset)
    config = read_config(model_dir)
    stored = (model_dir / WEIGHTS_FILE).stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        print(f"starting ssmserve-server on {model_dir} (--quantize {args.quantize}) ...")
        server = Server(model_dir, Path(tmp) / "data", args.quantize)
        try:
            pid = server.proc.pid
            loaded = memory_kib(pid)
            redis_kib = sum(memory_kib(c)["VmRSS"] for c in children(pid))
            print(
                f"  serving after {server.ready_s:.1f} s; resident "
                f"{loaded['VmRSS'] / 2**20:.2f} GiB (peak {loaded['VmHWM'] / 2**20:.2f} GiB) "
                f"for {stored / 2**30:.2f} GiB stored",
                flush=True,
            )
            result = asyncio.run(served(server, args))
            after = memory_kib(pid)
        finally:
            server.stop()
    peer = None
    if not args.no_engine_peer:
        print("the engine alone (batch 1, 16) ...", flush=True)
        peer = engine_alone(model_dir, args.quantize, 8, 4)
    footprint = config.state_bytes + 64 * 4 * config.output_dim  # state + kept outputs
    out: dict[str, Any] = {
        "server_command": server.command,
        "preset": args.preset,
        "quantize": args.quantize,
        "cpus": os.cpu_count(),
        "write_s": write_s,
        "stored_bytes": stored,
        "state_bytes_per_session": config.state_bytes,
        "session_bound_bytes": footprint,
        "load": {
            "model_loaded_s": server.logged_at("model lm loaded"),
            "serving_s": server.ready_s,
        },
        "resident_bytes": loaded["VmRSS"] * 1024,
        "resident_peak_bytes": loaded["VmHWM"] * 1024,
        "resident_over_stored": loaded["VmRSS"] * 1024 / stored,
        "resident_after_bytes": after["VmRSS"] * 1024,
        "redis_resident_bytes": redis_kib * 1024,
        **result,
        "engine_alone": peer,
    }
    if peer is not None:
        out["served_over_engine"] = {
            "batch_1_ms": result["batch_1"]["ms_per_token"] / (peer["1"]["step_us_median"] / 1e3),
            "sessions_16_tokens_per_s": result["sessions_16"]["tokens_per_s"]
            / peer["16"]["steps_per_s"],
        }
    print(json.dumps(out, indent=2))
    if args.json:
        write_result(args.json, out, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
