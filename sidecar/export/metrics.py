"""The sidecar's own metric registry: every signal of :mod:`sidecar.signals`, in one place.

Two kinds of series, chosen deliberately (as prometheus/client_python does):

* what the sidecar observes itself (lookups, hits, verifications, anomalies, drops, latency)
  is instrumented with Counter/Histogram/Gauge and updated as events arrive;
* what belongs to the engine (allocator totals, block counts, usage, fragmentation) is
  reported by :class:`AllocatorCollector` at scrape time from the latest snapshot, so the
  counters stay the engine's own totals and never drift from them.

No global registry: each :class:`Metrics` owns a fresh ``CollectorRegistry`` (tests build
their own and read values with ``registry.get_sample_value``). OpenTelemetry
(:mod:`sidecar.export.otel`) exports from the same registry: one set of instruments, two readers.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar import signals as S
from sidecar.core.protocol import AllocatorState
from sidecar.export.instruments import Cell, Family, Hist, Instruments, InstrumentsCollector
from sidecar.signals import Signal

log = logging.getLogger(__name__)


def fragmentation_ratio(state: AllocatorState) -> float | None:
    """``1 - largest_free_run / free_blocks``: 0 when all free blocks are one run (or none
    are free), towards 1 when free space is scattered in runs too short to use; ``None``
    when the engine does not report the two."""
    free, run = state.free_blocks, state.largest_free_run
    if free is None or run is None:
        return None
    if free <= 0:
        return 0.0
    return max(0.0, 1.0 - run / free)


def internal_fragmentation_ratio(state: AllocatorState) -> float | None:
    """Unused token slots in blocks held by live sequences / allocated slots."""
    allocated, filled = state.allocated_slots, state.filled_slots
    if allocated is None or filled is None:
        return None
    if allocated <= 0:
        return 0.0
    return max(0.0, 1.0 - filled / allocated)


def usage_ratio(state: AllocatorState) -> float | None:
    if state.used_blocks is None or not state.total_blocks:
        return None
    return state.used_blocks / state.total_blocks


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
        return self._families(AllocatorState())

    def collect(self) -> Iterable[Metric]:
        return self._families(self.state or AllocatorState())

    def _families(self, st: AllocatorState) -> list[Metric]:
        """Every family, with a sample only for what the engine reported (unknown is absent,
        never 0)."""
        names = list(self._labels)
        values = list(self._labels.values())
        out: list[Metric] = []
        for sig, count in ((S.ALLOCATIONS, st.allocations),
                           (S.ALLOCATION_FAILURES, st.allocation_failures)):
            c = CounterMetricFamily(sig.base_name, sig.help, labels=names)
            if count is not None:
                c.add_metric(values, float(count))
            out.append(c)
        ratios: tuple[tuple[Signal, float | None], ...] = (
            (S.USAGE_RATIO, usage_ratio(st)),
            (S.FRAGMENTATION_RATIO, fragmentation_ratio(st)),
            (S.INTERNAL_FRAGMENTATION_RATIO, internal_fragmentation_ratio(st)))
        for sig, ratio in ratios:
            g = GaugeMetricFamily(sig.name, sig.help, labels=names)
            if ratio is not None:
                g.add_metric(values, ratio)
            out.append(g)
        blocks = GaugeMetricFamily(S.BLOCKS.name, S.BLOCKS.help, labels=[*names, "state"])
        for state_name, n in (("total", st.total_blocks), ("free", st.free_blocks),
                              ("cached", st.cached_blocks), ("used", st.used_blocks)):
            if n is not None:
                blocks.add_metric([*values, state_name], float(n))
        out.append(blocks)
        return out


# Signals the AllocatorCollector reports; everything else is instrumented directly.
COLLECTED = {S.ALLOCATIONS.name, S.ALLOCATION_FAILURES.name, S.USAGE_RATIO.name,
              S.FRAGMENTATION_RATIO.name, S.INTERNAL_FRAGMENTATION_RATIO.name, S.BLOCKS.name}


class Metrics:
    """All of the sidecar's series for one engine/model, on a registry of its own.

    The values live in :class:`sidecar.export.instruments.Instruments` (plain cells the hot path
    updates in place); ``registry`` is a prometheus-client ``CollectorRegistry`` that reads
    them at scrape time, next to the engine-owned :class:`AllocatorCollector`, and it is the
    one registry every exporter reads (``/metrics``, OpenTelemetry push). ``value`` and
    ``by_label`` read the cells directly (for ``/status`` and the demo summary).
    """

    def __init__(self, engine: str, model: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.base = {"engine": engine, "model": model}
        self.instruments = Instruments((), self.base)
        self.register(S.core_signals())
        self.registry.register(InstrumentsCollector(self.instruments))
        self.allocator = AllocatorCollector(dict(self.base))
        self.registry.register(self.allocator)
        self._invalid_logged: set[str] = set()
        self.gauge(S.BUILD_INFO, version=__version__).set(1)

    def register(self, signals: Iterable[Signal]) -> None:
        """Add signals to this sidecar's registry (idempotent): the core's at start, an
        adapter's own (``signals.ADAPTER_SIGNALS``) when the adapter attaches."""
        fams = self.instruments.families
        for sig in signals:
            if sig.name not in COLLECTED and sig.name not in fams:
                fams[sig.name] = Family(sig)

    def cell(self, sig: Signal, **labels: str) -> Any:
        """The series itself (a :class:`Cell` or :class:`Hist`), for hot paths that update
        it in place: ``cell.value += 1`` costs an attribute add, no lookup."""
        return self.instruments.family(sig).child(labels)

    # The update surface: small, named by what happened.
    def inc(self, sig: Signal, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (>= 0, finite; anything else is refused and logged once: a counter
        never goes down or to NaN because a peer sent a bad number)."""
        if not 0.0 <= amount < math.inf:
            self._invalid(sig, amount)
            return
        self.instruments.family(sig).child(labels).value += amount

    def observe(self, sig: Signal, value: float, **labels: str) -> None:
        if not math.isfinite(value):
            self._invalid(sig, value)
            return
        self.instruments.family(sig).child(labels).observe(value)

    def gauge(self, sig: Signal, **labels: str) -> Any:
        return self.instruments.family(sig).child(labels)

    def _invalid(self, sig: Signal, amount: float) -> None:
        if sig.name not in self._invalid_logged:
            self._invalid_logged.add(sig.name)
            log.warning("refused update of %s by %r (not a finite, non-negative amount)",
                        sig.name, amount)

    # Reading the sidecar's own state (never prometheus-client's test API).
    def value(self, name: str, **labels: str) -> float:
        """Current value of one series (0.0 when absent): for summaries and tests."""
        fam, suffix = self._family_of(name)
        if fam is None:
            v = self.registry.get_sample_value(name, {**self.base, **labels})
            return float(v) if v is not None else 0.0
        try:
            key = tuple(str(labels[n]) for n in fam.signal.labels)
        except KeyError:
            return 0.0
        return _read(fam.series.get(key), suffix)

    def value_sum(self, name: str) -> float:
        """Sum of a family's series over all label values."""
        fam, suffix = self._family_of(name)
        if fam is None:
            return sum(sample.value for family in self.registry.collect()
                       for sample in family.samples if sample.name == name)
        return sum(_read(s, suffix) for s in list(fam.series.values()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: total}`` of a labelled family, summed over other labels (zero
        series left out)."""
        fam, suffix = self._family_of(name)
        out: dict[str, float] = {}
        if fam is None or label not in fam.signal.labels:
            return out
        i = fam.signal.labels.index(label)
        for key, s in list(fam.series.items()):
            v = _read(s, suffix)
            if v:
                out[key[i]] = out.get(key[i], 0.0) + v
        return out

    def _family_of(self, name: str) -> tuple[Family | None, str]:
        fams = self.instruments.families
        if name in fams:
            return fams[name], ""
        for suffix in ("_count", "_sum"):
            if name.endswith(suffix) and name[: -len(suffix)] in fams:
                return fams[name[: -len(suffix)]], suffix
        return None, ""


def _read(series: Cell | Hist | None, suffix: str) -> float:
    if series is None:
        return 0.0
    if isinstance(series, Hist):
        return float(series.count) if suffix != "_sum" else series.sum
    return series.value
