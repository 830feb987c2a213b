"""The sensor demo (``./dev demo``): why rollback matters, on a trained model and real data.

1. Starts ``ssmserve-server`` serving the committed trained model
   (``examples/models/cgm-mamba``: a signal Mamba-2 trained on a continuous glucose
   monitor's readings, ``examples/train_signal.py``) on its own embedded Redis.
2. Takes one held-out day of that monitor (288 readings, every 5 minutes: the sensor's
   current ``isig`` and the glucose in mg/dL) and injects two sensor faults: a **spike**
   (one reading far off) and a **stuck sensor** (the same reading repeated for 2.5 hours).
3. Streams the day into three sessions of the same model: ``clean`` (the readings as they
   were), ``plain`` (the faulty readings, nothing done) and ``guarded``, where a monitor
   watches each reading against the model's own prediction of it. When a reading breaks
   the monitor's rules (it departs from the prediction by more than ``K`` times the
   recent prediction error, or it repeats exactly ``STUCK`` times), the monitor rolls the
   session back to the step before the fault, sends the model's own forecast in place of
   the bad readings, and streams on.
4. Prints, for each fault, how long the predictions stayed wrong (off the clean session's
   by more than ``TOLERANCE`` mg/dL) with and without rollback, checks that the imputed
   steps answered the forecast's outputs bit for bit, and draws the picture
   (``docs/demo-plot.png`` in the README).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ssmserve.client.cli_errors import CliError
from ssmserve.client.demo import DemoSessions, start_server
from ssmserve.client.guards import guard_rule
from ssmserve.client.sync import Client
from ssmserve.v1 import ssmserve_pb2 as pb

MODEL = "cgm"
MINUTES_PER_READING = 5
DAY_START, DAY = 288, 288  # the held-out readings shown: one day
SPIKE_AT = 80  # a reading far off (1-based step in the day)
STUCK_FROM, STUCK_FOR = 170, 12  # the sensor repeats reading STUCK_FROM - 1 this long
SPIKE = np.array([40.0, 180.0], np.float32)  # added to the reading: nA, mg/dL
K = 8.0  # a reading this many times the recent prediction error off its prediction: bad
STUCK = 3  # a reading repeated exactly this many times in a row: the sensor is stuck
WARM = 24  # readings (2 hours) that only warm the state and the monitor's scale up
AFTER = 24  # readings after a fault in which its cost is counted
TOLERANCE = 5.0  # mg/dL: a prediction this far from the clean session's is wrong
GLUCOSE = 1  # the channel drawn and judged


def faulty_day(day: np.ndarray) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """The day with the two faults, and each fault as (name, first step, last step)."""
    out = day.copy()
    out[SPIKE_AT - 1] += SPIKE
    last_good = STUCK_FROM - 1
    out[STUCK_FROM - 1 : STUCK_FROM - 1 + STUCK_FOR] = day[last_good - 1]
    faults = [("spike", SPIKE_AT, SPIKE_AT), ("stuck", STUCK_FROM, STUCK_FROM + STUCK_FOR - 1)]
    return out, faults


def spike_guards() -> list[pb.GuardRule]:
    """The server's prediction-error rules, one per channel: a reading more than K times
    the recent one-step error (never less than the floor: about the trained model's mean
    error) off the model's prediction of it is reported with the step's answer."""
    return [
        guard_rule(
            f"spike-{name}",
            "prediction_error",
            "report",
            dims=[dim],
            tolerance=K,
            scale_floor=floor,
        )
        for dim, (name, floor) in enumerate((("isig", 0.5), ("glucose", 2.0)))
    ]


@dataclass(frozen=True)
class Run:
    """What the guarded session answered and where the monitor stepped in."""

    predictions: np.ndarray  # (T, 2): the answer to each step as it stands at the end
    imputed: np.ndarray  # (T,) bool: the step was the model's forecast, not the reading
    rollbacks: list[tuple[int, int, str]]  # (at step, to step, why)
    forecast_exact: bool  # the imputed steps answered the forecast's outputs bit for bit


def stream_guarded(client: Client, sid: str, readings: np.ndarray) -> Run:
    """Step by step, as a gateway sends them, into a session with :func:`spike_guards`.

    A monitor acts on what it sees. A step whose answer carries a guard event (after the
    first WARM readings, which only warm the state up) was a spike: the session is rolled
    back to the step before it and the model's forecast is sent in its place. A reading
    equal to the one before in every channel STUCK times in a row is a stuck sensor; the
    repeats before this one are in the state already: the session is rolled back to the
    last good reading, and the forecast goes in place of every repeat until the sensor
    moves again. The reading after an imputed one is trusted (a spike is one reading; a
    sensor that moves again is back)."""
    answers: list[np.ndarray] = []  # answers[t - 1]: the prediction made at step t
    imputed = np.zeros(len(readings), bool)
    rollbacks: list[tuple[int, int, str]] = []
    exact = True

    def impute(back_to: int, t: int, why: str) -> None:
        """Steps back_to+1 .. t get the model's forecast (the session is at back_to)."""
        nonlocal exact
        del answers[back_to:]
        forecast = np.stack(client.forecast(sid, t - back_to).outputs)  # (t - back_to, c)
        # Each forecast step's input is the output before it: the session's last answer,
        # then the forecast's own outputs. Sent as steps, they answer the same bits.
        for step, value in enumerate([answers[-1], *forecast[:-1]], start=back_to + 1):
            answers.append(client.step(sid, value, step=step).output)
            imputed[step - 1] = True
        exact &= np.array_equal(
            np.stack(answers[back_to:]).view(np.uint32), forecast.view(np.uint32)
        )
        rollbacks.append((t, back_to, why))

    repeats = 0
    for t in range(1, len(readings) + 1):
        reading = readings[t - 1]
        repeats = repeats + 1 if t > 1 and np.array_equal(reading, readings[t - 2]) else 0
        if repeats >= STUCK:
            if imputed[t - 2]:  # still stuck: the forecast stands in again
                answers.append(client.step(sid, answers[-1], step=t).output)
                imputed[t - 1] = True
            else:
                client.rollback(sid, to_step=t - STUCK)
                impute(t - STUCK, t, "stuck")
            continue
        out = client.step(sid, reading, step=t)
        if t <= WARM or not out.guard_events or (t > 1 and imputed[t - 2]):
            answers.append(out.output)
            continue
        client.rollback(sid, to_step=t - 1)  # the spike is undone, bit for bit
        impute(t - 1, t, f"guard {out.guard_events[0].guard}")
    return Run(np.stack(answers), imputed, rollbacks, exact)


