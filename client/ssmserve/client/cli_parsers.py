"""The ``ssmserve`` command line: its global options and every service command's flags.

Only argparse here: ``ssmserve --help`` (and any command's ``--help``) is answered from
this module alone. Each command's parser names what runs it (``set_defaults(handler=...)``,
:func:`_on_worker`); that code (``session_commands``, with gRPC; ``array_commands`` and
``plot``, with numpy) is imported only once the command line is parsed. The forms:

    session create --model NAME [--session-id SID] [--snapshot-every K] [--snapshot-phase P]
                   [--max-snapshots N] [--history-window N] [--durability log|snapshot|none]
                   [--idle-ttl S] [--label KEY=VALUE]... [--guard SPEC]...
    session stream SID --input IN.npy --output OUT.npy [--first-step S] [--steps-per-message N]
                   [--last-only] [--resume]
    session inspect SID [--json] | session list [--model NAME] [--json] | session close SID
    snapshot SID [--label L] | snapshots SID [--json]
    rollback SID (--to-step T | --to-snapshot ID | --to-label L | --back N)
    export SID --output FILE [--snapshot ID] | import --input FILE [--session SID] [--model NAME]
    forecast SID --horizon H [--at-step T] [--output OUT.npy]
    generate SID --max-tokens N [--temperature T] [--top-k K] [--top-p P] [--min-p M]
             [--seed S] [--stop ID]... [--prompt-ids IN.npy | --prompt TEXT] [--output OUT.npy]
             [--stop-text TEXT]... [--ignore-eos] [--repetition-penalty R]
             [--presence-penalty P] [--frequency-penalty F] [--penalty-last-n N]
             [--logit-bias ID=B]... [--logprobs N]
             [--at-step T] [--append] [--json-schema FILE | --regex RE | --grammar FILE |
             --json-object] [--monitor-regex RE | --monitor-json-schema FILE]
             [--monitor-rollback N] [--monitor-retries N]
    fork SID (--at-step T | --at-snapshot ID | --at-label L) [--new-id SID] [--target HOST:PORT]
    workers [--json] | models [--json] | migrate SID --to HOST:PORT | drain [HOST:PORT]
    top [--interval S] [--sessions N] [--once | --json]
    plot SID --output OUT.png [--from-step T] [--to-step T] [--dims N]

Every file a command writes is given with ``--output`` (``export --out`` and ``import
--in`` are kept, hidden, for old scripts).

A guard SPEC is comma-separated ``key=value``: ``check`` (finite | range | rate |
prediction-error), ``action`` (report | clamp | impute | reject | rollback), and
optionally ``side`` (input | output), ``min``, ``max``, ``max-rate``, ``tolerance``,
``decay``, ``scale-floor``, ``sustained``, ``dims`` (``0+2``) and ``name``
(``ssmserve.client.guards.guard_rule``'s fields). Examples:
``check=range,min=-3,max=3,action=rollback``,
``check=prediction-error,tolerance=6,scale-floor=0.05,action=impute``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ssmserve.client import cli_constraints, cli_sampling

Subparsers = argparse._SubParsersAction  # the type of add_subparsers()' result

DURABILITIES = ("log", "none", "snapshot")


def _on_worker(name: str, module: str = "session_commands") -> Callable[[argparse.Namespace], None]:
    """The handler of a service command: ``ssmserve.client.<module>.<name>(client, args)``
    with a client of ``--server`` (``session_commands.run``), its modules imported then."""

    def handler(args: argparse.Namespace) -> None:
        commands = importlib.import_module("ssmserve.client.session_commands")
        command = getattr(importlib.import_module(f"ssmserve.client.{module}"), name)
        commands.run(args, command)

    return handler


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


class _DeprecatedAlias(argparse.Action):
    """A hidden old spelling of a flag: stores into the new flag's dest and says so."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.instead = kwargs.pop("instead")
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"ssmserve: warning: {option_string} is deprecated; use {self.instead}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def file_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    help_text: str,
    *,
    required: bool = True,
    old: str = "",
    metavar: str = "FILE",
) -> None:
    """``--output``/``--input`` (dest ``output``/``input``), with ``old`` as a hidden,
    deprecated spelling that old scripts may still pass."""
    dest = flag.removeprefix("--")
    if not old:
        parser.add_argument(flag, required=required, type=Path, metavar=metavar, help=help_text)
        return
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument(flag, dest=dest, type=Path, metavar=metavar, help=help_text)
    group.add_argument(old, dest=dest, type=Path, action=_DeprecatedAlias, instead=flag)


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """The options that go before the command (the worker, TLS, the token)."""
    parser.add_argument(
        "--server",
        metavar="HOST[:PORT]",
        default=os.environ.get("SSMSERVE_SERVER") or None,
        help="the worker service commands talk to; port 50051 when none is given "
        "(env SSMSERVE_SERVER)",
    )
    for flag, what in (
        ("ca", "PEM CA to trust: talk TLS to the worker (env SSMSERVE_TLS_CA)"),
        ("cert", "PEM client certificate, for workers that require one (SSMSERVE_TLS_CERT)"),
        ("key", "PEM private key of --tls-cert (SSMSERVE_TLS_KEY)"),
    ):
        parser.add_argument(f"--tls-{flag}", type=Path, metavar="FILE", help=what)
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help="bearer token for workers that require one (env SSMSERVE_TOKEN, which keeps "
        "it out of the process list)",
    )


