"""Logs: plain text for people, or one JSON object per line for machines.

``--log-format json`` writes each record as one line with ``time`` (UTC, ISO 8601),
``level``, ``logger``, ``message``, ``worker_id``, and, when the record is about a
session, ``session_id``, ``tenant`` (the part of the id before ``~``), ``step``,
``token`` (the fencing token) and ``event``. Events are the lines that matter to an
operator, one each: ``created``, ``rolled_back``, ``migrated``, ``taken_over``,
``fenced``, ``dropped``, ``evicted``, ``closed``. Nothing is logged per step at INFO.

Call sites pass the fields as ``extra={...}``; the text format ignores them (the message
already says it).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

#: Record attributes copied into a JSON line when a call site set them.
FIELDS = (
    "event", "session_id", "tenant", "step", "token", "model", "reason", "cause", "target",
    "previous_owner",
)  # fmt: skip


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self.worker_id = ""  # set once the worker has one (``configure``'s caller)

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        line: dict[str, Any] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker_id:
            line["worker_id"] = self.worker_id
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        session_id = line.get("session_id")
        if "tenant" not in line and isinstance(session_id, str) and "~" in session_id:
            line["tenant"] = session_id.split("~", 1)[0]
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


def configure(level: str, log_format: str) -> JsonFormatter | None:
    """Set up the root logger; the JSON formatter, if chosen, to give a worker id later."""
    handler = logging.StreamHandler()
    formatter: JsonFormatter | None = None
    if log_format == "json":
        formatter = JsonFormatter()
        handler.setFormatter(formatter)
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return formatter
