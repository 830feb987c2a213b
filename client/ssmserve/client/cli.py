"""``ssmserve``: the user and operator command line.

Every command's parser names what runs it: a ``handler(args)`` default
(``set_defaults(handler=...)``), which :func:`main` calls. The service commands
(``--server HOST[:PORT]`` goes before the command, or ``SSMSERVE_SERVER`` in the
environment) are parsed by ``cli_parsers`` and run by ``session_commands``. Other
installed distributions add commands through the ``ssmserve.cli`` entry-point group:
each entry is a callable that gets the CLI's subparsers and adds its commands there, each
with its handler. The server adds ``ssmserve model ...`` and ``ssmserve auth ...`` that
way, so a client-only install never imports it.

Starting fast: parsing imports argparse alone, and a command's code (gRPC, numpy; the
engine for a server command) is imported only when it runs. The installed
distributions are searched for plugin commands only when the command word is not one
of this distribution's (``--help``, a server command, a typo): that search reads every
installed package's metadata.

Any failure prints one line on stderr and exits with code 2 (130 on Ctrl-C):
``ssmserve: error: CODE (REASON): message`` for an error a worker answered (the gRPC
status code, and the ``ErrorInfo`` reason when there is one), ``ssmserve: error:
message`` for a local one (a bad file or flag), never a traceback (``SSMSERVE_DEBUG=1``
adds it). A command that writes a file checks it can before it asks a worker for
anything; one cut part-way saves what was answered and says where to go on from.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from ssmserve.client import cli_parsers
from ssmserve.client.cli_errors import describe

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # what a shell shows for a command SIGPIPE ended
PLUGIN_GROUP = "ssmserve.cli"
#: Commands the server distribution adds: named here so that a client-only install can
#: say where they come from instead of argparse's bare "invalid choice".
SERVER_COMMANDS = ("auth", "model")
SERVER_MISSING = (
    "the server distribution (ssmserve), which is not installed here; install it beside "
    "the client from a clone of the repository: pip install ./client ."
)

log = logging.getLogger(__name__)


class _StderrNotes(logging.Handler):
    """The client library's warnings (a wait for a takeover, a broken plugin) as
    ``ssmserve: message`` lines on stderr: whatever ``sys.stderr`` is when one comes."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"ssmserve: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:  # a note must never fail the command
            self.handleError(record)


def _show_client_notes() -> None:
    """Print the client's warnings on stderr, once per process (``main`` may run again)."""
    client_log = logging.getLogger("ssmserve.client")
    if not any(isinstance(h, _StderrNotes) for h in client_log.handlers):
        client_log.addHandler(_StderrNotes(logging.WARNING))


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error told in one line like every other failure (and where
    to read the usage); its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"ssmserve: error: {message} (see {self.prog} --help)\n")


def build_parser(plugins: bool = True) -> argparse.ArgumentParser:
    """The whole command line; ``plugins=False`` leaves out the commands of other
    distributions (no search of the installed packages)."""
    parser, commands = _service_parser()
    if plugins:
        _add_plugin_commands(parser, commands)
    return parser


def _service_parser() -> tuple[argparse.ArgumentParser, cli_parsers.Subparsers]:
    """The command line with this distribution's commands, and its subparsers."""
    parser = OneLineParser(
        prog="ssmserve", description="Streaming inference-state server for SSM models."
    )
    cli_parsers.add_global_options(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_parsers.add_service_commands(commands)
    return parser, commands


def _add_plugin_commands(parser: argparse.ArgumentParser, commands: cli_parsers.Subparsers) -> None:
    """The commands of the other installed distributions (a search of their metadata)."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            add_commands = entry.load()
        except Exception as exc:  # a broken plugin must not take the service commands down
            log.warning("commands %r unavailable: %s", entry.name, exc)
            continue
        add_commands(commands)
    missing = [c for c in SERVER_COMMANDS if c not in commands.choices]
    if missing:
        parser.epilog = f"{' and '.join(missing)} are commands of {SERVER_MISSING}"


def command_word(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (after the global options), or None (``--help``, none,
    or options argparse will refuse anyway)."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    cli_parsers.add_global_options(pre)
    pre.add_argument("command", nargs="?")
    pre.add_argument("rest", nargs=argparse.REMAINDER)
    try:
        known, _ = pre.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):
        return None
    return known.command


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's core logs each failed TLS handshake, say, on stderr; the error line says it.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    _show_client_notes()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_word(argv)
    parser, commands = _service_parser()
    if command not in commands.choices:  # --help, a plugin's command, a typo
        _add_plugin_commands(parser, commands)
    if command in SERVER_COMMANDS and command not in commands.choices:
        print(f"ssmserve: error: '{command}' is a command of {SERVER_MISSING}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    try:
        args.handler(args)
        return 0
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ssmserve ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # every failure is one line; a traceback only when asked
        if os.environ.get("SSMSERVE_DEBUG"):
            traceback.print_exc()
        print(f"ssmserve: error: {describe(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
