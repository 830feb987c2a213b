"""Counters and histograms written by one thread without locks, read at scrape time.

Why not prometheus-client's ``Counter`` and ``Histogram``: they take a lock on every
update, and a histogram walks its buckets one by one, about 3 us per observation; at one
observation per step that measured 5-10% of a worker's throughput
(``bench/bench_metrics.py``). Every update here comes from the worker's event loop, one
thread, so no lock is needed: an update is a bisect and a few integer additions, and a
histogram can count ``n`` steps of the same latency at once. The scrape runs on the HTTP
server's thread and copies each child's numbers (a list copy is atomic under the GIL);
a scrape may see one update half applied (a bucket counted, the sum not yet), which
Prometheus tolerates as it does any scrape between two updates.

Update these only from the event loop thread.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class LoopCounter:
    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name, self.doc, self.label_names = name.removesuffix("_total"), doc, tuple(labels)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        self._default = self.labels() if not labels else None

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.label_names):
                raise ValueError(f"{self.name} takes labels {self.label_names}, got {values}")
            child = self._children[values] = CounterChild()
        return child

    def inc(self, amount: float = 1) -> None:
        assert self._default is not None, f"{self.name} has labels: use .labels(...)"
        self._default.value += amount

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.label_names)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        return family


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class LoopHistogram:
    def __init__(
        self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name, self.doc, self.label_names = name, doc, tuple(labels)
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        self._default = self.labels() if not labels else None

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.label_names):
                raise ValueError(f"{self.name} takes labels {self.label_names}, got {values}")
            child = self._children[values] = HistogramChild(self.bounds)
        return child

    def observe(self, value: float, count: int = 1) -> None:
        assert self._default is not None, f"{self.name} has labels: use .labels(...)"
        self._default.observe(value, count)

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.label_names)
        edges = [*(repr(b) for b in self.bounds), "+Inf"]
        for values, child in list(self._children.items()):
            counts, total = list(child.counts), child.total
            cumulative, running = [], 0
            for edge, n in zip(edges, counts, strict=True):
                running += n
                cumulative.append((edge, running))
            family.add_metric(list(values), cumulative, total)
        return family


class HistogramChild:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one +Inf
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` (the steps of one message, say)."""
        if math.isnan(value):
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count


class LoopMetricsCollector(Collector):
    """Exports a set of loop counters and histograms (registered once per registry)."""

    def __init__(self, metrics: Sequence[LoopCounter | LoopHistogram]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield metric.collect()
