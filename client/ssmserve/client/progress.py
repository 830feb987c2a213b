"""Progress bars for the CLI's long commands (export, import, drain), on stderr.

A bar is drawn only when stderr is a terminal (redrawn in place with ``\\r``); in a pipe or
a log nothing is drawn, so scripts see only the command's own output. ``--json`` output
goes to stdout and is never mixed with a bar.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, what: str, unit: str = "", stream: TextIO | None = None) -> None:
        self.what, self.unit = what, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self._drawn_at = 0.0

    def __call__(self, done: int, total: int) -> None:
        """``done`` of ``total`` (bytes, sessions); redrawn at most 10 times a second."""
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._drawn_at < 0.1:
            return
        self._drawn_at = now
        self.stream.write("\r" + self.line(done, total))
        self.stream.flush()

    def line(self, done: int, total: int, width: int = 30) -> str:
        share = done / total if total else 1.0
        filled = int(share * width)
        bar = "#" * filled + "-" * (width - filled)
        if self.unit == "bytes":
            amount = f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB"
        else:
            amount = f"{done}/{total}{' ' + self.unit if self.unit else ''}"
        return f"{self.what} [{bar}] {share:4.0%} {amount}"

    def close(self) -> None:
        """End the bar's line (when one was drawn)."""
        if self.enabled and self._drawn_at:
            self.stream.write("\n")
            self.stream.flush()
