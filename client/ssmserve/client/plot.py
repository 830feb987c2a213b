"""``ssmserve plot SID --output out.png``: a picture of what a session did.

Everything drawn comes from the server (``GetHistory``): the inputs from the session's
log, the outputs as they were answered (replayed bit-exact), its snapshots and its
recorded events. Two panels share the step axis:

- inputs: one line per input dimension (token models: the token ids, as dots);
- outputs: one line per output dimension (token models: the top logit of each step);

with snapshots as dotted grey lines (labels named), guard events as markers coloured by
their action at the step they judged, and rollbacks as a red arrow from the step the
session was at back to the step it returned to (steps past it were undone, and later
ones replace them).

Needs matplotlib (``pip install matplotlib``; the client's ``plot`` extra brings it:
``pip install './client[plot]'`` from a clone). The flags are ``cli_parsers``'.
"""

from __future__ import annotations

import argparse
from typing import Any

from ssmserve.client.cli_errors import CliError
from ssmserve.client.output_files import check_output, write_output
from ssmserve.client.step_values import SessionHistory
from ssmserve.client.sync import Client

ACTION_COLOURS = {"report": "tab:blue", "clamp": "tab:orange", "reject": "tab:purple",
                  "rollback": "tab:red"}  # fmt: skip


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
    figure = draw(pyplot, history, max(1, args.dims))
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


def draw(pyplot: Any, h: SessionHistory, dims: int) -> Any:
    """The figure (not saved): inputs above, outputs below, marks on both."""
    figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    steps = h.steps
    if h.token_input:
        top.plot(steps, h.inputs, ".", markersize=3, color="tab:gray")
        top.set_ylabel("input token id")
        bottom.plot(steps, h.outputs.max(axis=1) if len(h.outputs) else [], lw=1)
        bottom.set_ylabel("top logit")
    else:
        for d in range(min(dims, h.inputs.shape[1])):
            top.plot(steps, h.inputs[:, d], lw=1, label=f"in {d}")
        for d in range(min(dims, h.outputs.shape[1])):
            bottom.plot(steps, h.outputs[:, d], lw=1, label=f"out {d}")
        top.set_ylabel("inputs")
        bottom.set_ylabel("outputs (as answered)")
        top.legend(loc="upper left", fontsize="small", ncol=4)
        bottom.legend(loc="upper left", fontsize="small", ncol=4)
    for axis in (top, bottom):
        for snap in h.snapshots:
            axis.axvline(snap.step, color="0.6", ls=":", lw=1)
    for snap in h.snapshots:
        if snap.label:
            top.annotate(snap.label, (snap.step, 1.0), xycoords=("data", "axes fraction"),
                         fontsize="small", color="0.4", rotation=90, va="top")  # fmt: skip
    _mark_events(bottom, h)
    bottom.set_xlabel("step")
    span = f"steps {steps[0]}..{steps[-1]}" if len(steps) else "no steps"
    figure.suptitle(f"session {h.session_id}: {span}, {len(h.snapshots)} snapshots "
                    f"(dotted), {len(h.events)} events")  # fmt: skip
    figure.tight_layout()
    return figure


def _mark_events(axis: Any, h: SessionHistory) -> None:
    low, high = axis.get_ylim()
    seen: set[str] = set()
    for event in h.events:
        if event.kind == "guard":
            label = None if f"guard {event.action}" in seen else f"guard: {event.action}"
            seen.add(f"guard {event.action}")
            axis.plot(event.step, high, marker="v", color=ACTION_COLOURS.get(event.action, "k"),
                      markersize=6, label=label, clip_on=False)  # fmt: skip
        elif event.kind == "rollback" and event.HasField("to_step"):
            label = None if "rollback" in seen else "rollback (arrow: from, line: to)"
            seen.add("rollback")
            arrow = {"arrowstyle": "->", "color": "tab:red", "lw": 1.5}
            axis.annotate("", xy=(event.to_step, low), xytext=(event.step, low), arrowprops=arrow)
            axis.axvline(event.to_step, color="tab:red", lw=1, alpha=0.6, label=label)
    if seen:
        axis.legend(loc="upper left", fontsize="small", ncol=4)
    if h.events and len(h.steps):
        last = max([int(h.steps[-1]), *(int(e.step) for e in h.events)])
        axis.set_xlim(right=last + 1)