def wrong_for(predictions: np.ndarray, clean: np.ndarray, first: int, last: int) -> int:
    """Predictions made from the fault's first reading to AFTER readings past its last
    that are more than TOLERANCE mg/dL off the clean session's (glucose)."""
    window = slice(first - 1, min(last + AFTER, len(clean)))
    return int((np.abs(predictions[window, GLUCOSE] - clean[window, GLUCOSE]) > TOLERANCE).sum())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssmserve-sensor-demo", description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=Path("examples/models/cgm-mamba"))
    parser.add_argument("--readings", type=Path, default=Path("examples/data/cgm-heldout.npy"))
    parser.add_argument("--data-dir", type=Path, default=Path("demo-data"))
    parser.add_argument("--plot", type=Path, default=Path("ssmserve-demo.png"))
    parser.add_argument(
        "--server", metavar="HOST:PORT", help=f"a running worker that serves {MODEL!r} instead"
    )
    args = parser.parse_args(argv)
    for path in (args.model_dir, args.readings):
        if not path.exists():
            raise SystemExit(
                f"demo: {path} is not there: run the demo from the repository's root "
                f"(./dev demo), or pass --model-dir and --readings"
            )
    readings = np.load(args.readings)[DAY_START : DAY_START + DAY].astype(np.float32)
    if args.server:
        with Client(args.server) as client:
            return run_and_draw(client, readings, args.plot)
    print(
        f"starting ssmserve-server with the trained model {args.model_dir} as {MODEL!r} "
        f"(an embedded Redis in {args.data_dir}/) ..."
    )
    started = time.monotonic()
    proc, address = start_server(args.data_dir, ["--model", f"{MODEL}={args.model_dir}"])
    print(f"server ready on {address} in {time.monotonic() - started:.1f} s")
    try:
        with Client(address) as client:
            return run_and_draw(client, readings, args.plot)
    finally:
        proc.send_signal(signal.SIGTERM)
        print(f"server stopped with SIGTERM (exit code {proc.wait(30)})")


