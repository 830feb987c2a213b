"""``ssmserve``: the user and operator command line.

The service commands (``--server HOST:PORT`` goes before the command) live in
``session_commands``. Other installed distributions add commands through the
``ssmserve.cli`` entry-point group: each entry is a callable that gets the CLI's
subparsers and adds its commands there, each with a ``handler(args)`` default. The
server adds ``ssmserve model ...`` that way, so a client-only install never imports it.

Any failure prints one line on stderr and exits with code 2: ``ssmserve: error: CODE
(REASON): message`` for an error a worker answered (the gRPC status code, and the
``ErrorInfo`` reason when there is one), ``ssmserve: error: message`` for a local one
(a bad file or flag). Nothing is written unless the command succeeds.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

from ssmserve.client import session_commands
from ssmserve.client.errors import CliError, SsmserveClientError
from ssmserve.client.tls import TlsConfigError

EXIT_USAGE = 2
PLUGIN_GROUP = "ssmserve.cli"

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssmserve", description="Streaming inference-state server for SSM models."
    )
    parser.add_argument(
        "--server", metavar="HOST:PORT", help="worker to talk to (service commands)"
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    session_commands.add_parsers(commands)
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            add_commands = entry.load()
        except Exception as exc:  # a broken plugin must not take the service commands down
            log.warning("ssmserve: commands %r unavailable: %s", entry.name, exc)
            continue
        add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        handler = getattr(args, "handler", None)
        if handler is not None:
            handler(args)
        else:
            session_commands.run(args)
        return 0
    except SsmserveClientError as exc:
        # The status code (and reason) first, so people and scripts can tell failures apart.
        reason = f" ({exc.reason})" if exc.reason else ""
        print(f"ssmserve: error: {exc.code.name}{reason}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CliError, TlsConfigError) as exc:
        print(f"ssmserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
