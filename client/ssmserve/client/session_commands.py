"""The CLI commands that talk to a worker (``ssmserve --server HOST:PORT ...``).

    session create --model NAME [--session-id SID] [--snapshot-every K] [--snapshot-phase P]
                   [--max-snapshots N] [--history-window N] [--durability log|snapshot|none]
                   [--idle-ttl S]
                   [--label KEY=VALUE]... [--guard SPEC]...
    session stream SID --input IN.npy --output OUT.npy [--steps-per-message N]
    session inspect SID [--json] | session list [--model NAME] [--json] | session close SID
    snapshot SID [--label L] | snapshots SID [--json]
    rollback SID (--to-step T | --to-snapshot ID | --to-label L | --back N)
    export SID --out FILE [--snapshot ID] | import --in FILE [--session SID] [--model NAME]
    forecast SID --horizon H [--at-step T] [--output OUT.npy]
    fork SID (--at-step T | --at-snapshot ID | --at-label L) [--new-id SID] [--target HOST:PORT]
    workers [--json] | models [--json] | migrate SID --to HOST:PORT | drain [HOST:PORT]
    top [--interval S] [--sessions N] [--once | --json]   (``top.py``)
    plot SID --output OUT.png [--from-step T] [--to-step T] [--dims N]   (``plot.py``)

A guard SPEC is comma-separated ``key=value``: ``check`` (finite | range), ``action``
(report | clamp | reject | rollback), and optionally ``min``, ``max``, ``dims`` (``0+2``)
and ``name``. Example: ``check=range,min=-3,max=3,action=rollback``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from ssmserve.client import plot, top
from ssmserve.client.atomic_file import atomic_write
from ssmserve.client.errors import CliError, SsmserveClientError
from ssmserve.client.npy_files import check_writable, load_npy, save_npy
from ssmserve.client.progress import ProgressBar
from ssmserve.client.sync import Client
from ssmserve.client.tls import TlsConfig
from ssmserve.v1 import ssmserve_pb2 as pb

_CHECKS = {"finite": pb.GuardRule.CHECK_FINITE, "range": pb.GuardRule.CHECK_RANGE}
_ACTIONS = {
    "report": pb.GuardRule.ACTION_REPORT,
    "clamp": pb.GuardRule.ACTION_CLAMP,
    "reject": pb.GuardRule.ACTION_REJECT,
    "rollback": pb.GuardRule.ACTION_ROLLBACK,
}
_DURABILITY = {
    "log": pb.DURABILITY_LOG,
    "snapshot": pb.DURABILITY_SNAPSHOT,
    "none": pb.DURABILITY_NONE,
}


def parse_guard(spec: str, index: int = 0) -> pb.GuardRule:
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise CliError(f"guard {spec!r}: expected key=value, got {part!r}")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"check", "action", "min", "max", "dims", "name"}
    if unknown:
        raise CliError(f"guard {spec!r}: unknown key {sorted(unknown)[0]!r}")
    check = fields.get("check", "")
    action = fields.get("action", "report")
    if check not in _CHECKS:
        raise CliError(f"guard {spec!r}: check must be finite or range")
    if action not in _ACTIONS:
        raise CliError(f"guard {spec!r}: action must be one of {', '.join(_ACTIONS)}")
    rule = pb.GuardRule(
        name=fields.get("name", f"{check}-{index}"), check=_CHECKS[check], action=_ACTIONS[action]
    )
    try:
        for bound in ("min", "max"):
            if bound in fields:
                value = float(fields[bound])
                if not math.isfinite(value):
                    raise ValueError(bound)
                setattr(rule, bound, value)
        if fields.get("dims"):
            rule.dims.extend(int(d) for d in fields["dims"].split("+"))
    except ValueError:
        raise CliError(f"guard {spec!r}: min, max, dims must be numbers") from None
    return rule


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    session = commands.add_parser("session", help="create, stream, inspect, list, close")
    sc = session.add_subparsers(dest="session_command", required=True, metavar="ACTION")

    create = sc.add_parser("create", help="create a session; prints its id last")
    create.add_argument("--model", required=True, help="a model the worker serves")
    create.add_argument("--session-id", default="", help="its id (default: generated)")
    create.add_argument(
        "--snapshot-every", type=count, default=0, metavar="K",
        help="steps between periodic snapshots (default: the server's, 64)",
    )  # fmt: skip
    create.add_argument(
        "--snapshot-phase", type=int, default=None, metavar="P",
        help="periodic snapshots at steps s with s %% K == P, 0 <= P < K (default: the "
        "worker picks one at random, so sessions made together snapshot apart)",
    )  # fmt: skip
    create.add_argument(
        "--max-snapshots", type=count, default=0, metavar="N",
        help="snapshots kept; older ones and their log are trimmed (default: 16)",
    )  # fmt: skip
    create.add_argument(
        "--history-window", type=count, default=0, metavar="N",
        help="inputs of history each checkpoint carries (default: 256)",
    )  # fmt: skip
    create.add_argument(
        "--durability", choices=sorted(_DURABILITY), default=None,
        help="log: answer a step once its input is in Redis (default); snapshot: periodic "
        "snapshots only; none: write only when asked",
    )  # fmt: skip
    create.add_argument(
        "--idle-ttl", type=float, default=0.0, metavar="SECONDS",
        help="unload it from memory after this long without steps (0: server default)",
    )  # fmt: skip
    create.add_argument(
        "--label", type=_label, action="append", default=[], metavar="K=V",
        help="a label to keep with the session (repeatable)",
    )  # fmt: skip
    create.add_argument(
        "--guard", action="append", default=[], metavar="SPEC",
        help="an output guard, e.g. check=range,min=-3,max=3,action=rollback (repeatable)",
    )  # fmt: skip

    stream = sc.add_parser("stream", help="stream every row of a .npy as the next steps")
    stream.add_argument("session_id", help="the session to step")
    stream.add_argument("--input", required=True, type=Path, help="a .npy: one row per step")
    stream.add_argument("--output", required=True, type=Path, help="the outputs, as .npy")
    stream.add_argument(
        "--steps-per-message", type=count, default=64, help="steps sent per message (64)"
    )

    inspect = sc.add_parser("inspect", help="show a session")
    inspect.add_argument("session_id", help="the session to show")
    inspect.add_argument("--json", action="store_true", help="print JSON")

    listing = sc.add_parser("list", help="list sessions")
    listing.add_argument("--model", default="", help="only sessions of this model")
    listing.add_argument("--json", action="store_true", help="print JSON")

    close = sc.add_parser("close", help="close a session")
    close.add_argument("session_id", help="the session to close")
    close.add_argument("--final-snapshot", action="store_true", help="keep it exportable")

    snap = commands.add_parser("snapshot", help="take a snapshot now")
    snap.add_argument("session_id", help="the session to snapshot")
    snap.add_argument("--label", default="", help="a name to roll back to later")

    snaps = commands.add_parser("snapshots", help="list a session's snapshots")
    snaps.add_argument("session_id", help="the session")
    snaps.add_argument("--json", action="store_true", help="print JSON")

    rollback = commands.add_parser("rollback", help="return a session exactly to an earlier step")
    rollback.add_argument("session_id", help="the session to roll back")
    target = rollback.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-step", type=count, metavar="T", help="back to step T")
    target.add_argument("--to-snapshot", metavar="ID", help="back to a snapshot")
    target.add_argument("--to-label", metavar="L", help="back to a labelled snapshot")
    target.add_argument("--back", type=count, metavar="N", help="N steps back")

    export = commands.add_parser("export", help="write a session's checkpoint to a file")
    export.add_argument("session_id", help="the session to export")
    export.add_argument("--out", required=True, type=Path, help="the checkpoint file to write")
    export.add_argument("--snapshot", default="", help="a snapshot id (default: current state)")
    export.add_argument("--json", action="store_true", help="print the result as JSON")

    imp = commands.add_parser("import", help="bring a checkpoint file back as a session")
    imp.add_argument(
        "--in", dest="input", required=True, type=Path, help="a checkpoint file (ssmserve export)"
    )
    imp.add_argument("--session", default="", help="session id (default: the checkpoint's)")
    imp.add_argument("--model", default="", help="model name (default: by fingerprint)")
    imp.add_argument("--replace", action="store_true", help="overwrite an existing session")
    imp.add_argument("--json", action="store_true", help="print the new session as JSON")

    forecast = commands.add_parser(
        "forecast", help="run a session's model ahead on its own outputs (session unchanged)"
    )
    forecast.add_argument("session_id", help="the session to forecast from")
    forecast.add_argument(
        "--horizon", required=True, type=positive_int, metavar="H", help="steps to run ahead"
    )
    forecast.add_argument("--at-step", type=count, metavar="T", help="default: current step")
    forecast.add_argument("--output", type=Path, help="write the (H, output_dim) outputs here")

    fork = commands.add_parser("fork", help="branch a session at a step; prints the new id last")
    fork.add_argument("session_id", help="the session to branch")
    point = fork.add_mutually_exclusive_group(required=True)
    point.add_argument("--at-step", type=count, metavar="T", help="branch at step T")
    point.add_argument("--at-snapshot", metavar="ID", help="branch at a snapshot")
    point.add_argument("--at-label", metavar="L", help="branch at a labelled snapshot")
    fork.add_argument("--new-id", default="", help="the fork's session id (default: generated)")
    fork.add_argument("--target", default="", metavar="HOST:PORT", help="the worker to serve it")

    models = commands.add_parser(
        "models", help="the models each live worker serves: versions and their sessions"
    )
    models.add_argument("--json", action="store_true", help="print JSON")
    upgrade = commands.add_parser(
        "upgrade", help="move a session to another version of its model (a replay of its inputs)"
    )
    upgrade.add_argument("session_id", help="the session to move")
    upgrade.add_argument(
        "--model", default="", metavar="NAME@VERSION", help="default: the newest version"
    )
    upgrade.add_argument("--json", action="store_true", help="print the result as JSON")
    load = commands.add_parser(
        "load-model", help="admin: a worker serves another model (version), no restart"
    )
    load.add_argument("key", metavar="NAME[@VERSION]", help="the model's name and version")
    load.add_argument("directory", help="its directory on the worker's host")
    load.add_argument("--worker", default="", metavar="HOST:PORT", help="default: --server")
    load.add_argument("--json", action="store_true", help="print the worker's models as JSON")
    unload = commands.add_parser(
        "unload-model", help="admin: a worker stops serving a model (no session may run it)"
    )
    unload.add_argument("key", metavar="NAME[@VERSION]", help="the model to stop serving")
    unload.add_argument("--worker", default="", metavar="HOST:PORT", help="default: --server")
    unload.add_argument("--json", action="store_true", help="print the worker's models as JSON")

    workers = commands.add_parser("workers", help="list the live workers of the cluster")
    workers.add_argument("--json", action="store_true", help="print JSON")

    migrate = commands.add_parser("migrate", help="move a session to another worker")
    migrate.add_argument("session_id", help="the session to move")
    migrate.add_argument("--to", required=True, metavar="HOST:PORT", help="the target worker")
    migrate.add_argument("--json", action="store_true", help="print the result as JSON")

    drain = commands.add_parser(
        "drain", help="move every session off a worker (it then refuses new ones)"
    )
    drain.add_argument(
        "worker", nargs="?", default="", metavar="HOST:PORT", help="default: --server"
    )
    drain.add_argument(
        "--json", action="store_true", help="print each session's progress as a JSON line"
    )
    top.add_parser(commands)
    plot.add_parser(commands)
    undrain = commands.add_parser("undrain", help="undo a drain: the worker serves again")
    undrain.add_argument(
        "worker", nargs="?", default="", metavar="HOST:PORT", help="default: --server"
    )


SERVICE_COMMANDS = {
    "session", "snapshot", "snapshots", "rollback", "export", "import", "forecast", "fork",
    "workers", "migrate", "drain", "undrain", "top", "plot", "models", "load-model",
    "unload-model", "upgrade",
}  # fmt: skip


def run(args: argparse.Namespace) -> None:
    if not args.server:
        raise CliError(f"'{args.command}' talks to a worker: give --server HOST:PORT first")
    handler: Callable[[Client, argparse.Namespace], None]
    if args.command == "session":
        handler = {
            "create": _create,
            "stream": _stream,
            "inspect": _inspect,
            "list": _list,
            "close": _close,
        }[args.session_command]
    else:
        handler = {
            "snapshot": _snapshot,
            "snapshots": _snapshots,
            "rollback": _rollback,
            "export": _export,
            "import": _import,
            "forecast": _forecast,
            "fork": _fork,
            "workers": _workers,
            "migrate": _migrate,
            "drain": _drain,
            "undrain": _undrain,
            "top": top.run,
            "models": _models,
            "load-model": _load_model,
            "upgrade": _upgrade,
            "unload-model": _unload_model,
            "plot": plot.run,
        }[args.command]
    with Client(args.server, tls=tls_config(args), token=args.token) as client:
        handler(client, args)


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """TLS from --tls-ca/--tls-cert/--tls-key, else from the environment, else none."""
    given = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    if not any(given.values()):
        return TlsConfig.from_env()
    return TlsConfig(**given)


def _print_json(message: Any) -> None:
    print(json.dumps(json_format.MessageToDict(message), indent=2, sort_keys=True))


def _create(client: Client, args: argparse.Namespace) -> None:
    guards = [parse_guard(spec, i) for i, spec in enumerate(args.guard)]
    info = client.create_session(
        args.model,
        args.session_id,
        snapshot_every=args.snapshot_every,
        max_snapshots=args.max_snapshots,
        history_window=args.history_window,
        guards=guards,
        durability=_DURABILITY[args.durability] if args.durability else 0,
        idle_ttl_s=args.idle_ttl,
        labels=dict(args.label),
        snapshot_phase=args.snapshot_phase,
    )
    print(f"created session on model {info.model} at step {info.step}")
    print(info.session_id)


def _stream(client: Client, args: argparse.Namespace) -> None:
    inputs = load_npy(args.input)
    info = client.get_session(args.session_id)
    if info.token_input:
        if inputs.ndim != 1 or not np.issubdtype(inputs.dtype, np.integer):
            raise CliError(f"{args.input}: a token model takes int ids of shape (T,)")
        rows: list[Any] = [int(t) for t in inputs]
    else:
        if inputs.ndim != 2 or inputs.shape[1] != info.input_dim:
            raise CliError(
                f"{args.input}: expected shape (T, {info.input_dim}), got {list(inputs.shape)}"
            )
        rows = list(np.asarray(inputs, np.float32))
    outputs = np.empty((len(rows), info.output_dim), np.float32)
    done = 0
    try:
        for out in client.stream_steps(
            args.session_id,
            rows,
            first_step=info.step + 1,
            steps_per_message=max(1, args.steps_per_message),
        ):
            outputs[done] = out.output
            for event in out.guard_events:
                print(f"step {out.step}: guard {event.guard}: {event.detail}", file=sys.stderr)
            done += 1
    except SsmserveClientError as exc:
        raise CliError(
            f"{exc} ({done} of {len(rows)} steps were applied; nothing written)"
        ) from None
    save_npy(args.output, outputs)
    print(
        f"streamed {done} steps (session {args.session_id} at step {info.step + done}); "
        f"outputs in {args.output}"
    )


def _inspect(client: Client, args: argparse.Namespace) -> None:
    info = client.get_session(args.session_id)
    if args.json:
        _print_json(info)
        return
    c = info.config
    print(f"session   {info.session_id}")
    print(f"model     {info.model} ({info.model_fingerprint[:16]})")
    print(f"step      {info.step} (rollback reaches back to {info.oldest_rollback_step})")
    print(
        f"snapshots {info.snapshot_count} (every {c.snapshot_every} at phase "
        f"{c.snapshot_phase}, keep {c.max_snapshots})"
    )
    print(f"durability {pb.Durability.Name(c.durability).removeprefix('DURABILITY_').lower()}")
    print(
        f"resident  {'yes, on ' + info.owner if info.resident else 'no'}"
        f"{' (closed)' if info.closed else ''}"
    )
    for rule in c.guards:
        print(
            f"guard     {rule.name}: {pb.GuardRule.Check.Name(rule.check)} -> "
            f"{pb.GuardRule.Action.Name(rule.action)}"
        )


def _list(client: Client, args: argparse.Namespace) -> None:
    sessions = client.list_sessions(model=args.model)
    if args.json:
        print(json.dumps([json_format.MessageToDict(s) for s in sessions], indent=2))
        return
    for s in sessions:
        where = "closed" if s.closed else ("resident" if s.resident else "stored")
        print(f"{s.session_id}\t{s.model}\tstep {s.step}\t{where}")


def _close(client: Client, args: argparse.Namespace) -> None:
    reply = client.close_session(args.session_id, final_snapshot=args.final_snapshot)
    extra = f", final snapshot {reply.snapshot_id}" if reply.snapshot_id else ""
    print(f"closed {args.session_id} at step {reply.step}{extra}")


def _snapshot(client: Client, args: argparse.Namespace) -> None:
    info = client.snapshot(args.session_id, args.label)
    print(f"snapshot at step {info.step} ({info.size_bytes} bytes)")
    print(info.snapshot_id)


def _snapshots(client: Client, args: argparse.Namespace) -> None:
    snaps = client.list_snapshots(args.session_id)
    if args.json:
        print(json.dumps([json_format.MessageToDict(s) for s in snaps], indent=2))
        return
    for s in snaps:
        print(f"{s.snapshot_id}\tstep {s.step}\t{s.reason}\t{s.label}\t{s.size_bytes} bytes")


def _rollback(client: Client, args: argparse.Namespace) -> None:
    reply = client.rollback(
        args.session_id,
        to_step=args.to_step,
        to_snapshot=args.to_snapshot,
        to_label=args.to_label,
        back=args.back,
    )
    print(
        f"session {args.session_id} is at step {reply.step} (snapshot "
        f"{reply.from_snapshot_id or 'none needed'} + {reply.replayed_steps} replayed)"
    )


def _export(client: Client, args: argparse.Namespace) -> None:
    bar = ProgressBar("export", "bytes")
    try:
        blob = client.export_checkpoint(args.session_id, args.snapshot, progress=bar)
    finally:
        bar.close()
    atomic_write(args.out, lambda tmp: Path(tmp).write_bytes(blob))
    if args.json:
        print(
            json.dumps({"session_id": args.session_id, "bytes": len(blob), "path": str(args.out)})
        )
        return
    print(f"wrote {len(blob)} bytes to {args.out}")


def _import(client: Client, args: argparse.Namespace) -> None:
    try:
        blob = args.input.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {args.input}: {exc}") from None
    bar = ProgressBar("import", "bytes")
    try:
        info = client.import_checkpoint(
            blob, args.session, model=args.model, replace=args.replace, progress=bar
        )
    finally:
        bar.close()
    if args.json:
        _print_json(info)
        return
    print(f"imported session on model {info.model} at step {info.step}")
    print(info.session_id)


def _forecast(client: Client, args: argparse.Namespace) -> None:
    if args.output is not None:
        check_writable(args.output)
    fc = client.forecast(args.session_id, args.horizon, at_step=args.at_step)
    for event in fc.guard_events:
        print(f"step {event.step}: guard {event.guard}: {event.detail}", file=sys.stderr)
    if args.output is not None:
        save_npy(args.output, fc.outputs)
    else:
        for i, step in enumerate(fc.steps):
            if fc.tokens is not None:
                print(f"step {step}: token {fc.tokens[i]} (logit {fc.outputs[i].max():.6g})")
            else:
                print(f"step {step}: " + " ".join(f"{v:.6g}" for v in fc.outputs[i]))
    where = f"; outputs in {args.output}" if args.output is not None else ""
    if fc.stopped is not None:
        raise CliError(
            f"the forecast stopped after {len(fc.outputs)} of {args.horizon} steps "
            f"({fc.stopped.reason}): {fc.stopped.message}{where}"
        )
    print(
        f"forecast of {len(fc.outputs)} steps from step {fc.from_step} of {args.session_id} "
        f"(the session is unchanged){where}"
    )


def _fork(client: Client, args: argparse.Namespace) -> None:
    reply = client.fork(
        args.session_id,
        at_step=args.at_step,
        at_snapshot=args.at_snapshot,
        at_label=args.at_label,
        new_session_id=args.new_id,
        target=args.target,
    )
    source = (
        f"snapshot {reply.from_snapshot_id} + {reply.replayed_steps} replayed"
        if reply.from_snapshot_id
        else "live state"
    )
    print(f"forked {args.session_id} at step {reply.step} ({source}) on {reply.session.owner}")
    print(reply.session.session_id)


def _workers(client: Client, args: argparse.Namespace) -> None:
    workers = client.list_workers()
    if args.json:
        print(json.dumps([json_format.MessageToDict(w) for w in workers], indent=2))
        return
    for w in workers:
        state = "draining" if w.draining else "serving"
        print(
            f"{w.address}\t{w.worker_id}\t{state}\t{w.load} sessions\t{','.join(w.models)}"
            f"\tnumerics {w.numerics or '?'}"
        )


def _models(client: Client, args: argparse.Namespace) -> None:
    replies = [client.list_models(w.address) for w in client.list_workers() if not w.draining]
    if args.json:
        print(json.dumps([json_format.MessageToDict(r) for r in replies], indent=2))
        return
    for reply in sorted(replies, key=lambda r: r.worker):
        _print_models(reply, as_json=False)


def _upgrade(client: Client, args: argparse.Namespace) -> None:
    reply = client.upgrade(args.session_id, args.model)
    if args.json:
        _print_json(reply)
    elif not reply.replayed_steps and reply.from_model == reply.session.model:
        print(f"{args.session_id} runs {reply.session.model} already")
    else:
        print(
            f"{args.session_id}: {reply.from_model} -> {reply.session.model} at step "
            f"{reply.session.step} ({reply.replayed_steps} kept inputs replayed from step "
            f"{reply.replayed_from_step})"
        )


def _load_model(client: Client, args: argparse.Namespace) -> None:
    _print_models(client.load_model(args.key, args.directory, args.worker), args.json)


def _unload_model(client: Client, args: argparse.Namespace) -> None:
    _print_models(client.unload_model(args.key, args.worker), args.json)


def _print_models(reply: pb.ListModelsResponse, as_json: bool) -> None:
    if as_json:
        _print_json(reply)
        return
    for m in reply.models:
        newest = " (newest)" if m.newest and m.version else ""
        print(
            f"{reply.worker}\t{m.name}\t{m.version or '-'}{newest}\t{m.fingerprint[:16]}\t"
            f"{m.resident_sessions} sessions"
        )


def _migrate(client: Client, args: argparse.Namespace) -> None:
    reply = client.migrate(args.session_id, args.to)
    if args.json:
        _print_json(reply)
        return
    if reply.source == reply.target:
        print(f"{args.session_id} is already served by {reply.target} (step {reply.step})")
        return
    source = reply.source or "(no live owner)"
    print(
        f"migrated {args.session_id} from {source} to {reply.target} at step {reply.step} "
        f"in {reply.elapsed_ms:.1f} ms"
    )


def _drain(client: Client, args: argparse.Namespace) -> None:
    worker = args.worker or args.server
    done = 0
    bar = ProgressBar("drain", "sessions")
    try:
        for p in client.drain(worker):
            done = p.done
            if args.json:  # one object per line, as they come
                print(json.dumps(json_format.MessageToDict(p), sort_keys=True), flush=True)
                continue
            if bar.enabled:
                bar(p.done, p.total)
                if not p.error:
                    continue
                sys.stderr.write("\n")
            where = f"-> {p.target}" if p.target else "snapshotted for later pickup"
            error = f" ({p.error})" if p.error else ""
            print(f"[{p.done}/{p.total}] {p.session_id} {where}{error}", flush=True)
    finally:
        bar.close()
    if not args.json:
        print(f"drained {worker}: {done} sessions")


def _undrain(client: Client, args: argparse.Namespace) -> None:
    info = client.undrain(args.worker or args.server)
    print(f"{info.address} serves again (draining: {str(info.draining).lower()})")