def run_and_draw(client: Client, day: np.ndarray, picture: Path) -> int:
    sessions = DemoSessions(client)
    try:
        faulty, faults = faulty_day(day)
        print(
            f"one held-out day of a glucose monitor: {len(day)} readings, every "
            f"{MINUTES_PER_READING} min; faults injected: a spike at reading {SPIKE_AT}, the "
            f"sensor stuck for readings {STUCK_FROM}..{STUCK_FROM + STUCK_FOR - 1}"
        )
        print(
            f"three sessions of model {MODEL!r}: clean (the true readings), plain (the faulty "
            f"readings, nothing done) and guarded (the faulty readings, a prediction-error "
            f"guard and a monitor that roll back)"
        )
        made = {
            name: sessions.add(
                client.create_session(MODEL, snapshot_every=32, guards=guards).session_id
            )
            for name, guards in (("clean", []), ("plain", []), ("guarded", spike_guards()))
        }
        clean = np.stack(
            [o.output for o in client.stream_steps(made["clean"], day, steps_per_message=32)]
        )
        plain = np.stack(
            [o.output for o in client.stream_steps(made["plain"], faulty, steps_per_message=32)]
        )
        run = stream_guarded(client, made["guarded"], faulty)
        injected = {t for _, first, last in faults for t in range(first, last + 1)}
        for at, to, why in run.rollbacks:
            real = "" if at in injected else " (a jump in the real readings, not injected)"
            print(
                f"  reading {at}: {why} -> rollback to step {to}, the model's forecast in "
                f"place of readings {to + 1}..{at}{real}"
            )
        report = []
        for name, first, last in faults:
            plain_for = wrong_for(plain, clean, first, last)
            guarded_for = wrong_for(run.predictions, clean, first, last)
            report.append((name, first, last, plain_for, guarded_for))
            print(
                f"  {name} (readings {first}..{last}): predictions wrong (off by more than "
                f"{TOLERANCE:g} mg/dL) for {plain_for * MINUTES_PER_READING} min without "
                f"rollback, {guarded_for * MINUTES_PER_READING} min with rollback, in it and "
                f"the {AFTER * MINUTES_PER_READING // 60} h after"
            )
        same = np.array_equal(
            run.predictions[: SPIKE_AT - 1].view(np.uint32), clean[: SPIKE_AT - 1].view(np.uint32)
        )
        print(
            f"  before the first fault the guarded session answered the clean one's bits: "
            f"{'yes' if same else 'NO'}; imputed steps answered the forecast bit for bit: "
            f"{'yes' if run.forecast_exact else 'NO'} ({int(run.imputed.sum())} readings "
            f"imputed in all, the stuck sensor's later repeats each by the last answer)"
        )
        draw(picture, day, faulty, clean, plain, run, report)
        return 0 if same and run.forecast_exact else 1
    finally:
        failed = sessions.close_all()
        print(f"demo: could not close {'; '.join(failed)}" if failed else
              "closed the demo's sessions: nothing of this run stays stored")  # fmt: skip


