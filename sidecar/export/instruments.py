"""The sidecar's one set of instruments: plain values updated on the hot path, read by the
exporters at scrape or export time.

Why not prometheus-client's Counter on the hot path: every ``inc`` there takes a lock and
goes through a child lookup (~0.5 us), and mirroring it into OpenTelemetry doubled that on the
engine's thread. Here an update is one attribute add on a :class:`Cell` (tens of ns); the
Prometheus collector (:class:`InstrumentsCollector`) and the OpenTelemetry exporter
(:mod:`sidecar.export.otel`) both read the same cells when they are asked, never on the engine's
thread.

Concurrency: each cell is updated by ``+=`` on an attribute, which CPython (with the GIL)
completes without a thread switch in between; readers may see a histogram mid-update (count
and buckets one observation apart), which the next scrape corrects. Label values are
bounded: a family keeps at most ``max_series`` label sets, and further ones are folded into
one ``_overflow`` series (counted in :attr:`Family.overflowed`), so a peer that invents label
values cannot grow memory or the exposition.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sidecar.signals import BASE_LABELS, MetricType, Signal

OVERFLOW = "_overflow"
DEFAULT_MAX_SERIES = 256


class Cell:
    """One counter or gauge series: a float updated in place."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value


class Hist:
    """One histogram series: per-bucket counts (the last is +Inf), sum and count."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), float(total)))
        return out

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile ``q`` (None when empty)."""
        total = self.count
        if not total:
            return None
        rank, seen = q * total, 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += n
            if seen >= rank:
                return bound
        return math.inf


class Family:
    """All series of one signal, keyed by the values of the signal's own labels."""

    def __init__(self, signal: Signal, max_series: int = DEFAULT_MAX_SERIES) -> None:
        self.signal = signal
        self.max_series = max_series
        self.series: dict[tuple[str, ...], Cell | Hist] = {}
        self.overflowed = 0
        if not signal.labels and signal.type is not MetricType.GAUGE:
            # Counters and histograms start at a visible zero (rate() needs a first point);
            # gauges appear once set, so "never set" is not confused with 0.
            self.child({})

    def child(self, labels: Mapping[str, str]) -> Any:
        """The series for ``labels`` (created at 0), folding excess label sets into one."""
        names = self.signal.labels
        try:
            key = tuple(str(labels[n]) for n in names)
        except KeyError:
            missing = sorted(set(names) - set(labels))
            raise ValueError(f"{self.signal.name} needs labels {missing}") from None
        s = self.series.get(key)
        if s is None:
            if len(self.series) >= self.max_series:
                self.overflowed += 1
                key = (OVERFLOW,) * len(names)
                s = self.series.get(key)
                if s is not None:
                    return s
            s = (Hist(self.signal.buckets) if self.signal.type is MetricType.HISTOGRAM
                 else Cell())
            self.series[key] = s
        return s

    def collect(self, base: Mapping[str, str]) -> Metric:
        sig = self.signal
        names = [*base, *sig.labels]
        values = list(base.values())
        fam: Any
        if sig.type is MetricType.COUNTER:
            fam = CounterMetricFamily(sig.base_name, sig.help, labels=names)
        elif sig.type is MetricType.HISTOGRAM:
            fam = HistogramMetricFamily(sig.name, sig.help, labels=names)
        else:
            fam = GaugeMetricFamily(sig.name, sig.help, labels=names)
        for key, s in list(self.series.items()):
            if isinstance(s, Hist):
                fam.add_metric([*values, *key], s.cumulative(), s.sum)
            else:
                fam.add_metric([*values, *key], s.value)
        return fam


class Instruments:
    """Every instrumented signal of one sidecar, with the base labels (engine, model)."""

    def __init__(self, signals: Iterable[Signal], base: Mapping[str, str]) -> None:
        if tuple(base) != BASE_LABELS:
            raise ValueError(f"base labels must be {BASE_LABELS}, got {tuple(base)}")
        self.base = dict(base)
        self.families: dict[str, Family] = {s.name: Family(s) for s in signals}

    def family(self, sig: Signal) -> Family:
        try:
            return self.families[sig.name]
        except KeyError:
            raise KeyError(f"signal {sig.name} is not registered on this sidecar") from None


class InstrumentsCollector(Collector):
    """Prometheus reads :class:`Instruments` at scrape time through this collector."""

    def __init__(self, instruments: Instruments) -> None:
        self.instruments = instruments

    def collect(self) -> Iterable[Metric]:
        base = self.instruments.base
        return [f.collect(base) for f in list(self.instruments.families.values())]

    def describe(self) -> Iterable[Metric]:
        return self.collect()
