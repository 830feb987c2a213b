"""What metrics cost a served step, side by side with metrics off, in one run.

Usage: ``.venv/bin/python bench/bench_metrics.py [--quick] [--json OUT]``

Processes: one redis-server (private), two ``ssmserve-server`` workers serving the demo
model on it: one without ``--metrics-listen`` (every counter and histogram a no-op) and
one with it, scraped once a second meanwhile (Prometheus scrapes every 15-60 s; once a
second is the pessimistic case). This process is the client (grpc.aio). Rounds alternate
the workers, so drift on this shared machine hits both alike; the ratios are the result.

Measured, as in ``bench_security``:
- step latency p50/p99: one session, one step per message, ping-pong on one stream;
- throughput: 64 sessions, one stream each, ping-pong, all at once (steps/s).
Goal (issue 16): metrics cost <= 3% of throughput.

Also, in this process, what one update costs: prometheus-client's Counter and Histogram
(a lock each, a linear bucket walk) against the lock-free loop metrics the worker uses
(``observability/loop_metrics.py``).
"""

from __future__ import annotations

import socket
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_security import Target, run_round, side_by_side
from harness import interleaved, private_redis, standard_parser, start_server, table, write_result

from ssmserve.server.main import ensure_demo_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scraper:
    """GETs /metrics once a second on its own thread; counts scrapes and their bytes."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.scrapes = 0
        self.size = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with urllib.request.urlopen(self.url, timeout=10) as reply:
                self.size = len(reply.read())
            self.scrapes += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def update_costs() -> list[list[object]]:
    """ns per update: prometheus-client vs the loop metrics, same buckets and labels."""
    import timeit

    from prometheus_client import CollectorRegistry, Counter, Histogram

    from ssmserve.server.observability.loop_metrics import LoopCounter, LoopHistogram
    from ssmserve.server.observability.metrics import LATENCY_BUCKETS

    registry = CollectorRegistry()
    theirs_h = Histogram("a", "a", registry=registry, buckets=LATENCY_BUCKETS)
    theirs_c = Counter("b", "b", ["m"], registry=registry).labels("demo")
    ours_h = LoopHistogram("a", "a", [], LATENCY_BUCKETS)
    ours_c = LoopCounter("b", "b", ["m"]).labels("demo")
    n = 200_000

    def ns(call) -> float:
        return min(timeit.repeat(call, number=n, repeat=5)) / n * 1e9

    rows = []
    for what, theirs, ours in (
        (
            "histogram observe (5 ms)",
            lambda: theirs_h.observe(0.005),
            lambda: ours_h.observe(0.005),
        ),
        ("counter inc", lambda: theirs_c.inc(), lambda: ours_c.inc()),
    ):
        a, b = ns(theirs), ns(ours)
        rows.append([what, a, b, a / b])
    return rows


def main() -> int:
    parser = standard_parser(__doc__, quick="fewer samples (smoke run)")
    args = parser.parse_args()
    rounds, steps, sessions = (2, 40, 64) if args.quick else (6, 200, 64)
    with (
        tempfile.TemporaryDirectory() as tmp_dir,
        private_redis(Path(tmp_dir) / "redis") as redis_server,
    ):
        model = ensure_demo_model(Path(tmp_dir) / "demo")
        base = [sys.executable, "-m", "ssmserve.server.main", "--model", f"demo={model}",
                "--listen", "127.0.0.1:0", "--redis-url", redis_server.url]  # fmt: skip
        metrics_at = f"127.0.0.1:{free_port()}"
        procs = []
        try:
            off_proc, off_address = start_server(base)
            procs.append(off_proc)
            on_proc, on_address = start_server([*base, "--metrics-listen", metrics_at])
            procs.append(on_proc)
            off = Target("metrics off", off_address, None, None)
            on = Target("metrics on, scraped 1/s", on_address, None, None)
            scraper = Scraper(f"http://{metrics_at}/metrics")
            scrapers = [scraper]

            def scraped_round() -> float:
                with scrapers[-1]:
                    rate = run_round(on, steps, sessions)
                scrapers.append(Scraper(scraper.url))  # a thread starts once
                return rate

            cases = {off.name: lambda: run_round(off, steps, sessions), on.name: scraped_round}
            interleaved(cases, rounds)
            with urllib.request.urlopen(f"http://{metrics_at}/metrics", timeout=10) as reply:
                exposition = reply.read()
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(20)
    print(f"# Metrics on vs off ({rounds} rounds, alternating; demo model, log durability)")
    print()
    figures = side_by_side([off, on], "off", sessions)
    print()
    print(f"/metrics after the run: {len(exposition):,} bytes")
    print()
    print(table(["one update", "prometheus-client ns", "loop metrics ns", "ratio"],
                update_costs()))  # fmt: skip
    if args.json:
        write_result(args.json, figures, line=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
