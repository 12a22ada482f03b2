"""OpenTelemetry receives the same signals as Prometheus, read from the same registry."""

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

from sidecar import signals as S
from sidecar.export.otel import OtelExporter
from tests.conftest import make_toy


class Captured(MetricExporter):
    """An OTel exporter that keeps what it is handed (the SDK's own data model)."""

    def __init__(self):
        super().__init__()
        self.batches = []
        self.shut = False

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        self.shut = True


def _points(exporter):
    out = {}
    data = exporter.batches[-1]
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def test_otel_sees_the_same_counts_as_prometheus():
    engine, _, mon = make_toy()
    exporter = Captured()
    otel = OtelExporter(mon.metrics.registry, exporter, interval_s=60)
    prompt = list(range(1, 17))
    engine.serve(prompt)
    last = engine.index[tuple(prompt)]
    engine.kv[last][0].zero_()
    engine.kv[last][1].zero_()
    mon.verify(engine.serve(prompt + [3]))
    mon.poll_allocator()
    otel.shutdown()  # the final export carries the values as they are now
    assert exporter.shut
    pts = _points(exporter)
    assert pts[S.LOOKUPS.base_name][0].value == mon.metrics.value(S.LOOKUPS.name) == 2
    anomalies = {p.attributes["kind"]: p.value for p in pts[S.ANOMALIES.base_name] if p.value}
    assert anomalies == {"zeros": 1}
    latency = pts[S.REQUEST_LATENCY.name][0]
    assert latency.count == 2 == sum(latency.bucket_counts)
    assert list(latency.explicit_bounds) == list(S.REQUEST_LATENCY.buckets)
    assert S.USAGE_RATIO.name in pts
    thresholds = {p.attributes["threshold"]: p.value for p in pts[S.THRESHOLD.name]}
    assert thresholds["usage_ratio"] == S.THRESHOLDS.usage_ratio
    assert pts[S.LEAK_SUSPECTED_FLAG.name][0].value == 0
    assert pts[S.ALLOCATIONS.base_name][0].value == mon.metrics.value(S.ALLOCATIONS.name) > 0


def test_otel_export_failure_is_logged_not_raised():
    class Broken(Captured):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            raise ConnectionError("collector down")

    _, _, mon = make_toy()
    otel = OtelExporter(mon.metrics.registry, Broken(), interval_s=60)
    assert otel.export_once() is False
    otel.shutdown()
    assert otel.failures == 2
