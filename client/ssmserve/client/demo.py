"""The quick-start demo (``./dev demo``): a real worker, a real Redis, a client.

1. Starts ``ssmserve-server --demo`` (the demo signal model, a private redis-server with
   AOF in ``demo-data/``) on a free loopback port.
2. A monitor calibrates: it streams a calm signal through a scratch session to learn the
   normal range of the predictions, and finds a spike that leaves it.
3. Creates a session guarded by that range (action: rollback), streams the signal and
   prints predictions, labels a snapshot, then sends the spike: the guard rolls the
   session back to its newest snapshot before the violation.
4. The monitor rolls back explicitly to the labelled snapshot, the stream resumes, and
   the outputs are checked bit for bit against an untouched reference session.
5. Looks ahead and branches: a forecast of 8 steps (the session is not changed), and a
   fork at the labelled snapshot that streams the rest of the signal on its own; its
   outputs must equal the reference's too.
6. Prints a summary, draws the guarded session (``ssmserve plot``'s picture, with the
   guard's limit and the spike it rejected), closes every session it made (also when it
   fails part-way: repeated runs leave nothing stored) and stops the server with SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ssmserve.client import plot
from ssmserve.client.cli_errors import CliError
from ssmserve.client.errors import NotFound, SsmserveClientError, StepFailed
from ssmserve.client.sync import Client
from ssmserve.v1 import ssmserve_pb2 as pb


def synthetic_signal(steps: int, channels: int, seed: int = 0) -> np.ndarray:
    """Sum of sines per channel plus a little noise: (T, channels) float32."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)[:, None]
    freq = rng.uniform(0.01, 0.1, channels)
    phase = rng.uniform(0, 2 * np.pi, channels)
    clean = np.sin(2 * np.pi * freq * t + phase)
    return (clean + 0.05 * rng.standard_normal((steps, channels))).astype(np.float32)


#: How long the demo waits for its server's ready line: a first start on a machine compiles
#: the engine's kernels (about 20 s on 2 busy cores), a later one loads them from numba's
#: cache in a second or two.
SERVER_START_TIMEOUT_S = 300.0


def start_server(
    data_dir: Path, serve: Sequence[str] = ("--demo",)
) -> tuple[subprocess.Popen[str], str]:
    """``ssmserve-server`` with ``serve`` (what to serve: ``--demo``, or ``--model
    NAME=DIR``) on a free loopback port; returns it and its address once it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmserve.server.main", *serve, "--listen", "127.0.0.1:0",
         "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "SSMSERVE_LOG_LEVEL": os.environ.get("SSMSERVE_LOG_LEVEL", "WARNING")},
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], SERVER_START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("ssmserve-server listening on "):
        proc.kill()
        code = proc.wait()
        why = f"exit code {code}" if ready else f"no ready line in {SERVER_START_TIMEOUT_S:.0f} s"
        raise SystemExit(f"demo: the server did not start ({why})")
    return proc, line.split()[-1]


class DemoSessions:
    """The sessions the demo makes, closed at its end (also when it fails part-way):
    closing one deletes all it stored, so repeated runs leave nothing behind."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.open: list[str] = []

    def add(self, session_id: str) -> str:
        self.open.append(session_id)
        return session_id

    def close(self, session_id: str) -> None:
        self.open.remove(session_id)
        with contextlib.suppress(NotFound):  # gone already: nothing of it is stored
            self.client.close_session(session_id)

    def close_all(self) -> list[str]:
        """Close every session still open; returns what could not be closed, each with why."""
        failed = []
        for session_id in list(self.open):
            try:
                self.close(session_id)
            except SsmserveClientError as exc:
                failed.append(f"{session_id} ({exc})")
        return failed


@dataclass(frozen=True)
class Calibration:
    """What the monitor learned: the output it watches and the range it stays in on the
    calm signal (one bound), and a spike that breaks it with the output that spike gives."""

    dim: int
    lo: float | None
    hi: float | None
    spike: np.ndarray  # (i,) the input
    spike_output: np.ndarray  # (o,) the output it gives after the calm steps


