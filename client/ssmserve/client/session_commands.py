"""What the CLI's service commands do (``ssmserve --server HOST[:PORT] ...``); their flags
are ``cli_parsers``', where each command's parser names its function here as its handler.
:func:`run` gives a command a client of ``--server``.

Each command checks what it can locally (its input files, the path it writes) before it
asks a worker for anything, so a bad path costs no work. The commands that move arrays
(``session stream``, ``forecast``, ``plot``) live in ``array_commands`` and ``plot``,
imported only when one of them runs: the others start without numpy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format

from ssmserve.client.addresses import worker_address
from ssmserve.client.cli_errors import CliError
from ssmserve.client.guards import guard_rule
from ssmserve.client.output_files import check_output, write_or_keep
from ssmserve.client.progress import ProgressBar
from ssmserve.client.sync import Client
from ssmserve.client.tls import TlsConfig
from ssmserve.v1 import ssmserve_pb2 as pb

#: What a service command is: it gets a client of ``--server`` and the parsed flags.
Command = Callable[[Client, argparse.Namespace], None]

_DURABILITY = {
    "log": pb.DURABILITY_LOG,
    "snapshot": pb.DURABILITY_SNAPSHOT,
    "none": pb.DURABILITY_NONE,
}


#: What a guard SPEC may say: ``guard_rule``'s fields (``-`` or ``_`` in their names).
_GUARD_NUMBERS = ("min", "max", "max_rate", "tolerance", "decay", "scale_floor")
_GUARD_KEYS = {"check", "action", "side", "dims", "name", "sustained", *_GUARD_NUMBERS}


def parse_guard(spec: str, index: int = 0) -> pb.GuardRule:
    """A guard SPEC (``check=range,min=-3,max=3,action=rollback``) as a GuardRule."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise CliError(f"guard {spec!r}: expected key=value, got {part!r}")
        fields[key.strip().replace("-", "_")] = value.strip()
    unknown = set(fields) - _GUARD_KEYS
    if unknown:
        raise CliError(f"guard {spec!r}: unknown key {sorted(unknown)[0]!r}")
    check = fields.get("check", "")
    numbers: dict[str, float] = {}
    try:
        for key in _GUARD_NUMBERS:
            if key in fields:
                numbers[key] = float(fields[key])
                if not math.isfinite(numbers[key]):
                    raise ValueError(key)
        dims = [int(d) for d in fields["dims"].split("+")] if fields.get("dims") else []
        sustained = int(fields["sustained"]) if "sustained" in fields else None
    except ValueError:
        raise CliError(
            f"guard {spec!r}: {', '.join(_GUARD_NUMBERS)}, sustained and dims must be numbers"
        ) from None
    try:
        return guard_rule(
            fields.get("name", f"{check.replace('_', '-')}-{index}"),
            check,
            fields.get("action", "report"),
            side=fields.get("side"),
            dims=dims,
            sustained=sustained,
            **numbers,  # type: ignore[arg-type]
        )
    except ValueError as exc:
        raise CliError(f"guard {spec!r}: {exc}") from None


def run(args: argparse.Namespace, command: Command) -> None:
    """Run ``command``, a service command, against ``--server``."""
    if not args.server:
        raise CliError(
            f"'{args.command}' talks to a worker: give --server HOST[:PORT] before the "
            "command, or set SSMSERVE_SERVER"
        )
    args.server = worker_address(args.server)
    with Client(args.server, tls=tls_config(args), token=args.token) as client:
        command(client, args)


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """TLS from --tls-ca/--tls-cert/--tls-key, else from the environment, else none."""
    given = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    if not any(given.values()):
        return TlsConfig.from_env()
    return TlsConfig(**given)


def _print_json(message: Any) -> None:
    print(json.dumps(json_format.MessageToDict(message), indent=2, sort_keys=True))


def create(client: Client, args: argparse.Namespace) -> None:
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


def inspect(client: Client, args: argparse.Namespace) -> None:
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
    if info.token_input:
        print(f"input     a token id per step; output {info.output_dim} logits")
    else:
        print(f"input     {info.input_dim} floats per step; output {info.output_dim} floats")
    print(f"durability {pb.Durability.Name(c.durability).removeprefix('DURABILITY_').lower()}")
    print(
        f"resident  {'yes, on ' + info.owner if info.resident else 'no'}"
        f"{' (closed)' if info.closed else ''}"
    )
    for rule in c.guards:
        side = pb.GuardRule.Side.Name(rule.side).removeprefix("SIDE_").lower()
        held = f", {rule.sustained} steps in a row" if rule.sustained > 1 else ""
        print(
            f"guard     {rule.name}: {pb.GuardRule.Check.Name(rule.check)} on the {side}"
            f"{held} -> {pb.GuardRule.Action.Name(rule.action)}"
        )


