"""OpenTelemetry export: the same signals, same names, read from the one registry.

There is one set of instruments (:mod:`sidecar.export.instruments`) and a prometheus-client
``CollectorRegistry`` that reads them (plus the engine-owned collectors) at collection
time. :class:`OtelExporter` is a second reader of that registry: at each export it walks the
registry once, converts every family to OpenTelemetry's data model (counters to cumulative
monotonic sums, gauges to gauges, histograms to explicit-bucket histograms with the same
bounds) and hands the batch to any OpenTelemetry ``MetricExporter`` (console, OTLP, or a
test's in-memory one). Nothing runs on the engine's thread; exporter failures are logged,
never raised into the caller.

OTel instruments are named without the Prometheus ``_total`` suffix (the OTel -> Prometheus
conversion adds it back), so dashboards see the same names either way.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from sidecar import __version__

log = logging.getLogger(__name__)

_CUMULATIVE = AggregationTemporality.CUMULATIVE


def to_metrics_data(registry: CollectorRegistry, resource: Resource,
                    start_ns: int) -> MetricsData:
    """Everything ``registry`` holds now, as one OpenTelemetry batch."""
    now = time.time_ns()
    metrics: list[Metric] = []
    for fam in registry.collect():
        data: Any
        if fam.type == "counter":
            points = [NumberDataPoint(dict(s.labels), start_ns, now, s.value)
                      for s in fam.samples if s.name.endswith("_total")]
            data = Sum(points, _CUMULATIVE, is_monotonic=True)
        elif fam.type == "histogram":
            data = Histogram(_histogram_points(fam.samples, start_ns, now), _CUMULATIVE)
        elif fam.type in ("gauge", "unknown", "info"):
            data = Gauge([NumberDataPoint(dict(s.labels), start_ns, now, s.value)
                          for s in fam.samples])
        else:
            continue
        if data.data_points:
            metrics.append(Metric(fam.name, fam.documentation, fam.unit or "", data))
    scope = InstrumentationScope("kv-sidecar", __version__)
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")])


def _histogram_points(samples: Any, start_ns: int, now: int) -> list[HistogramDataPoint]:
    """Prometheus histogram samples (cumulative ``_bucket{le}``, ``_sum``, ``_count``) of
    each label set, as OTel points with per-bucket counts."""
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        entry = series.setdefault(tuple(sorted(labels.items())),
                                  {"labels": labels, "buckets": [], "sum": 0.0, "count": 0})
        if s.name.endswith("_bucket"):
            entry["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_sum"):
            entry["sum"] = s.value
        elif s.name.endswith("_count"):
            entry["count"] = int(s.value)
    points = []
    for entry in series.values():
        buckets = sorted(entry["buckets"])
        counts, prev = [], 0.0
        for _, cumulative in buckets:
            counts.append(int(cumulative - prev))
            prev = cumulative
        bounds = [b for b, _ in buckets if not math.isinf(b)]
        points.append(HistogramDataPoint(entry["labels"], start_ns, now, entry["count"],
                                         entry["sum"], counts, bounds, math.nan, math.nan))
    return points


class OtelExporter:
    """Exports the registry through an OpenTelemetry ``MetricExporter`` every
    ``interval_s`` on a daemon thread (``start``), or on demand (``export_once``)."""

    def __init__(self, registry: CollectorRegistry, exporter: MetricExporter,
                 interval_s: float = 10.0,
                 resource_attributes: Mapping[str, str] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.registry = registry
        self.exporter = exporter
        self.interval_s = interval_s
        self.resource = Resource.create({"service.name": "kv-sidecar",
                                         "service.version": __version__,
                                         **(resource_attributes or {})})
        self._start_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.exports = 0
        self.failures = 0

    def collect(self) -> MetricsData:
        return to_metrics_data(self.registry, self.resource, self._start_ns)

    def export_once(self) -> bool:
        try:
            result = self.exporter.export(self.collect())
            ok = getattr(result, "name", "SUCCESS") == "SUCCESS"
        except Exception as exc:  # exporter trouble is logged, never raised
            log.warning("OpenTelemetry export failed: %s", exc)
            ok = False
        self.exports += 1
        self.failures += 0 if ok else 1
        return ok

    def start(self) -> OtelExporter:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvsidecar-otel",
                                            daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export_once()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, export once more (the final values), shut the exporter."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.export_once()
        try:
            self.exporter.shutdown()
        except Exception as exc:
            log.warning("OpenTelemetry shutdown failed: %s", exc)


def console_exporter() -> MetricExporter:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    return ConsoleMetricExporter()


def otlp_exporter(endpoint: str) -> MetricExporter:
    """OTLP/HTTP push; needs the optional ``opentelemetry-exporter-otlp-proto-http``."""
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    except ImportError as exc:
        raise RuntimeError("OTLP export needs `pip install opentelemetry-exporter-otlp-proto-http`"
                           ) from exc
    return OTLPMetricExporter(endpoint=endpoint)