def calibrate(client: Client, sessions: DemoSessions, calm: np.ndarray) -> Calibration:
    """A guard the calm signal keeps and a spike breaks.

    Streams ``calm`` through a scratch session, then tries spikes (each undone with a
    rollback) and keeps the one whose next prediction leaves the calm range the most.
    Outputs are deterministic, so a session streamed the same calm steps gives the same
    output for that spike.
    """
    probe = sessions.add(client.create_session("demo", durability=pb.DURABILITY_NONE).session_id)
    outs = np.stack([o.output for o in client.stream_steps(probe, calm, steps_per_message=32)])
    top, bottom = outs.max(axis=0), outs.min(axis=0)  # (o,)
    at = len(calm)
    best: Calibration | None = None
    margin = 0.0
    signs = np.array(list(itertools.product((-1.0, 1.0), repeat=calm.shape[1])), np.float32)
    for level in (40.0, 8.0, 3.0):
        for pattern in signs:
            spike = level * pattern
            out = client.step(probe, spike, step=at + 1).output
            client.rollback(probe, to_step=at)
            for margins, upper in ((out - top, True), (bottom - out, False)):
                dim = int(np.argmax(margins))
                if margins[dim] > margin:
                    edge = (top if upper else bottom)[dim] + (1 if upper else -1) * margins[dim] / 2
                    lo, hi = (None, float(edge)) if upper else (float(edge), None)
                    margin = float(margins[dim])
                    best = Calibration(dim, lo, hi, spike, out)
    sessions.close(probe)
    if best is None:
        raise SystemExit("demo: no spike leaves the calm range of this model")
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssmserve-demo", description=__doc__)
    parser.add_argument(
        "--data-dir", type=Path, default=Path("demo-data"), help="server data (default demo-data)"
    )
    parser.add_argument("--steps", type=int, default=96, help="steps of signal (default 96)")
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("ssmserve-demo.png"),
        help="where to draw the session (needs matplotlib; default ssmserve-demo.png)",
    )
    parser.add_argument(
        "--server",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="run against these running workers (each serving --demo) instead of starting "
        "one; e.g. deploy/compose.yaml's",
    )
    args = parser.parse_args(argv)

    if args.server:
        addresses = [a.strip() for a in args.server.split(",") if a.strip()]
        with Client(addresses) as client:
            return run_and_draw(client, addresses[0], args.steps, args.plot)
    print(
        f"starting ssmserve-server --demo (the demo signal model, an embedded Redis in "
        f"{args.data_dir}/) ...\n"
        "  its first start compiles the engine's kernels (numba; about 20 s), later ones load "
        "them from the cache"
    )
    started = time.monotonic()
    proc, address = start_server(args.data_dir)
    print(f"server ready in {time.monotonic() - started:.1f} s")
    try:
        with Client(address) as client:
            return run_and_draw(client, address, args.steps, args.plot)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        print(f"server stopped with SIGTERM (exit code {code})")


def run_and_draw(client: Client, address: str, steps: int, path: Path) -> int:
    """The walk-through and its picture; every session it made is closed at the end."""
    sessions = DemoSessions(client)
    try:
        code, drawing = run_demo(client, sessions, address, steps)
        draw_session(client, drawing, path)
        return code
    finally:
        failed = sessions.close_all()
        if failed:
            print(f"demo: could not close {'; '.join(failed)}")
        else:
            print("closed the demo's sessions: nothing of this run stays stored")


@dataclass(frozen=True)
class Drawing:
    """What the picture shows beyond the session's history: the spike it did not keep."""

    session_id: str
    rejected: plot.RejectedStep
    title: str