def list_sessions(client: Client, args: argparse.Namespace) -> None:
    sessions = client.list_sessions(model=args.model)
    if args.json:
        print(json.dumps([json_format.MessageToDict(s) for s in sessions], indent=2))
        return
    for s in sessions:
        where = "closed" if s.closed else ("resident" if s.resident else "stored")
        print(f"{s.session_id}\t{s.model}\tstep {s.step}\t{where}")


def close(client: Client, args: argparse.Namespace) -> None:
    reply = client.close_session(args.session_id, final_snapshot=args.final_snapshot)
    extra = f", final snapshot {reply.snapshot_id}" if reply.snapshot_id else ""
    print(f"closed {args.session_id} at step {reply.step}{extra}")


def snapshot(client: Client, args: argparse.Namespace) -> None:
    info = client.snapshot(args.session_id, args.label)
    print(f"snapshot at step {info.step} ({info.size_bytes} bytes)")
    print(info.snapshot_id)


def snapshots(client: Client, args: argparse.Namespace) -> None:
    snaps = client.list_snapshots(args.session_id)
    if args.json:
        print(json.dumps([json_format.MessageToDict(s) for s in snaps], indent=2))
        return
    for s in snaps:
        print(f"{s.snapshot_id}\tstep {s.step}\t{s.reason}\t{s.label}\t{s.size_bytes} bytes")


def rollback(client: Client, args: argparse.Namespace) -> None:
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


def export(client: Client, args: argparse.Namespace) -> None:
    check_output(args.output)
    bar = ProgressBar("export", "bytes")
    try:
        blob = client.export_checkpoint(args.session_id, args.snapshot, progress=bar)
    finally:
        bar.close()
    where = write_or_keep(
        args.output, lambda f: f.write(blob), f"{args.session_id}-export", ".ckpt",
        f"the checkpoint ({len(blob)} bytes) was exported",
    )  # fmt: skip
    if args.json:
        print(json.dumps({"session_id": args.session_id, "bytes": len(blob), "path": str(where)}))
        return
    print(f"wrote {len(blob)} bytes to {where}")


def import_checkpoint(client: Client, args: argparse.Namespace) -> None:
    try:
        blob = args.input.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {args.input}: {exc.strerror or exc}") from None
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


def fork(client: Client, args: argparse.Namespace) -> None:
    reply = client.fork(
        args.session_id,
        at_step=args.at_step,
        at_snapshot=args.at_snapshot,
        at_label=args.at_label,
        new_session_id=args.new_id,
        target=worker_address(args.target),
    )
    source = (
        f"snapshot {reply.from_snapshot_id} + {reply.replayed_steps} replayed"
        if reply.from_snapshot_id
        else "live state"
    )
    print(f"forked {args.session_id} at step {reply.step} ({source}) on {reply.session.owner}")
    print(reply.session.session_id)


def workers(client: Client, args: argparse.Namespace) -> None:
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


def models(client: Client, args: argparse.Namespace) -> None:
    replies = [client.list_models(w.address) for w in client.list_workers() if not w.draining]
    if args.json:
        print(json.dumps([json_format.MessageToDict(r) for r in replies], indent=2))
        return
    for reply in sorted(replies, key=lambda r: r.worker):
        _print_models(reply, as_json=False)


def upgrade(client: Client, args: argparse.Namespace) -> None:
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


def load_model(client: Client, args: argparse.Namespace) -> None:
    worker = worker_address(args.worker)
    _print_models(client.load_model(args.key, args.directory, worker), args.json)


def unload_model(client: Client, args: argparse.Namespace) -> None:
    _print_models(client.unload_model(args.key, worker_address(args.worker)), args.json)


def _print_models(reply: pb.ListModelsResponse, as_json: bool) -> None:
    if as_json:
        _print_json(reply)
        return
    for m in reply.models:
        newest = " (newest)" if m.newest and m.version else ""
        print(
            f"{reply.worker}\t{m.name}\t{m.version or '-'}{newest}\t{m.fingerprint[:16]}\t"
            f"{m.resident_sessions} sessions{_text_of(m)}"
        )


def _text_of(m: pb.ModelInfo) -> str:
    """A token model's text columns: its tokenizer and end-of-sequence ids."""
    if not m.token_input:
        return ""
    eos = ",".join(map(str, m.eos_token_ids)) or "none"
    return f"\ttokenizer {'yes' if m.has_tokenizer else 'no'}\teos {eos}"


def migrate(client: Client, args: argparse.Namespace) -> None:
    reply = client.migrate(args.session_id, worker_address(args.to))
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


def drain(client: Client, args: argparse.Namespace) -> None:
    worker = worker_address(args.worker or args.server)
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


def undrain(client: Client, args: argparse.Namespace) -> None:
    info = client.undrain(worker_address(args.worker or args.server))
    print(f"{info.address} serves again (draining: {str(info.draining).lower()})")
