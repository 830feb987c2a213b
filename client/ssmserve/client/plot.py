"""``ssmserve plot SID --output out.png``: a picture of what a session did.

Everything drawn comes from the server (``GetHistory``, and the session's guard rules
from ``GetSession``): the inputs from the session's log, the outputs as they were
answered (replayed bit-exact), its snapshots and its recorded events. Three panels share
the step axis:

- inputs: one line per input dimension (token models: the token ids, as dots);
- outputs: one line per output dimension (token models: the top logit of each step),
  with each range guard's limit as a dashed line in the colour of the output it watches
  (the side it forbids shaded), and each guard event as a marker at the step it judged;
- rollbacks: one arrow per rollback, on a row of its own, from the step the session was
  at back to the step it returned to, labelled with who rolled it back (the guard or a
  monitor's Rollback call) and where to (a snapshot's label when it has one).

Snapshots are dotted grey lines (labels named); legends sit outside the panels, on the
right, so they cover no data. A caller that knows a step the session did not keep (a
spike a guard rolled back: it is in no log) passes it as a :class:`RejectedStep`, and it
is drawn where it was tried: its input (at the panel's edge, with its values, when off
the scale) and the output the guard refused.

Needs matplotlib (``pip install matplotlib``; the client's ``plot`` extra brings it:
``pip install './client[plot]'`` from a clone). The flags are ``cli_parsers``'.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ssmserve.client.cli_errors import CliError
from ssmserve.client.output_files import check_output, write_output
from ssmserve.client.step_values import SessionHistory
from ssmserve.client.sync import Client
from ssmserve.v1 import ssmserve_pb2 as pb

ACTION_COLOURS = {"report": "tab:blue", "clamp": "tab:orange", "impute": "tab:green",
                  "reject": "tab:purple", "rollback": "tab:red"}  # fmt: skip


def run(client: Client, args: argparse.Namespace) -> None:
    check_output(args.output)
    pyplot = load_pyplot()
    kind = args.output.suffix.lstrip(".").lower() or "png"
    formats = pyplot.figure().canvas.get_supported_filetypes()
    pyplot.close("all")
    if kind not in formats:
        raise CliError(
            f"--output {args.output}: matplotlib cannot write .{kind} files; name a "
            f"{', '.join(f'.{k}' for k in sorted(formats))} file"
        )
    history = client.history(args.session_id, args.from_step, args.to_step)
    guards = client.get_session(args.session_id).config.guards
    figure = draw(pyplot, history, max(1, args.dims), guards=guards)
    try:
        write_output(args.output, lambda f: figure.savefig(f, format=kind, dpi=100))
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    finally:
        pyplot.close(figure)
    last = history.first_step + len(history.outputs) - 1
    print(
        f"wrote {args.output}: steps {history.first_step}..{last}, "
        f"{len(history.snapshots)} snapshots, {len(history.events)} events"
    )


def load_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise CliError(
            "ssmserve plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or, from a clone, the client's plot extra: pip install './client[plot]')"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as pyplot

    return pyplot


@dataclass(frozen=True)
class RejectedStep:
    """A step tried but not kept (a guard rolled it back or rejected it: no log has it),
    as the caller knows it: the input it sent and the output the guard judged."""

    step: int
    inputs: np.ndarray  # (i,) float32
    outputs: np.ndarray  # (o,) float32


GUARD_COLOUR = "tab:red"  # a guard's limit, the side it forbids, its events and rollbacks
MONITOR_COLOUR = "tab:blue"  # a rollback a client asked for (the Rollback RPC)
_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
            "fontsize": "small"}  # fmt: skip


def draw(
    pyplot: Any,
    h: SessionHistory,
    dims: int,
    guards: Sequence[pb.GuardRule] = (),
    rejected: Sequence[RejectedStep] = (),
    title: str = "",
) -> Any:
    """The figure (not saved): inputs, outputs with the guards' limits, and rollbacks.

    ``guards``: the session's rules (``SessionInfo.config.guards``); ``rejected``: steps
    tried but not kept, drawn where they were tried; ``title``: above the panels
    (default: the session, its steps, snapshots and events)."""
    figure, (top, bottom, lane) = pyplot.subplots(
        3, 1, figsize=(12, 7.5), sharex=True, height_ratios=(3, 3, 1.4), layout="constrained"
    )
    steps = h.steps
    shown = 0  # output dims drawn as lines (their colours are C0, C1, ...)
    if h.token_input:
        top.plot(steps, h.inputs, ".", markersize=3, color="tab:gray", label="input token")
        top.set_ylabel("input token id")
        bottom.plot(steps, h.outputs.max(axis=1) if len(h.outputs) else [], lw=1,
                    label="top logit")  # fmt: skip
        bottom.set_ylabel("top logit")
    else:
        for d in range(min(dims, h.inputs.shape[1])):
            top.plot(steps, h.inputs[:, d], lw=1, label=f"in {d}", color=f"C{d}")
        shown = min(dims, h.outputs.shape[1])
        for d in range(shown):
            bottom.plot(steps, h.outputs[:, d], lw=1, label=f"out {d}", color=f"C{d}")
        top.set_ylabel("inputs")
        bottom.set_ylabel("outputs (as answered)")
    for axis in (top, bottom, lane):
        for snap in h.snapshots:
            axis.axvline(snap.step, color="0.6", ls=":", lw=1)
    for snap in h.snapshots:
        if snap.label:
            top.annotate(f"'{snap.label}'", (snap.step, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(2, -2), textcoords="offset points", fontsize="small",
                         color="0.3", rotation=90, va="top")  # fmt: skip
    if not h.token_input:
        # the outputs the guards watch (all of them when there are no range rules)
        watched = sorted({d for rule in guards for d in _watched(rule, shown)}) or range(shown)
        for r in rejected:
            _draw_rejected(top, bottom, r, watched)
    _draw_guard_events(bottom, h, guards, shown, rejected)
    _draw_rollbacks(lane, h)
    lane.set_xlabel("step")
    if h.snapshots:
        top.plot([], [], color="0.6", ls=":", lw=1, label="snapshot")
    for axis in (top, bottom):
        axis.legend(**_OUTSIDE)
    if len(steps):
        last = max([int(steps[-1]), *(int(e.step) for e in h.events), *(r.step for r in rejected)])
        lane.set_xlim(min(0, int(steps[0])) - 1, last + 1)
    span = f"steps {steps[0]}..{steps[-1]}" if len(steps) else "no steps"
    figure.suptitle(title or f"session {h.session_id}: {span}, {len(h.snapshots)} snapshots, "
                    f"{len(h.events)} events")  # fmt: skip
    return figure


def _watched(rule: pb.GuardRule, shown: int) -> list[int]:
    """The drawn outputs a range rule on outputs watches (none for other checks, and for
    rules on the inputs: their limits are not the outputs')."""
    if rule.check != pb.GuardRule.CHECK_RANGE or rule.side == pb.GuardRule.SIDE_INPUT:
        return []
    return [d for d in (rule.dims or range(shown)) if d < shown]


def _draw_rejected(top: Any, bottom: Any, r: RejectedStep, dims: Sequence[int]) -> None:
    """A step that is in no log, at the step it was tried: its input (at the panel's edge,
    with its values written out, when off the scale) and its outputs ``dims``."""
    for axis in (top, bottom):
        axis.axvspan(r.step - 0.5, r.step + 0.5, color=GUARD_COLOUR, alpha=0.12, lw=0)
    low, high = top.get_ylim()
    high += 0.4 * (high - low)  # a free band on top for the note
    top.set_ylim(low, high)
    n = len(r.inputs)
    for d, v in enumerate(r.inputs):
        x = r.step + (d - (n - 1) / 2) * 0.7  # side by side where several share an edge
        y, marker = (high, "^") if v > high else (low, "v") if v < low else (float(v), "o")
        top.plot(x, y, marker=marker, color=f"C{d}", markersize=7, clip_on=False,
                 markeredgecolor="k", markeredgewidth=0.5)  # fmt: skip
    values = "[" + " ".join(f"{v:+.3g}" for v in r.inputs) + "]"
    note = f"step {r.step}: input {values}\ntried, not kept"
    if ((r.inputs < low) | (r.inputs > high)).any():
        note += " (triangles: off the scale)"
    # right of the step, unless it is in the last third
    first, last = top.get_xlim()
    right = r.step < first + 2 * (last - first) / 3
    top.annotate(note, (r.step, 0.97), xycoords=("data", "axes fraction"),
                 xytext=(10 if right else -10, 0), textcoords="offset points", fontsize="small",
                 color=GUARD_COLOUR, va="top", ha="left" if right else "right")  # fmt: skip
    for d in dims:
        bottom.plot(r.step, r.outputs[d], marker="X", color=f"C{d}", markersize=9,
                    markeredgecolor="k", markeredgewidth=0.6, ls="none",
                    label=f"out {d} of step {r.step}: {r.outputs[d]:+.3f},\nnot kept")  # fmt: skip


def _draw_guard_limits(axis: Any, guards: Sequence[pb.GuardRule], shown: int) -> dict[str, float]:
    """Each range rule's limits on the outputs it watches as dashed lines (in that
    output's colour when it watches one), the side it forbids shaded; returns each rule's
    first limit by name."""
    limits: dict[str, float] = {}
    low, high = axis.get_ylim()
    for rule in guards:
        watched = _watched(rule, shown)
        if not watched:
            continue
        colour = f"C{watched[0]}" if len(watched) == 1 else "0.3"
        what = f"out {watched[0]}" if len(watched) == 1 else "outputs"
        bounds = []
        if rule.HasField("max"):
            low, high = min(low, rule.max), max(high, rule.max + 0.15 * (high - low))
            bounds.append(f"{what} <= {rule.max:+.3f}")
        if rule.HasField("min"):
            low, high = min(low, rule.min - 0.15 * (high - low)), max(high, rule.min)
            bounds.append(f"{what} >= {rule.min:+.3f}")
        label = f"guard {rule.name}'s limit:\n{' and '.join(bounds)}"
        for name, bound in (("max", rule.max), ("min", rule.min)):
            if not rule.HasField(name):
                continue
            limits.setdefault(rule.name, bound)
            axis.axhline(bound, color=colour, ls="--", lw=1.3, label=label)
            label = None
            forbidden = (bound, high) if name == "max" else (low, bound)
            axis.axhspan(*forbidden, color=GUARD_COLOUR, alpha=0.07, lw=0)
        axis.set_ylim(low, high)
    return limits


def _draw_guard_events(
    axis: Any,
    h: SessionHistory,
    guards: Sequence[pb.GuardRule],
    shown: int,
    rejected: Sequence[RejectedStep],
) -> None:
    """Each guard event at the step it judged: a ring around the output that broke the
    rule when the caller gave that step, else on the rule's limit, else at the top."""
    limits = _draw_guard_limits(axis, guards, shown)
    rules = {rule.name: rule for rule in guards}
    tried = {r.step: r for r in rejected}
    seen: set[str] = set()
    for event in h.events:
        if event.kind != "guard":
            continue
        label = None if event.action in seen else f"guard event ({event.action})"
        seen.add(event.action)
        colour = ACTION_COLOURS.get(event.action, "k")
        watched = _watched(rules[event.guard], shown) if event.guard in rules else []
        r = tried.get(int(event.step))
        ys = [float(r.outputs[d]) for d in watched] if r is not None else []
        if not ys and event.guard in limits:
            ys = [limits[event.guard]]
        if not ys:
            axis.plot(event.step, 1.0, marker="v", color=colour, markersize=8, label=label,
                      clip_on=False, transform=axis.get_xaxis_transform())  # fmt: skip
            continue
        axis.plot([event.step] * len(ys), ys, marker="o", markersize=15, ls="none",
                  markerfacecolor="none", markeredgecolor=colour, markeredgewidth=2,
                  label=label)  # fmt: skip


def _draw_rollbacks(lane: Any, h: SessionHistory) -> None:
    """One row per rollback, the oldest on top: an arrow from the step the session was at
    to the step it returned to, labelled with who asked and where it went."""
    labels = {int(s.step): s.label for s in h.snapshots if s.label}
    rollbacks = [e for e in h.events if e.kind == "rollback" and e.HasField("to_step")]
    rows = len(rollbacks)
    for row, event in enumerate(rollbacks):
        y = rows - row
        by_guard = event.cause == "guard"
        colour = GUARD_COLOUR if by_guard else MONITOR_COLOUR
        if by_guard:
            where = "its newest snapshot"
        elif int(event.to_step) in labels:
            where = f"snapshot '{labels[int(event.to_step)]}'"
        else:
            where = f"step {event.to_step}"
        who = "guard" if by_guard else f"{event.cause or 'client'} (Rollback call)"
        lane.annotate("", xy=(event.to_step, y), xytext=(event.step, y),
                      arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 2,
                                  "shrinkA": 0, "shrinkB": 0})  # fmt: skip
        lane.plot([event.step], [y], marker="|", color=colour, markersize=10)
        lane.annotate(f"{who} rolled back {event.step} → {event.to_step}: {where}",
                      (event.step, y), xytext=(8, 0), textcoords="offset points",
                      va="center", fontsize="small", color=colour)  # fmt: skip
    lane.set_ylim(0.3, rows + 0.7)
    lane.set_yticks([])
    lane.set_ylabel("rollbacks")
    if not rows:
        lane.annotate("no rollbacks", (0.5, 0.5), xycoords="axes fraction", ha="center",
                      va="center", fontsize="small", color="0.5")  # fmt: skip
