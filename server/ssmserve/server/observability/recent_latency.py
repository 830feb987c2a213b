"""RecentLatency: percentiles of the most recent step latencies, for ``ssmserve top``.

Prometheus histograms answer "p99 over the last five minutes" on the Prometheus side; a
worker also reports a cheap figure of its own in its registry entry, so an operator
without Prometheus sees it too. Always on: one deque append per answered message.
"""

from __future__ import annotations

from collections import deque


class RecentLatency:
    def __init__(self, keep: int = 2048) -> None:
        self._seconds: deque[tuple[float, int]] = deque(maxlen=keep)  # (latency, steps)

    def add(self, seconds: float, steps: int) -> None:
        """A message of ``steps`` steps answered ``seconds`` after it arrived."""
        self._seconds.append((seconds, steps))

    def percentiles_ms(self, *quantiles: float) -> list[float]:
        """The step latency at each quantile (0..1), in ms, weighting messages by steps;
        0 when nothing was answered yet."""
        samples = sorted(self._seconds)
        total = sum(n for _, n in samples)
        if not total:
            return [0.0 for _ in quantiles]
        out = []
        for q in quantiles:
            want, seen = q * total, 0
            for seconds, n in samples:
                seen += n
                if seen >= want:
                    out.append(seconds * 1000)
                    break
        return out