def run_demo(
    client: Client, sessions: DemoSessions, address: str, steps: int
) -> tuple[int, Drawing]:
    """The walk-through; its exit code (0: every output bit-exact) and what to draw."""
    calm = synthetic_signal(steps, 4)
    label_at, spike_at = 40, 53  # a labelled snapshot at 40; periodic ones every 16
    print(f"server on {address}; demo model: 4 channels in, 4 predictions out")

    cal = calibrate(client, sessions, calm[: spike_at - 1])
    dim, lo, hi, spike = cal.dim, cal.lo, cal.hi, cal.spike
    side = f"under {hi:+.3f}" if hi is not None else f"over {lo:+.3f}"
    print(f"monitor calibrated: prediction {dim} stays {side} on the calm signal")
    guard = pb.GuardRule(
        name="calm-range", check=pb.GuardRule.CHECK_RANGE, min=lo, max=hi, dims=[dim],
        action=pb.GuardRule.ACTION_ROLLBACK,
    )  # fmt: skip
    sid = sessions.add(client.create_session("demo", snapshot_every=16, guards=[guard]).session_id)
    ref = sessions.add(client.create_session("demo").session_id)  # untouched reference
    print(f"session {sid}: snapshot every 16 steps, guard {guard.name} -> rollback\n")

    latencies, outputs = [], []
    for t in range(1, spike_at):
        t0 = time.perf_counter()
        out = client.step(sid, calm[t - 1], step=t)
        latencies.append(time.perf_counter() - t0)
        outputs.append(out.output)
        if t % 8 == 0:
            snap = out.snapshot_events
            print(
                f"  step {t:3d}  prediction {_fmt(out.output)}"
                + (f"  [snapshot {snap[0].snapshot_id}]" if snap else "")
            )
        if t == label_at:
            client.snapshot(sid, label="calm")
            print(f"  step {t:3d}  labelled snapshot 'calm'")

    print(f"\nstep {spike_at}: a spike {_fmt(spike)} ...")
    try:
        client.step(sid, spike, step=spike_at)
        raise SystemExit("demo: the guard did not fire")
    except StepFailed as exc:
        event = exc.result.guard_events[0]
        print(f"  guard {event.guard} fired ({event.detail})")
        print(f"  -> the session rolled back to step {event.rolled_back_to} [{exc.reason}]")
    at = client.get_session(sid).step
    resent = np.stack([o.output for o in client.stream_steps(sid, calm[at : spike_at - 1])])
    print(f"  the client sent steps {at + 1}..{spike_at - 1} again (calm inputs)")

    reply = client.rollback(sid, to_label="calm")
    print(
        f"\nmonitor: rollback to 'calm' -> step {reply.step} "
        f"(snapshot + {reply.replayed_steps} replayed)"
    )
    rest = client.stream_steps(sid, calm[label_at:], steps_per_message=16)
    got = np.concatenate([np.stack(outputs[:label_at]), np.stack([o.output for o in rest])])
    want = np.stack([o.output for o in client.stream_steps(ref, calm, steps_per_message=16)])
    exact = np.array_equal(got.view(np.uint32), want.view(np.uint32))
    exact_resent = np.array_equal(resent.view(np.uint32), want[at : spike_at - 1].view(np.uint32))

    fc = client.forecast(sid, 8)
    print(f"\nforecast: 8 steps ahead of step {fc.from_step}, each prediction fed back as input")
    for step, out in list(zip(fc.steps, fc.outputs, strict=True))[1::2]:
        print(f"  step {step:3d}  forecast {_fmt(out)}")
    if fc.stopped is not None:
        print(f"  (stopped after {len(fc.outputs)} steps: {fc.stopped.message})")
    branch = client.fork(sid, at_label="calm")
    sessions.add(branch.session.session_id)
    forked = np.stack(
        [o.output for o in client.stream_steps(branch.session.session_id, calm[label_at:])]
    )
    exact_fork = np.array_equal(forked.view(np.uint32), want[label_at:].view(np.uint32))
    print(
        f"fork {branch.session.session_id} at 'calm' (step {branch.step}) streamed steps "
        f"{label_at + 1}..{steps} on its own"
    )
    exact = exact and exact_fork

    info = client.get_session(sid)
    lat = np.array(latencies) * 1e3
    print(
        f"\nsummary: session at step {info.step}, {info.snapshot_count} snapshots kept, "
        f"1 guard rollback, 1 monitor rollback\n"
        f"  step latency p50 {np.median(lat):.2f} ms, p99 {np.percentile(lat, 99):.2f} ms "
        f"(one step per call, each input logged in Redis before its answer)\n"
        f"  outputs (session and fork) equal an untouched reference session bit for bit: "
        f"{'yes' if exact and exact_resent else 'NO'}"
    )
    title = (
        f"ssmserve demo: guard '{guard.name}' keeps out {dim} {side} (dashed); the spike "
        f"at step {spike_at} breaks it and the guard rolls the session back,\nthen a monitor "
        f"rolls it back to the snapshot 'calm' and streams on (session {sid})"
    )
    drawing = Drawing(sid, plot.RejectedStep(spike_at, spike, cal.spike_output), title)
    return (0 if exact and exact_resent else 1), drawing


def draw_session(client: Client, drawing: Drawing, path: Path) -> None:
    """Draw the guarded session (``ssmserve plot``'s picture), if matplotlib is installed."""
    try:
        pyplot = plot.load_pyplot()
    except CliError as exc:
        print(f"(no plot: {exc})")
        return
    sid = drawing.session_id
    figure = plot.draw(
        pyplot,
        client.history(sid),
        dims=4,
        guards=client.get_session(sid).config.guards,
        rejected=[drawing.rejected],
        title=drawing.title,
    )
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    print(f"drew session {sid} to {path} (what ssmserve plot draws of a session, with the spike)")


def _fmt(vec: np.ndarray) -> str:
    return "[" + " ".join(f"{v:+.3f}" for v in vec) + "]"


if __name__ == "__main__":
    sys.exit(main())
