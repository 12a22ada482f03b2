"""OpenTelemetry export: the same signals, same names, pushed through an OTel MeterProvider.

One set of updates feeds both worlds: :class:`OtelMirror` is registered on
:class:`sidecar.metrics.Metrics` and receives every counter increment and histogram
observation the Prometheus registry gets; every gauge signal
is an observable gauge read from the same registry at collection time. Readers
are the SDK's: ``PeriodicExportingMetricReader`` for push (console, or OTLP when
``opentelemetry-exporter-otlp`` is installed), ``InMemoryMetricReader`` in tests. Exporter
failures are the SDK's to log; nothing here raises into the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from sidecar import __version__
from sidecar import signals as S
from sidecar.metrics import COLLECTED, Metrics
from sidecar.signals import MetricType, Signal

log = logging.getLogger(__name__)


def _otel_name(sig: Signal) -> str:
    # OTel instruments are named without the Prometheus `_total` suffix; the OTel ->
    # Prometheus conversion adds it back, so dashboards see the same names.
    return sig.base_name


class OtelMirror:
    """Receives :class:`Metrics` updates and records them on OTel instruments."""

    def __init__(self, metrics: Metrics, readers: Iterable[MetricReader]) -> None:
        views = [View(instrument_name=_otel_name(s),
                      aggregation=ExplicitBucketHistogramAggregation(list(s.buckets)))
                 for s in S.ALL_SIGNALS if s.type is MetricType.HISTOGRAM]
        self.provider = MeterProvider(
            metric_readers=list(readers), views=views,
            resource=Resource.create({"service.name": "kv-sidecar",
                                      "service.version": __version__}))
        meter = self.provider.get_meter("kv-sidecar", __version__)
        self._instruments: dict[str, Any] = {}
        self._metrics = metrics
        for sig in S.ALL_SIGNALS:
            if sig.type is MetricType.COUNTER and sig.name in COLLECTED:
                # Engine-owned totals (allocations): observed from the engine's snapshot.
                meter.create_observable_counter(_otel_name(sig), [self._registry_cb(sig)],
                                                description=sig.help)
            elif sig.type is MetricType.COUNTER:
                self._instruments[sig.name] = meter.create_counter(_otel_name(sig),
                                                                   description=sig.help)
            elif sig.type is MetricType.HISTOGRAM:
                self._instruments[sig.name] = meter.create_histogram(
                    _otel_name(sig), unit="s", description=sig.help)
        # Gauges are state, not events: one observable gauge per gauge signal reads the
        # same registry Prometheus scrapes (engine-owned collectors included).
        for sig in S.ALL_SIGNALS:
            if sig.type is MetricType.GAUGE:
                meter.create_observable_gauge(_otel_name(sig), [self._registry_cb(sig)],
                                              description=sig.help)
        metrics.add_mirror(self)

    def _registry_cb(self, sig: Signal) -> Any:
        def cb(options: CallbackOptions) -> Iterable[Observation]:
            for family in self._metrics.registry.collect():
                for sample in family.samples:
                    if sample.name == sig.name:
                        yield Observation(sample.value, dict(sample.labels))
        return cb

    def inc(self, sig: Signal, amount: float, labels: dict[str, str]) -> None:
        inst = self._instruments.get(sig.name)
        if inst is not None and amount:
            inst.add(amount, labels)

    def observe(self, sig: Signal, value: float, labels: dict[str, str]) -> None:
        inst = self._instruments.get(sig.name)
        if inst is not None:
            inst.record(value, labels)

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception as exc:  # exporter trouble is logged, never raised
            log.warning("OpenTelemetry shutdown failed: %s", exc)


def console_reader(interval_s: float = 10.0) -> MetricReader:
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )
    return PeriodicExportingMetricReader(ConsoleMetricExporter(),
                                         export_interval_millis=interval_s * 1000)


def otlp_reader(endpoint: str, interval_s: float = 10.0) -> MetricReader:
    """OTLP/HTTP push; needs the optional ``opentelemetry-exporter-otlp-proto-http``."""
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    except ImportError as exc:
        raise RuntimeError("OTLP export needs `pip install opentelemetry-exporter-otlp-proto-http`"
                           ) from exc
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint),
                                         export_interval_millis=interval_s * 1000)