def add_service_commands(commands: Subparsers) -> None:
    """Every command that talks to a worker."""
    _add_session_commands(commands)
    _add_state_commands(commands)
    _add_model_commands(commands)
    _add_cluster_commands(commands)
    _add_top(commands)
    _add_plot(commands)


def _add_session_commands(commands: Subparsers) -> None:
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
        "--durability", choices=DURABILITIES, default=None,
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
        help="a guard rule, e.g. check=range,min=-3,max=3,action=rollback or "
        "check=prediction-error,tolerance=6,scale-floor=0.05,action=impute (repeatable)",
    )  # fmt: skip
    create.set_defaults(handler=_on_worker("create"))

    stream = sc.add_parser(
        "stream",
        help="stream every row of a .npy as the next steps",
        description="Send each row of --input as the session's next step and write the "
        "answers to --output. --output is checked before anything is sent; a failure "
        "part-way saves the answered outputs and prints the command that goes on.",
    )
    stream.add_argument("session_id", help="the session to step")
    file_flag(stream, "--input", "a .npy: one row per step", metavar="IN.npy")
    file_flag(stream, "--output", "the outputs, as .npy (written whole or, on a failure, "
              "the answered rows)", metavar="OUT.npy")  # fmt: skip
    stream.add_argument(
        "--first-step", type=positive_int, default=None, metavar="S",
        help="the step the first row is (default: the session's next step); rows of "
        "steps it already took are answered from its record (while it keeps them), not "
        "applied again",
    )  # fmt: skip
    stream.add_argument(
        "--steps-per-message", type=count, default=64, help="steps sent per message (64)"
    )
    stream.add_argument(
        "--last-only", action="store_true",
        help="only the last step's output is wanted (a prompt's next-token logits): each "
        "message asks for its last output only, the worker prefills its steps as one run, "
        "and --output holds one row, the last step's",
    )  # fmt: skip
    stream.add_argument(
        "--resume", action="store_true",
        help="go on with a stream that was cut (needs --first-step, the step of the first "
        "row): --output holds the outputs of its first answered rows; the rows after them "
        "are sent as the steps after them, and --output gets every row's output (with "
        "--last-only: from the session's next step)",
    )  # fmt: skip
    stream.set_defaults(handler=_on_worker("stream", "array_commands"))

    inspect = sc.add_parser("inspect", help="show a session")
    inspect.add_argument("session_id", help="the session to show")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(handler=_on_worker("inspect"))

    listing = sc.add_parser("list", help="list sessions")
    listing.add_argument("--model", default="", help="only sessions of this model")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(handler=_on_worker("list_sessions"))

    close = sc.add_parser("close", help="close a session")
    close.add_argument("session_id", help="the session to close")
    close.add_argument("--final-snapshot", action="store_true", help="keep it exportable")
    close.set_defaults(handler=_on_worker("close"))


