"""What Generate's ``constraint`` and ``monitor`` take, built from plain values.

``constraint=json_schema({...})`` holds a generation to a JSON schema (``regex``,
``lark_grammar`` and ``json_object`` likewise); ``monitor=text_monitor(regex=...)`` checks
the text after each token and retracts what it rejects (api.md, "Constrained output").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ssmserve.v1 import ssmserve_pb2 as pb


def json_schema(schema: Mapping[str, Any] | str) -> pb.Constraint:
    """A JSON schema (a dict, or its JSON text): the output is a compact JSON document."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return pb.Constraint(json_schema=text)


def regex(pattern: str) -> pb.Constraint:
    """A regex (Rust ``regex`` syntax) the whole output matches."""
    return pb.Constraint(regex=pattern)


def lark_grammar(grammar: str) -> pb.Constraint:
    """A Lark grammar (``start: ...``) as llguidance reads it."""
    return pb.Constraint(lark_grammar=grammar)


def json_object() -> pb.Constraint:
    """Any JSON object."""
    return pb.Constraint(json_object=True)


def text_monitor(
    *,
    regex: str | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
    rollback_tokens: int = 1,
    max_retries: int | None = None,
) -> pb.TextMonitor:
    """A check of the output text after every token (give ``regex`` or ``json_schema``):
    a rejected token rolls the session back ``rollback_tokens`` tokens and generation
    resamples from there, at most ``max_retries`` times (None: the server's default, 8)."""
    if (regex is None) == (json_schema is None):
        raise ValueError("text_monitor takes exactly one of regex, json_schema")
    monitor = pb.TextMonitor(rollback_tokens=rollback_tokens)
    if regex is not None:
        monitor.regex = regex
    else:
        assert json_schema is not None
        schema = json_schema
        monitor.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    if max_retries is not None:
        monitor.max_retries = max_retries
    return monitor