def draw(
    path: Path,
    day: np.ndarray,
    faulty: np.ndarray,
    clean: np.ndarray,
    plain: np.ndarray,
    run: Run,
    report: list[tuple[str, int, int, int, int]],
) -> None:
    """Readings and predictions of glucose over the day; below, how far each session's
    predictions are from the clean session's."""
    from ssmserve.client import plot

    try:
        pyplot = plot.load_pyplot()
    except CliError as exc:
        print(f"(no picture: {exc})")
        return
    hours = np.arange(1, len(day) + 1) * MINUTES_PER_READING / 60  # step t at t * 5 min
    ahead = hours + MINUTES_PER_READING / 60  # a prediction made at t is of reading t + 1
    figure, (top, bottom) = pyplot.subplots(
        2, 1, figsize=(13, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    )
    g = GLUCOSE
    top.plot(hours, day[:, g], color="0.55", lw=2.5, label="true glucose (held-out readings)")
    top.plot(ahead, plain[:, g], color="tab:orange", lw=1.4, label="prediction, no rollback")
    top.plot(ahead, run.predictions[:, g], color="tab:blue", lw=1.4,
             label="prediction, monitor rolls back + imputes")  # fmt: skip
    bad = faulty[:, g] != day[:, g]
    top.plot(hours[bad], faulty[bad, g], "x", color="tab:red", ms=6, label="faulty sensor readings")
    for ax in (top, bottom):
        for _, first, last, *_ in report:
            ax.axvspan(hours[first - 1] - 0.04, hours[last - 1] + 0.04, color="tab:red", alpha=0.1)
    # Each fault's cost beside it, on the side with room (a spike: left of it, above the
    # calm morning; the stuck sensor: right of it).
    for (name, _, last, plain_for, guarded_for), offset in zip(
        report, ((-40, 10), (12, 30)), strict=False
    ):
        top.annotate(
            f"{name}: predictions wrong for {plain_for * MINUTES_PER_READING} min "
            f"without rollback,\n{guarded_for * MINUTES_PER_READING} min with rollback",
            (hours[last - 1], faulty[last - 1, g]), xytext=offset, textcoords="offset points",
            fontsize=9, ha="right" if offset[0] < 0 else "left",
            arrowprops={"arrowstyle": "-", "color": "0.4"},
        )  # fmt: skip
    for at, to, why in run.rollbacks:
        top.axvline(hours[to - 1], color="tab:blue", ls=":", lw=1)
        top.annotate(f"{why}:\nrollback {at} → {to}", (hours[to - 1], top.get_ylim()[1]),
                     xytext=(-4, -6), textcoords="offset points", fontsize=8, ha="right",
                     va="top", color="tab:blue")  # fmt: skip
    top.set_ylabel("glucose (mg/dL)")
    top.legend(loc="upper right", fontsize=9)
    top.set_title(
        "ssmserve demo: a glucose monitor's real readings with two injected sensor faults, "
        "streamed into a trained Mamba-2\n(one prediction of the next reading per reading). "
        "Rolling back and imputing the model's forecast keeps the predictions on track."
    )
    floor = 0.05
    for name, preds, colour in (("no rollback", plain, "tab:orange"),
                                ("rollback + impute", run.predictions, "tab:blue")):  # fmt: skip
        off = np.maximum(np.abs(preds[:, g] - clean[:, g]), floor)
        bottom.semilogy(ahead, off, color=colour, lw=1.2, label=name)
    bottom.axhline(TOLERANCE, color="0.3", ls="--", lw=1, label=f"{TOLERANCE:g} mg/dL: wrong above")
    bottom.set_ylabel("|prediction − clean\nsession's| (mg/dL)")
    bottom.set_xlabel("hours into the day")
    bottom.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    print(f"drew the day to {path}")


if __name__ == "__main__":
    sys.exit(main())
