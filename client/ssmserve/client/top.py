"""``ssmserve top``: a live table of the cluster's workers and their busiest sessions.

Each refresh asks ListWorkers (every worker's registry entry, with the stats of its last
heartbeat, a few seconds old) and ListSessions, and compares with the refresh before:
steps/s are differences of counters over the time between them. Workers show their
state, sessions, steps/s, step latency p50/p99 over their recent answers, snapshots, open
streams and memory against their budget; sessions (the busiest ``--sessions`` of them)
show their step, steps/s, snapshots and who holds their lease.

Interactive on a terminal: the screen refreshes every ``--interval`` seconds; q or Ctrl-C
quits. ``--once`` prints one table (two looks, ``--interval`` apart, for the rates) and
``--json`` the same as JSON, for scripts; both are what a pipe gets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ssmserve.client.sync import Client
from ssmserve.v1 import ssmserve_pb2 as pb


@dataclass(frozen=True)
class Look:
    """The cluster as seen by one refresh."""

    at: float  # monotonic seconds
    workers: list[pb.WorkerInfo]
    sessions: list[pb.SessionInfo]


def look(client: Client) -> Look:
    return Look(time.monotonic(), client.list_workers(), client.list_sessions())


def _rate(now: int, before: int | None, seconds: float) -> float:
    if before is None or seconds <= 0 or now < before:  # a restarted worker starts at 0
        return 0.0
    return (now - before) / seconds


def summary(prev: Look | None, cur: Look, max_sessions: int) -> dict[str, Any]:
    """What the table shows, as plain data (also the --json output)."""
    seconds = cur.at - prev.at if prev else 0.0
    steps_before = {w.worker_id: w.stats.steps for w in prev.workers} if prev else {}
    workers = [
        {
            "worker_id": w.worker_id,
            "address": w.address,
            "state": "draining" if w.draining else "serving",
            "sessions": w.load,
            "steps_per_s": _rate(w.stats.steps, steps_before.get(w.worker_id), seconds),
            "step_p50_ms": w.stats.step_p50_ms,
            "step_p99_ms": w.stats.step_p99_ms,
            "snapshots": w.stats.snapshots,
            "open_streams": w.stats.open_streams,
            "memory_held_bytes": w.stats.memory_held_bytes,
            "memory_budget_bytes": w.stats.memory_budget_bytes,
        }
        for w in sorted(cur.workers, key=lambda w: w.address)
    ]
    step_before = {s.session_id: s.step for s in prev.sessions} if prev else {}
    sessions = [
        {
            "session_id": s.session_id,
            "model": s.model,
            "step": s.step,
            "steps_per_s": _rate(s.step, step_before.get(s.session_id), seconds),
            "snapshots": s.snapshot_count,
            "lease": _lease(s),
        }
        for s in cur.sessions
    ]
    sessions.sort(key=lambda s: (-s["steps_per_s"], -s["step"], s["session_id"]))
    return {
        "workers": workers,
        "sessions": sessions[:max_sessions],
        "sessions_total": len(cur.sessions),
        "interval_s": seconds,
    }


def _lease(s: pb.SessionInfo) -> str:
    if s.closed:
        return "closed"
    if s.resident and s.owner:
        return f"held by {s.owner}"
    return "released (restorable)"


WORKER_COLUMNS = ["WORKER", "STATE", "SESSIONS", "STEPS/S", "P50 MS", "P99 MS", "SNAPSHOTS",
                  "STREAMS", "MEMORY"]  # fmt: skip
SESSION_COLUMNS = ["SESSION", "MODEL", "STEP", "STEPS/S", "SNAPSHOTS", "LEASE"]


def render(data: dict[str, Any]) -> str:
    """The table, as text."""
    title = (
        f"ssmserve top - {len(data['workers'])} workers, {data['sessions_total']} sessions "
        f"(rates over {data['interval_s']:.1f} s; q or Ctrl-C quits)"
    )
    workers = _table(WORKER_COLUMNS, [_worker_row(w) for w in data["workers"]])
    sessions = _table(SESSION_COLUMNS, [_session_row(s) for s in data["sessions"]])
    return f"{title}\n\n{workers}\n\n{sessions}"


def _worker_row(w: dict[str, Any]) -> list[Any]:
    held, budget = w["memory_held_bytes"], w["memory_budget_bytes"]
    memory = f"{held / 2**20:.0f} MiB ({100 * held / budget:.0f}%)" if budget else "-"
    return [
        w["address"], w["state"], w["sessions"], f"{w['steps_per_s']:.0f}",
        f"{w['step_p50_ms']:.2f}", f"{w['step_p99_ms']:.2f}", w["snapshots"],
        w["open_streams"], memory,
    ]  # fmt: skip


def _session_row(s: dict[str, Any]) -> list[Any]:
    return [
        s["session_id"], s["model"], s["step"], f"{s['steps_per_s']:.0f}", s["snapshots"],
        s["lease"],
    ]  # fmt: skip


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def run(client: Client, args: argparse.Namespace) -> None:
    interval = max(0.1, args.interval)
    if args.once or args.json or not sys.stdout.isatty() or not sys.stdin.isatty():
        first = look(client)
        time.sleep(interval)
        data = summary(first, look(client), args.sessions)
        print(json.dumps(data, indent=2) if args.json else render(data))
        return
    prev: Look | None = None
    with contextlib.suppress(KeyboardInterrupt), _keys() as pressed:
        while True:
            cur = look(client)
            screen = render(summary(prev, cur, args.sessions))
            sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
            sys.stdout.flush()
            prev = cur
            if pressed(interval) in ("q", "Q"):
                return


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """Read single key presses from the terminal (no Enter), restoring it afterwards.
    Yields ``pressed(timeout)``: the key pressed within ``timeout`` seconds, or ''."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def pressed(timeout: float) -> str:
        ready, _, _ = select.select([sys.stdin], [], [], timeout)
        return sys.stdin.read(1) if ready else ""

    try:
        yield pressed
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
