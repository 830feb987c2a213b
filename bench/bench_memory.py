"""Memory per resident session: what the server's data structures cost, by RSS.

Usage (from the repo root)::

    .venv-bench/bin/python bench/bench_memory.py [--steps 10] [--skip-130m] [--json OUT.json]

Models (random weights, deterministic):
  demo    the demo signal model, ``DemoSpec()`` defaults (hidden 64, 2 layers, state 16,
          in/out 4), N = 256 sessions
  130m    mamba-130m-shaped token model (``harness.mamba_130m_model()``), N = 32

What is measured. Each (model, pattern) runs in a fresh subprocess so allocator state does
not carry over. The child builds the model, then N sessions exactly as
``SessionManager._resident`` does (``Session`` with its resolved default ``SessionConfig``,
``RecentSteps(history_window, output_window)`` from the default ``ManagerSettings``,
``model.new_state()``), and advances each by ``--steps``
real engine steps the way the stepper's tick does (``BatchState.stack``, ``model.step``,
``new_batch.session(row)``, the guard check, ``recent.record``, then the log commit
empties ``unflushed``); then, as the manager does for a session idle for a second, each
state that is still a view into a batch gets arrays of its own. It does this twice: the
first round takes the one-time costs (numba, BLAS pools, step workspaces, allocator
arenas) and is dropped, the heap trimmed, and the second round is measured. Patterns:

  batched  every session in one engine call per tick (concurrent streams, up to max_batch)
  alone    each session in its own engine call (batch 1: one stream at a time)

RSS comes from ``/proc/self/statm`` after ``gc.collect()`` and glibc ``malloc_trim(0)``
(free heap pages returned, so the delta is what the sessions keep alive), before and after
the sessions exist; also shown without the trim (what glibc still holds of freed step
buffers). Per session:

  state      conv + ssm ``nbytes`` (the recurrent state itself)
  history    bytes of the recent inputs and output rows held in ``RecentSteps``
  pinned     bytes of the distinct numpy buffers that the state arrays keep alive, divided
             by N, plus what the session's input and output rings have allocated (they
             grow by half up to their windows, or hold an array per row of 4 KiB or more);
             compare with state + history
  overhead   RSS/session - state - history, in bytes and as a fraction of state + history
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import standard_parser, table, write_result

from ssmserve.server.engine.mamba import MambaModel

SESSIONS = {"demo": 256, "130m": 32}
PATTERNS = ("batched", "alone")
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def build(which: str) -> MambaModel:
    if which == "130m":
        from harness import mamba_130m_model

        return mamba_130m_model()
    from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
    from ssmserve.server.engine.loader import build_model

    spec = DemoSpec()
    config = demo_config(spec)
    return build_model(config, random_tensors(config, spec.seed), name="demo")


def root(arr: np.ndarray) -> np.ndarray:
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    return arr


# ---------------------------------------------------------------------------- child


def child(which: str, pattern: str, n: int, steps: int) -> dict[str, object]:
    from ssmserve.server.engine.numerics import pin_blas_threads
    from ssmserve.server.engine.recurrent_state import BatchState
    from ssmserve.server.sessions.config import SessionConfig
    from ssmserve.server.sessions.guards import check_output
    from ssmserve.server.sessions.manager import ManagerSettings
    from ssmserve.server.sessions.session import Session
    from ssmserve.server.state.input_log import RecentSteps
    from ssmserve.server.state.lease import SessionLease

    pin_blas_threads()
    model = build(which)
    c = model.config
    settings = ManagerSettings()
    rng = np.random.default_rng(0)

    def value() -> np.ndarray:
        if c.is_token_model:
            return np.int64(rng.integers(0, c.vocab_size))  # type: ignore[return-value]
        return rng.standard_normal(c.input_dim).astype(np.float32)

    def tick(group: list[Session]) -> None:
        """One engine call for ``group``, settled as ``Stepper._tick`` / ``_settle`` do."""
        step = group[0].step + 1
        values = [value() for _ in group]
        batch = BatchState.stack([s.state for s in group])
        new_batch, outputs = model.step(batch, np.stack(values))
        for row, s in enumerate(group):
            verdict = check_output(s.config.guards, step, outputs[row])  # the ring copies it
            s.state, s.step = new_batch.session(row), step
            s.recent.record(step, s.codec.encode(values[row]), verdict.output)
        for s in group:  # log durability: the group commit empties unflushed
            s.recent.unflushed.take()

    max_batch = settings.stepper.max_batch
    config = SessionConfig().resolve(settings.defaults, c.output_dim)

    def populate() -> dict[str, Session]:
        """N sessions as ``SessionManager._resident`` makes them, each stepped ``steps`` times."""
        sessions: dict[str, Session] = {}
        for _ in range(n):
            sid = secrets.token_hex(8)
            recent = RecentSteps(max(config.history_window, 1), settings.output_window)
            sessions[sid] = Session(
                sid, model, "bench", config, model.new_state(), 0, time.time(), recent,
                SessionLease(sid, "1.1", "bench"), lambda _s: None,
            )  # fmt: skip
        everyone = list(sessions.values())
        for _ in range(steps):
            for i in range(0, n, max_batch):
                chunk = everyone[i : i + max_batch]
                for group in [chunk] if pattern == "batched" else [[s] for s in chunk]:
                    tick(group)
        for s in everyone:  # idle now: SessionManager._evict_idle gives it its own arrays
            if s.state.is_view:
                s.state = s.state.copy()
        return sessions

    # A first full round takes the one-time costs (numba, BLAS pools, workspaces, allocator
    # arenas) out of the figure; the second round, from a trimmed heap, is measured.
    populate()  # dropped at once
    trim()
    before = rss()
    t0 = time.perf_counter()
    sessions = populate()
    step_s = time.perf_counter() - t0
    gc.collect()
    untrimmed = rss()
    trim()
    after = rss()

    state_bytes = [s.state.nbytes for s in sessions.values()]
    out_row = c.output_dim * 4
    in_raw = len(next(iter(sessions.values())).codec.encode(value()))
    history_bytes = [
        len(s.recent.inputs) * in_raw
        + len(s.recent.outputs) * out_row
        + len(s.recent.unflushed) * in_raw
        for s in sessions.values()
    ]
    state_buffers: dict[int, int] = {}
    for s in sessions.values():
        for layer in s.state.layers:
            for a in (layer.conv, layer.ssm):
                state_buffers[id(root(a))] = root(a).nbytes
    pinned_state = sum(state_buffers.values()) / n
    rings = sum(s.recent.nbytes for s in sessions.values()) / n  # allocated so far
    full_inputs = config.history_window * in_raw
    return {
        "n": n,
        "steps": steps,
        "state_bytes": float(np.mean(state_bytes)),
        "history_bytes": float(np.mean(history_bytes)),
        "pinned_bytes": pinned_state + rings,
        "rss_bytes": (after - before) / n,
        "rss_untrimmed_bytes": (untrimmed - before) / n,
        "full_ring_history_bytes": settings.output_window * out_row + full_inputs,
        "full_ring_pinned_bytes": pinned_state + settings.output_window * out_row + full_inputs,
        "step_seconds": step_s,
    }


# ---------------------------------------------------------------------------- parent


def run_child(which: str, pattern: str, n: int, steps: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", which, pattern, str(n), str(steps)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--steps", type=int, default=10, help="engine steps per session")
    parser.add_argument("--skip-130m", action="store_true", help="only the demo model")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "PATTERN", "N", "STEPS"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()

    if args.child:
        which, pattern, n, steps = args.child
        print(json.dumps(child(which, pattern, int(n), int(steps))))
        return 0

    print(f"# memory per resident session ({args.steps} engine steps each, RSS after trim)")
    models = [m for m in SESSIONS if not (args.skip_130m and m == "130m")]
    rows = []
    report: dict[str, object] = {}
    kib = 1024.0
    for which in models:
        for pattern in PATTERNS:
            r = run_child(which, pattern, SESSIONS[which], args.steps)
            held = r["state_bytes"] + r["history_bytes"]
            overhead = r["rss_bytes"] - held
            rows.append(
                [
                    which,
                    pattern,
                    int(r["n"]),
                    r["state_bytes"] / kib,
                    r["history_bytes"] / kib,
                    r["pinned_bytes"] / kib,
                    r["rss_bytes"] / kib,
                    r["rss_untrimmed_bytes"] / kib,
                    overhead / kib,
                    overhead / held,
                ]
            )
            key = f"{which}_{pattern}"
            report.update(
                {
                    f"{key}_sessions": r["n"],
                    f"{key}_state_bytes": r["state_bytes"],
                    f"{key}_history_bytes": r["history_bytes"],
                    f"{key}_pinned_bytes": r["pinned_bytes"],
                    f"{key}_rss_per_session_bytes": r["rss_bytes"],
                    f"{key}_rss_untrimmed_per_session_bytes": r["rss_untrimmed_bytes"],
                    f"{key}_overhead_bytes": overhead,
                    f"{key}_overhead_ratio": overhead / held,
                }
            )
            report[f"{which}_full_ring_history_bytes"] = r["full_ring_history_bytes"]
            report[f"{key}_full_ring_pinned_bytes"] = r["full_ring_pinned_bytes"]
    print(
        table(
            [
                "model",
                "pattern",
                "N",
                "state KiB",
                "history KiB",
                "pinned KiB",
                "RSS/sess KiB",
                "untrimmed KiB",
                "overhead KiB",
                "overhead / (state+hist)",
            ],
            rows,
        )
    )
    print("once the rings are full (64 outputs, 256 inputs; computed from the above):")
    for which in models:
        full = float(report[f"{which}_full_ring_history_bytes"])  # type: ignore[arg-type]
        pinned = [
            f"{pattern} {float(report[f'{which}_{pattern}_full_ring_pinned_bytes']) / kib:,.0f}"  # type: ignore[arg-type]
            for pattern in PATTERNS
        ]
        print(
            f"  {which}: history {full / kib:,.1f} KiB/session; array buffers pinned per "
            f"session (state + outputs) KiB: {', '.join(pinned)}"
        )
    notes = (
        f"{args.steps} engine steps per session, default SessionConfig/ManagerSettings "
        f"(history_window 256 inputs, output_window 64 outputs, log durability); RSS from "
        f"/proc/self/statm after gc + malloc_trim, one subprocess per row; pinned = distinct "
        f"numpy buffers reachable from state and output rows / N; overhead = RSS/session - "
        f"state - history; bytes"
    )
    report["steps"] = args.steps
    report["notes"] = notes
    if args.json:
        write_result(args.json, report, line=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
