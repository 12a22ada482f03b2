"""The sidecar's own metric registry: every signal of :mod:`sidecar.signals`, in one place.

Two kinds of series, chosen deliberately (as prometheus/client_python does):

* what the sidecar observes itself (lookups, hits, verifications, anomalies, drops, latency)
  is instrumented with Counter/Histogram/Gauge and updated as events arrive;
* what belongs to the engine (allocator totals, block counts, usage, fragmentation) is
  reported by :class:`AllocatorCollector` at scrape time from the latest snapshot, so the
  counters stay the engine's own totals and never drift from them.

No global registry: each :class:`Metrics` owns a fresh ``CollectorRegistry`` (tests build
their own and read values with ``registry.get_sample_value``). An optional OpenTelemetry
mirror (:mod:`sidecar.otel`) receives the same updates.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar import signals as S
from sidecar.protocol import AllocatorState
from sidecar.signals import BASE_LABELS, MetricType, Signal


def fragmentation_ratio(state: AllocatorState) -> float:
    """``1 - largest_free_run / free_blocks``: 0 when all free blocks are one run (or none
    are free), towards 1 when free space is scattered in runs too short to use."""
    if state.free_blocks <= 0:
        return 0.0
    return max(0.0, 1.0 - state.largest_free_run / state.free_blocks)


def internal_fragmentation_ratio(state: AllocatorState) -> float:
    """Unused token slots in blocks held by live sequences / allocated slots."""
    if state.allocated_slots <= 0:
        return 0.0
    return max(0.0, 1.0 - state.filled_slots / state.allocated_slots)


def usage_ratio(state: AllocatorState) -> float:
    return state.used_blocks / state.total_blocks if state.total_blocks else 0.0


class AllocatorCollector(Collector):
    """Exposes the latest :class:`AllocatorState` at scrape time (engine-owned state)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self._state: AllocatorState | None = None
        self._lock = threading.Lock()

    def update(self, state: AllocatorState | None) -> None:
        with self._lock:
            self._state = state

    @property
    def state(self) -> AllocatorState | None:
        with self._lock:
            return self._state

    def describe(self) -> Iterable[Metric]:
        return self._families(AllocatorState(0, 0, 0, 0, 0, 0, 0))

    def collect(self) -> Iterable[Metric]:
        state = self.state
        if state is None:
            state = AllocatorState(0, 0, 0, 0, 0, 0, 0)
        return self._families(state)

    def _families(self, st: AllocatorState) -> list[Metric]:
        names = list(self._labels)
        values = list(self._labels.values())
        out: list[Metric] = []
        for sig, value in ((S.ALLOCATIONS, st.allocations),
                           (S.ALLOCATION_FAILURES, st.allocation_failures)):
            c = CounterMetricFamily(sig.base_name, sig.help, labels=names)
            c.add_metric(values, float(value))
            out.append(c)
        ratios: tuple[tuple[Signal, float], ...] = (
            (S.USAGE_RATIO, usage_ratio(st)),
            (S.FRAGMENTATION_RATIO, fragmentation_ratio(st)),
            (S.INTERNAL_FRAGMENTATION_RATIO, internal_fragmentation_ratio(st)))
        for sig, ratio in ratios:
            g = GaugeMetricFamily(sig.name, sig.help, labels=names)
            g.add_metric(values, ratio)
            out.append(g)
        blocks = GaugeMetricFamily(S.BLOCKS.name, S.BLOCKS.help, labels=[*names, "state"])
        for state_name, value in (("total", st.total_blocks), ("free", st.free_blocks),
                                  ("cached", st.cached_blocks), ("used", st.used_blocks)):
            blocks.add_metric([*values, state_name], float(value))
        out.append(blocks)
        return out


# Signals the AllocatorCollector reports; everything else is instrumented directly.
COLLECTED = {S.ALLOCATIONS.name, S.ALLOCATION_FAILURES.name, S.USAGE_RATIO.name,
              S.FRAGMENTATION_RATIO.name, S.INTERNAL_FRAGMENTATION_RATIO.name, S.BLOCKS.name}


class Metrics:
    """All of the sidecar's series for one engine/model, on a registry of its own."""

    def __init__(self, engine: str, model: str,
                 registry: CollectorRegistry | None = None,
                 extra_signals: Iterable[Signal] = ()) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.base = {"engine": engine, "model": model}
        self._instruments: dict[str, Any] = {}
        self._children: dict[tuple[str, ...], Any] = {}
        self._mirrors: list[Any] = []
        self.allocator = AllocatorCollector(dict(self.base))
        self.registry.register(self.allocator)
        for sig in (*S.ALL_SIGNALS, *extra_signals):
            if sig.name not in COLLECTED:
                self._instruments[sig.name] = self._make(sig)
        self.gauge(S.BUILD_INFO, version=__version__).set(1)

    def _make(self, sig: Signal) -> Any:
        labels = [*BASE_LABELS, *sig.labels]
        if sig.type is MetricType.COUNTER:
            return Counter(sig.base_name, sig.help, labels, registry=self.registry)
        if sig.type is MetricType.HISTOGRAM:
            return Histogram(sig.name, sig.help, labels, registry=self.registry,
                             buckets=sig.buckets)
        return Gauge(sig.name, sig.help, labels, registry=self.registry)

    def _child(self, sig: Signal, labels: dict[str, str]) -> Any:
        # Children are cached: labels() costs a lock and a dict build on every call, and
        # the hot path updates a handful of fixed series.
        key = (sig.name, *(labels.get(k, "") for k in sig.labels))
        child = self._children.get(key)
        if child is None:
            missing = set(sig.labels) - set(labels)
            if missing:
                raise ValueError(f"{sig.name} needs labels {sorted(missing)}")
            inst = self._instruments[sig.name]
            child = inst.labels(**self.base, **{k: labels[k] for k in sig.labels})
            self._children[key] = child
        return child

    # The update surface: small, named by what happened.
    def inc(self, sig: Signal, amount: float = 1.0, **labels: str) -> None:
        self._child(sig, labels).inc(amount)
        for m in self._mirrors:
            m.inc(sig, amount, {**self.base, **labels})

    def observe(self, sig: Signal, value: float, **labels: str) -> None:
        self._child(sig, labels).observe(value)
        for m in self._mirrors:
            m.observe(sig, value, {**self.base, **labels})

    def gauge(self, sig: Signal, **labels: str) -> Any:
        return self._child(sig, labels)

    def add_mirror(self, mirror: Any) -> None:
        """Send every counter/histogram update to ``mirror`` too (OpenTelemetry)."""
        self._mirrors.append(mirror)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (0.0 when absent): for summaries and tests."""
        v = self.registry.get_sample_value(name, {**self.base, **labels})
        return float(v) if v is not None else 0.0

    def value_sum(self, name: str) -> float:
        """Sum of a family's samples named ``name`` over all label values."""
        return sum(v for v in self.by_label_all(name))

    def by_label_all(self, name: str) -> list[float]:
        return [sample.value for family in self.registry.collect()
                for sample in family.samples if sample.name == name]

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: total}`` of a labelled family, summed over other labels."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == name and label in sample.labels and sample.value:
                    key = sample.labels[label]
                    out[key] = out.get(key, 0.0) + sample.value
        return out
