"""``ssmserve generate``'s constrained output and text monitor: its flags, the options they
give ``generate``, and the text a retraction may still withdraw held back.

Only argparse at import (``cli_parsers`` imports this to build the parser); the request
messages are built once the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

#: Characters a schema or grammar file may hold (the server's limit on a constraint).
MAX_FILE_CHARS = 65_536


def add_flags(gen: argparse.ArgumentParser) -> None:
    """The constraint flags (one at most) and the text monitor's."""
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, metavar="FILE",
                       help="the output is a JSON document valid under this JSON schema "
                       "(compact JSON; a model with a tokenizer)")  # fmt: skip
    shape.add_argument("--regex", metavar="RE", help="the output matches this regex")
    shape.add_argument("--grammar", type=Path, metavar="FILE",
                       help="the output is a sentence of this Lark grammar")  # fmt: skip
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    check = gen.add_mutually_exclusive_group()
    check.add_argument("--monitor-regex", metavar="RE",
                       help="after each token the text must still be able to match RE; a "
                       "token that cannot is withdrawn and drawn again")  # fmt: skip
    check.add_argument("--monitor-json-schema", type=Path, metavar="FILE",
                       help="after each token the text must be a prefix of a document "
                       "valid under this schema (complete where it ends)")  # fmt: skip
    gen.add_argument("--monitor-rollback", type=int, default=1, metavar="N",
                     help="tokens a rejection takes back (default 1)")  # fmt: skip
    gen.add_argument("--monitor-retries", type=int, default=None, metavar="N",
                     help="rejections before it ends (default: the server's, 8)")  # fmt: skip


def options(args: argparse.Namespace) -> dict[str, Any]:
    """``generate``'s ``constraint`` and ``monitor`` from the flags (files read here)."""
    from ssmserve.client import constraints

    found: dict[str, Any] = {}
    if args.json_schema is not None:
        found["constraint"] = constraints.json_schema(_read(args.json_schema, "--json-schema"))
    elif args.regex is not None:
        found["constraint"] = constraints.regex(args.regex)
    elif args.grammar is not None:
        found["constraint"] = constraints.lark_grammar(_read(args.grammar, "--grammar"))
    elif args.json_object:
        found["constraint"] = constraints.json_object()
    if args.monitor_regex is not None or args.monitor_json_schema is not None:
        schema = None
        if args.monitor_json_schema is not None:
            schema = _read(args.monitor_json_schema, "--monitor-json-schema")
        found["monitor"] = constraints.text_monitor(
            regex=args.monitor_regex, json_schema=schema,
            rollback_tokens=args.monitor_rollback, max_retries=args.monitor_retries,
        )  # fmt: skip
    return found


def _read(path: Path, flag: str) -> str:
    from ssmserve.client.cli_errors import CliError

    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{flag}: cannot read {path} ({exc})") from None
    if len(text) > MAX_FILE_CHARS:
        raise CliError(f"{flag}: {path} holds {len(text)} characters, over {MAX_FILE_CHARS}")
    return text


class HeldText:
    """Texts printed once no retraction can withdraw them. A monitor that rolls back one
    token withdraws none that was sent (the rejected one never is); one that rolls back
    more can, and rejections in a row walk back further each time, so its text waits for
    the end."""

    def __init__(self, args: argparse.Namespace) -> None:
        monitored = args.monitor_regex is not None or args.monitor_json_schema is not None
        self.hold_all = monitored and args.monitor_rollback > 1
        self.pending: list[tuple[int, str]] = []

    def push(self, step: int, text: str, retracted_after: int | None) -> str:
        """The text now safe to print, after the token of ``step``."""
        if retracted_after is not None:
            self.pending = [p for p in self.pending if p[0] <= retracted_after]
        self.pending.append((step, text))
        return "" if self.hold_all else self.flush()

    def flush(self) -> str:
        out, self.pending = self.pending, []
        return "".join(t for _, t in out)
