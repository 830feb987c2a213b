"""How far one Stream step and one Migrate travel through ssmserve's modules.

Usage: ``.venv/bin/python bench/trace_path.py [--quick] [--repeats N] [--json [OUT]]
[--baseline-tree PATH] [--show-path]``

What runs (all in this process, on real sockets): one private redis-server
(``EmbeddedRedis``), two workers (``ssmserve.server.worker.Worker``, the demo model), each
on its own asyncio loop in its own thread as in production (``worker-a``, ``worker-b``),
and the asyncio client (``ssmserve.client.aio.AsyncClient``) on this process's main thread.
A session is created on worker A and streamed ping-pong (one step per message, the client's
``stream_steps``); after warm-up (the first calls' imports, kernel compilation or cache
load, every channel connected, migrations both ways), the tracer records:

* **stream_step**: one step of that open stream: one input handed to the client, one
  message sent, one answer received (the stream stays open before and after);
* **migrate**: one ``Migrate`` of the session (no stream open on it) from worker A to
  worker B, from the client's call to its reply.

How it records: ``threading.setprofile`` puts one profile function on every thread the
workers start (their loop threads, the engine lanes' threads, ``asyncio.to_thread``
helpers, the engine pool), and ``sys.setprofile`` on the main thread; it records only
while a trace is on. A trace starts ``--settle-ms`` (default 50) after the work before it
ended (so that work's tail, e.g. the metrics of an answer already sent, is over), just
before the client is given the work, and ends ``--settle-ms`` after the client has the
answer, so server work that follows the answer (settling, bookkeeping) is counted too.

**The definition** (stable, so that runs of two checkouts compare):

* An *event* is a ``call`` or ``return`` profile event of Python code (``c_call`` and
  ``c_return`` are ignored: C functions belong to no ssmserve module). A coroutine or
  generator resumed is a ``call``, one suspended is a ``return``.
* An event's *module* is ``__name__`` of the frame's globals (so the methods dataclasses
  generate count as the module defining the class). Only events whose module is
  ``ssmserve.*`` are kept; everything else (stdlib, asyncio, grpc, redis, numpy, numba,
  this script) is skipped, as if it were not there.
* The kept events of each thread form one sequence, in order. A *crossing* is a pair of
  consecutive events of one sequence whose modules differ. A call from module A into
  module B that returns to A is two crossings (A -> B on the call, B -> A on the next
  event in A); A calling B, then C (A having no event between) is two (A -> B, B -> C).
  A thread's first kept event is no crossing, and neither is control passing from one
  thread to another (each thread's sequence is counted on its own). On one thread, the
  asyncio loop's switch from one task to another is a crossing when the event before
  and the event after it are in different modules, like any other pair.
* *Server side*: every thread other than the main thread (the two workers' loop threads
  and any thread they started); *client side*: the main thread. A side's crossings are
  the sum over its threads; its *modules* are the distinct modules of its kept events.
  With the demo model the server's events are all on the two loop threads (its engine
  steps are below the lane's offload threshold and run inline); ``crossings_per_thread``
  says where they were.

The headline (``crossings``, ``modules`` of each trace) is the server side: the client
side is given beside it (``client``). Each trace is taken ``--repeats`` times (default 5;
1 with ``--quick``) and the headline is the run with the fewest server-side crossings:
the workers' background work (lease renewals, heartbeats, metrics) lands in a trace now
and then and only ever adds; every run's count is kept (``runs``; between components,
``component_runs``).

``--json`` makes the last line of the output one JSON object, ``{"stream_step":
{"crossings": N, "modules": M, ...}, "migrate": {...}, ...}``; ``--json OUT`` also writes
it to OUT. ``--baseline-tree PATH`` runs the same trace against another checkout (its
server and client code, ``PYTHONPATH=PATH/server:PATH/client``, in a subprocess) and
shows the two side by side (``baseline`` in the JSON). ``--show-path`` prints each
server thread's sequence of modules, each stay in a module once. Besides the headline,
each side has ``module_list``, ``events`` and ``events_per_module``, and
``entries_per_module`` (the crossings into each module); each trace has ``path`` (per
server thread, the stays as [module, events]).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import table

T = TypeVar("T")

#: The goals for the server side: a step within 35 crossings over at most 12
#: modules, a Migrate within 45 crossings.
GOALS = {"stream_step": {"crossings": 35, "modules": 12}, "migrate": {"crossings": 45}}
WARM_STEPS = 20  # steps streamed before the traced ones (compiles, connections, caches)
WARM_MIGRATIONS = 2  # round trips A -> B -> A before the traced migrations
CALL_TIMEOUT_S = 60.0  # every wait on a worker's loop or the client is bounded by this
BASELINE_TIMEOUT_S = 600.0  # the baseline's whole run (a worker start takes seconds)

# ---------------------------------------------------------------------------- the profiler

_recording = False
_events: dict[int, list[str]] = {}


def _profile(frame: FrameType, event: str, arg: object) -> None:
    """The profile function of every traced thread: keeps the module of each ``call`` and
    ``return`` of ssmserve code while a trace is on."""
    if _recording and (event == "call" or event == "return"):
        module = frame.f_globals.get("__name__")
        if module is not None and module.startswith("ssmserve."):
            ident = threading.get_ident()
            sequence = _events.get(ident)
            if sequence is None:
                sequence = _events[ident] = []
            sequence.append(module)


@dataclass
class Side:
    """One side's kept events: its crossings, modules, and where they were."""

    crossings: int = 0
    events: int = 0
    events_per_module: collections.Counter[str] = field(default_factory=collections.Counter)
    entries_per_module: collections.Counter[str] = field(default_factory=collections.Counter)
    crossings_per_thread: dict[str, int] = field(default_factory=dict)
    paths: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: The same count between components (``component_of``: api, sessions, state, engine,
    #: cluster, observability; the server's top modules one more), and the components seen.
    component_crossings: int = 0
    components: set[str] = field(default_factory=set)

    def add(self, thread: str, sequence: list[str]) -> None:
        """One thread's kept events, in order."""
        stays: list[tuple[str, int]] = []  # (module, its consecutive events)
        for module in sequence:
            if stays and stays[-1][0] == module:
                stays[-1] = (module, stays[-1][1] + 1)
            else:
                stays.append((module, 1))
        crossings = max(len(stays) - 1, 0)
        self.crossings += crossings
        self.events += len(sequence)
        self.events_per_module.update(sequence)
        self.entries_per_module.update(module for module, _ in stays[1:])
        self.crossings_per_thread[thread] = self.crossings_per_thread.get(thread, 0) + crossings
        self.paths.setdefault(thread, []).extend(stays)
        parts = [component_of(module) for module, _ in stays]
        self.components.update(parts)
        self.component_crossings += sum(1 for a, b in itertools.pairwise(parts) if a != b)

    def summary(self) -> dict[str, Any]:
        """The side's figures; ``entries_per_module``: the crossings into each module."""
        return {
            "crossings": self.crossings,
            "modules": len(self.events_per_module),
            "module_list": sorted(self.events_per_module),
            "events": self.events,
            "events_per_module": dict(sorted(self.events_per_module.items())),
            "entries_per_module": dict(sorted(self.entries_per_module.items())),
            "crossings_per_thread": self.crossings_per_thread,
            "component_crossings": self.component_crossings,
            "components": sorted(self.components),
        }


def component_of(module: str) -> str:
    """The component a module belongs to: its package under ``ssmserve.server`` (api,
    sessions, state, engine, cluster, observability), ``server`` for the server's top
    modules (worker, errors, cli), ``client`` for the client's."""
    parts = module.split(".")
    if parts[1] != "server":
        return parts[1]
    return parts[2] if len(parts) > 3 else "server"


def thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return f"thread-{ident}"


def collect() -> tuple[Side, Side]:
    """(server side, client side) of the events recorded since the last trace."""
    server, client = Side(), Side()
    main = threading.main_thread().ident
    for ident, sequence in _events.items():
        (client if ident == main else server).add(thread_name(ident), sequence)
    return server, client


async def traced(work: Callable[[], Awaitable[T]], settle_s: float) -> tuple[T, Side, Side]:
    """``work()`` on the main thread's loop with every thread recording, from ``settle_s``
    after the work before it until ``settle_s`` after it; the result and the (server,
    client) sides."""
    global _recording
    await asyncio.sleep(settle_s)  # the tail of earlier work (answer sent, metrics) is over
    _events.clear()
    sys.setprofile(_profile)
    _recording = True
    try:
        result = await work()
        await asyncio.sleep(settle_s)
    finally:
        _recording = False
        sys.setprofile(None)
    server, client = collect()
    _events.clear()
    return result, server, client


# ---------------------------------------------------------------------------- the workers


class LoopWorker:
    """A worker on its own asyncio loop in its own thread, as in production."""

    def __init__(self, name: str, settings: Any) -> None:
        from ssmserve.server.worker import Worker

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self.worker = Worker(settings)
        self.address: str = self.call(self.worker.start())

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        try:
            self.call(self.worker.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(CALL_TIMEOUT_S)
            self.loop.close()


class Inputs:
    """The stream's inputs, handed over one at a time."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (value := await self.queue.get()) is not None:
            yield value


async def trace_session(
    a: LoopWorker, b: LoopWorker, repeats: int, settle_s: float
) -> dict[str, list[tuple[Side, Side]]]:
    from ssmserve.client.aio import AsyncClient

    runs: dict[str, list[tuple[Side, Side]]] = {"stream_step": [], "migrate": []}
    client = AsyncClient([a.address, b.address])
    try:
        info = await asyncio.wait_for(client.create_session("demo"), CALL_TIMEOUT_S)
        value = [0.25] * info.input_dim
        inputs = Inputs()
        outputs = client.stream_steps(info.session_id, inputs)

        async def one_step() -> Any:
            inputs.queue.put_nowait(value)
            return await asyncio.wait_for(anext(outputs), CALL_TIMEOUT_S)

        for _ in range(WARM_STEPS):
            await one_step()
        for _ in range(repeats):
            _, server, client_side = await traced(one_step, settle_s)
            runs["stream_step"].append((server, client_side))
        inputs.queue.put_nowait(None)
        async for out in outputs:
            raise SystemExit(f"an answer after the inputs ended (step {out.step})")

        async def migrate(target: LoopWorker) -> None:
            reply = await asyncio.wait_for(
                client.migrate(info.session_id, target.address), CALL_TIMEOUT_S
            )
            if reply.target != target.address:
                raise SystemExit(f"Migrate to {target.address} went to {reply.target!r}")

        for _ in range(WARM_MIGRATIONS):
            await migrate(b)
            await migrate(a)
        for _ in range(repeats):
            _, server, client_side = await traced(lambda: migrate(b), settle_s)
            runs["migrate"].append((server, client_side))
            await migrate(a)
    finally:
        await client.close()
    return runs


def measure(repeats: int, settle_s: float) -> dict[str, Any]:
    """Both traces on the ssmserve code this interpreter imports: the JSON object."""
    import ssmserve.server
    from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
    from ssmserve.server.main import ensure_demo_model
    from ssmserve.server.worker import WorkerSettings

    threading.setprofile(_profile)  # every thread started from here on records
    with tempfile.TemporaryDirectory(prefix="trace-path-") as tmp:
        root = Path(tmp)
        model = ensure_demo_model(root / "demo")
        with EmbeddedRedis(EmbeddedRedisSettings(data_dir=root / "redis")) as redis:
            workers: list[LoopWorker] = []
            try:
                for name in ("worker-a", "worker-b"):
                    settings = WorkerSettings(
                        models=(("demo", model),),
                        listen="127.0.0.1:0",
                        redis_url=redis.url,
                        data_dir=root / name,
                        shutdown_grace_s=1.0,
                    )
                    workers.append(LoopWorker(name, settings))
                runs = asyncio.run(trace_session(workers[0], workers[1], repeats, settle_s))
            finally:
                for worker in workers:
                    worker.stop()
                threading.setprofile(None)  # type: ignore[arg-type]

    code = Path(ssmserve.server.__file__).resolve().parents[3]  # .../server/ssmserve/server
    result: dict[str, Any] = {}
    for trace, sides in runs.items():
        server, client = min(sides, key=lambda pair: pair[0].crossings)
        result[trace] = {
            **server.summary(),
            "runs": [s.crossings for s, _ in sides],
            "component_runs": [s.component_crossings for s, _ in sides],
            "client": client.summary(),
            "path": server.paths,
        }
    result["code"] = str(code)
    result["commit"] = commit_of(code)
    result["settle_ms"] = settle_s * 1e3
    return result


# ---------------------------------------------------------------------------- the report


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a Python that imports ``tree``'s server and client code;
    refuses a tree that does not look like a checkout of this repository."""
    server, client = tree / "server", tree / "client"
    if not (server / "ssmserve" / "server" / "worker.py").is_file() or not client.is_dir():
        raise SystemExit(
            f"--baseline-tree {tree}: no server/ssmserve/server/worker.py or client/ there "
            "(want a checkout of this repository, e.g. a git worktree)"
        )
    return {**os.environ, "PYTHONPATH": f"{server.resolve()}:{client.resolve()}"}


def run_baseline(tree: Path, repeats: int, settle_s: float) -> dict[str, Any]:
    """The same traces of ``tree``'s code, in a subprocess: its JSON object."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json"]
    cmd += ["--repeats", str(repeats), "--settle-ms", str(settle_s * 1e3)]
    try:
        proc = subprocess.run(
            cmd, env=tree_env(tree), stdout=subprocess.PIPE, text=True, timeout=BASELINE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the trace of {tree} took over {BASELINE_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"the trace of {tree} failed (exit {proc.returncode}; its errors above)")
    baseline: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return baseline


def commit_of(tree: Path) -> str:
    """``tree``'s commit (short), with ``+changes`` when its files differ from it."""

    def git(*args: str) -> str:
        proc = subprocess.run(
            ["git", "-C", str(tree), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            timeout=30,
        )
        return proc.stdout.strip() if proc.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "server", "client")
    return f"{commit}+changes" if changed else commit


def module_lines(modules: list[str]) -> str:
    names = " ".join(m.removeprefix("ssmserve.") for m in modules)
    return textwrap.fill(names, 100, initial_indent="  ", subsequent_indent="  ")


def report(result: dict[str, Any], show_path: bool) -> str:
    """The figures as a table (both codes side by side with a baseline), then the modules."""
    codes = {f"this checkout ({result['commit']})": result}
    if "baseline" in result:
        codes[f"baseline ({result['baseline']['commit']})"] = result["baseline"]
    rows: list[list[object]] = []
    for trace, goal in GOALS.items():
        limits = " / ".join(f"<= {v}" for v in goal.values())
        for side in ("server", "client"):
            cells = []
            for data in codes.values():
                d = data[trace] if side == "server" else data[trace]["client"]
                between = (
                    f"{d['component_crossings']} / {len(d['components'])}"
                    if ("components" in d)
                    else "-"
                )
                cells.append(f"{d['crossings']} / {d['modules']} (components: {between})")
            rows.append([trace, side, *cells, limits if side == "server" else ""])
    headers = ["trace", "side", *(f"{k}: crossings / modules" for k in codes), "goal"]
    lines = [table(headers, rows), ""]
    for label, data in codes.items():
        lines.append(f"# {label}: {data['code']}")
        for trace in GOALS:
            d = data[trace]
            lines.append(f"{trace}, server side (runs {d['runs']}, the fewest shown):")
            lines.append(module_lines(d["module_list"]))
            lines.append(f"{trace}, client side:")
            lines.append(module_lines(d["client"]["module_list"]))
            if show_path:
                for thread, stays in d["path"].items():
                    lines.append(f"  [{thread}] " + " ".join(m for m, _ in stays))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of each trace")
    parser.add_argument("--repeats", type=int, help="runs of each trace (default 5)")
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=50.0,
        help="quiet time before a trace and its length after the answer",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="OUT",
        help="the last line of output is the result as one JSON object "
        "(and OUT, if given, holds it)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="PATH",
        help="another checkout to trace the same way, side by side",
    )
    parser.add_argument(
        "--show-path", action="store_true", help="print each server thread's sequence of modules"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.settle_ms < 0:
        parser.error("--settle-ms must be at least 0")
    settle_s = args.settle_ms / 1e3
    if args.baseline_tree:
        tree_env(args.baseline_tree)  # a bad tree is refused before anything runs

    baseline = run_baseline(args.baseline_tree, repeats, settle_s) if args.baseline_tree else None
    result = measure(repeats, settle_s)
    if baseline is not None:
        result["baseline"] = baseline
    print(report(result, args.show_path))
    if args.json:
        line = json.dumps(result)
        if args.json != "-":
            Path(args.json).write_text(line + "\n")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