def _add_state_commands(commands: Subparsers) -> None:
    snap = commands.add_parser("snapshot", help="take a snapshot now")
    snap.add_argument("session_id", help="the session to snapshot")
    snap.add_argument("--label", default="", help="a name to roll back to later")
    snap.set_defaults(handler=_on_worker("snapshot"))

    snaps = commands.add_parser("snapshots", help="list a session's snapshots")
    snaps.add_argument("session_id", help="the session")
    snaps.add_argument("--json", action="store_true", help="print JSON")
    snaps.set_defaults(handler=_on_worker("snapshots"))

    rollback = commands.add_parser("rollback", help="return a session exactly to an earlier step")
    rollback.add_argument("session_id", help="the session to roll back")
    target = rollback.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-step", type=count, metavar="T", help="back to step T")
    target.add_argument("--to-snapshot", metavar="ID", help="back to a snapshot")
    target.add_argument("--to-label", metavar="L", help="back to a labelled snapshot")
    target.add_argument("--back", type=count, metavar="N", help="N steps back")
    rollback.set_defaults(handler=_on_worker("rollback"))

    export = commands.add_parser("export", help="write a session's checkpoint to a file")
    export.add_argument("session_id", help="the session to export")
    file_flag(export, "--output", "the checkpoint file to write", old="--out")
    export.add_argument("--snapshot", default="", help="a snapshot id (default: current state)")
    export.add_argument("--json", action="store_true", help="print the result as JSON")
    export.set_defaults(handler=_on_worker("export"))

    imp = commands.add_parser("import", help="bring a checkpoint file back as a session")
    file_flag(imp, "--input", "a checkpoint file (ssmserve export)", old="--in")
    imp.add_argument("--session", default="", help="session id (default: the checkpoint's)")
    imp.add_argument("--model", default="", help="model name (default: by fingerprint)")
    imp.add_argument("--replace", action="store_true", help="overwrite an existing session")
    imp.add_argument("--json", action="store_true", help="print the new session as JSON")
    imp.set_defaults(handler=_on_worker("import_checkpoint"))

    forecast = commands.add_parser(
        "forecast", help="run a session's model ahead on its own outputs (session unchanged)"
    )
    forecast.add_argument("session_id", help="the session to forecast from")
    forecast.add_argument(
        "--horizon", required=True, type=positive_int, metavar="H", help="steps to run ahead"
    )
    forecast.add_argument("--at-step", type=count, metavar="T", help="default: current step")
    file_flag(forecast, "--output", "write the (H, output_dim) outputs here", required=False,
              metavar="OUT.npy")  # fmt: skip
    forecast.set_defaults(handler=_on_worker("forecast", "array_commands"))

    gen = commands.add_parser(
        "generate", help="a token model's session fed a prompt, then its own seeded draws"
    )
    gen.add_argument("session_id", help="the session to generate with")
    gen.add_argument("--max-tokens", required=True, type=positive_int, metavar="N",
                     help="tokens to generate at most (the prompt not counted)")  # fmt: skip
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="0 (default): greedy")  # fmt: skip
    gen.add_argument("--top-k", type=count, default=0, metavar="K", help="0 (default): all")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 (default): all")
    gen.add_argument("--min-p", type=float, default=0.0, metavar="M", help="0 (default): none")
    gen.add_argument("--seed", type=count, default=0, metavar="S", help="default 0")
    gen.add_argument("--stop", type=count, action="append", default=[], metavar="ID",
                     help="end after this token (repeatable)")  # fmt: skip
    cli_sampling.add_flags(gen)  # stop texts, EOS, penalties, logit bias, logprobs
    file_flag(gen, "--prompt-ids", "token ids (T,) fed first", required=False,
              metavar="IN.npy")  # fmt: skip
    gen.add_argument("--prompt", metavar="TEXT",
                     help="a text fed first (not with --prompt-ids), encoded by the model's "
                     "tokenizer.json")  # fmt: skip
    file_flag(gen, "--output", "write the generated ids (N,) int64 here", required=False,
              metavar="OUT.npy")  # fmt: skip
    gen.add_argument(
        "--at-step", type=count, metavar="T",
        help="the step the session was at before this generation, or at its last token "
        "received (default: its step now): tokens it generated past T with these settings "
        "are sent again from its log, then it goes on (how a cut generation goes on)",
    )  # fmt: skip
    gen.add_argument(
        "--append", action="store_true",
        help="add the generated ids after those already in --output (a cut generation "
        "gone on with)",
    )  # fmt: skip
    cli_constraints.add_flags(gen)  # constrained output, the text monitor
    gen.set_defaults(handler=_on_worker("generate", "array_commands"))

    fork = commands.add_parser("fork", help="branch a session at a step; prints the new id last")
    fork.add_argument("session_id", help="the session to branch")
    point = fork.add_mutually_exclusive_group(required=True)
    point.add_argument("--at-step", type=count, metavar="T", help="branch at step T")
    point.add_argument("--at-snapshot", metavar="ID", help="branch at a snapshot")
    point.add_argument("--at-label", metavar="L", help="branch at a labelled snapshot")
    fork.add_argument("--new-id", default="", help="the fork's session id (default: generated)")
    fork.add_argument("--target", default="", metavar="HOST:PORT", help="the worker to serve it")
    fork.set_defaults(handler=_on_worker("fork"))


