"""The engine's knobs read from the environment (thread counts, heap thresholds): each one
checked the same way, so a bad value names the variable and the range it must be in
instead of failing somewhere inside ``int()``."""

from __future__ import annotations

import os


def env_int(name: str, default: int, low: int, high: int) -> int:
    """``$name`` as an integer in ``[low, high]``, or ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value