def _add_model_commands(commands: Subparsers) -> None:
    models = commands.add_parser(
        "models", help="the models each live worker serves: versions and their sessions"
    )
    models.add_argument("--json", action="store_true", help="print JSON")
    models.set_defaults(handler=_on_worker("models"))
    upgrade = commands.add_parser(
        "upgrade", help="move a session to another version of its model (a replay of its inputs)"
    )
    upgrade.add_argument("session_id", help="the session to move")
    upgrade.add_argument(
        "--model", default="", metavar="NAME@VERSION", help="default: the newest version"
    )
    upgrade.add_argument("--json", action="store_true", help="print the result as JSON")
    upgrade.set_defaults(handler=_on_worker("upgrade"))
    load = commands.add_parser(
        "load-model", help="admin: a worker serves another model (version), no restart"
    )
    load.add_argument("key", metavar="NAME[@VERSION]", help="the model's name and version")
    load.add_argument("directory", help="its directory on the worker's host")
    load.add_argument("--worker", default="", metavar="HOST:PORT", help="default: --server")
    load.add_argument("--json", action="store_true", help="print the worker's models as JSON")
    load.set_defaults(handler=_on_worker("load_model"))
    unload = commands.add_parser(
        "unload-model", help="admin: a worker stops serving a model (no session may run it)"
    )
    unload.add_argument("key", metavar="NAME[@VERSION]", help="the model to stop serving")
    unload.add_argument("--worker", default="", metavar="HOST:PORT", help="default: --server")
    unload.add_argument("--json", action="store_true", help="print the worker's models as JSON")
    unload.set_defaults(handler=_on_worker("unload_model"))


def _add_cluster_commands(commands: Subparsers) -> None:
    workers = commands.add_parser("workers", help="list the live workers of the cluster")
    workers.add_argument("--json", action="store_true", help="print JSON")
    workers.set_defaults(handler=_on_worker("workers"))

    migrate = commands.add_parser("migrate", help="move a session to another worker")
    migrate.add_argument("session_id", help="the session to move")
    migrate.add_argument("--to", required=True, metavar="HOST:PORT", help="the target worker")
    migrate.add_argument("--json", action="store_true", help="print the result as JSON")
    migrate.set_defaults(handler=_on_worker("migrate"))

    drain = commands.add_parser(
        "drain", help="move every session off a worker (it then refuses new ones)"
    )
    drain.add_argument(
        "worker", nargs="?", default="", metavar="HOST:PORT", help="default: --server"
    )
    drain.add_argument(
        "--json", action="store_true", help="print each session's progress as a JSON line"
    )
    drain.set_defaults(handler=_on_worker("drain"))
    undrain = commands.add_parser("undrain", help="undo a drain: the worker serves again")
    undrain.add_argument(
        "worker", nargs="?", default="", metavar="HOST:PORT", help="default: --server"
    )
    undrain.set_defaults(handler=_on_worker("undrain"))


def _add_top(commands: Subparsers) -> None:
    top = commands.add_parser(
        "top", help="a live table of workers and their busiest sessions (q quits)"
    )
    top.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes"
    )
    top.add_argument(
        "--sessions", type=int, default=20, metavar="N", help="how many sessions to show"
    )
    top.add_argument("--once", action="store_true", help="print one table and exit")
    top.add_argument("--json", action="store_true", help="print one look as JSON and exit")
    top.set_defaults(handler=_on_worker("run", "top"))


def _add_plot(commands: Subparsers) -> None:
    plot = commands.add_parser(
        "plot", help="draw a session's inputs, outputs, snapshots, guard events and rollbacks"
    )
    plot.add_argument("session_id", help="the session to draw")
    file_flag(plot, "--output", "the PNG file to write", metavar="OUT.png")
    plot.add_argument("--from-step", type=int, default=0, metavar="T",
                      help="first step (default: the oldest it can replay)")  # fmt: skip
    plot.add_argument("--to-step", type=int, default=0, metavar="T",
                      help="last step (default: its current step)")  # fmt: skip
    plot.add_argument("--dims", type=int, default=8, metavar="N",
                      help="draw at most N input and output dimensions (default 8)")  # fmt: skip
    plot.set_defaults(handler=_on_worker("run", "plot"))
