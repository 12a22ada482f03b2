"""OpenTelemetry receives the same signals as Prometheus, from the same updates."""

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from sidecar import signals as S
from sidecar.otel import OtelMirror
from tests.conftest import make_toy


def _points(reader):
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def test_otel_sees_the_same_counts_as_prometheus():
    engine, _, mon = make_toy()
    reader = InMemoryMetricReader()
    mirror = OtelMirror(mon.metrics, [reader])
    prompt = list(range(1, 17))
    engine.serve(prompt)
    last = engine.index[tuple(prompt)]
    engine.kv[last][0].zero_()
    engine.kv[last][1].zero_()
    mon.verify(engine.serve(prompt + [3]))
    mon.poll_allocator()
    pts = _points(reader)
    assert pts[S.LOOKUPS.base_name][0].value == mon.metrics.value(S.LOOKUPS.name) == 2
    anomalies = {p.attributes["kind"]: p.value for p in pts[S.ANOMALIES.base_name]}
    assert anomalies == {"zeros": 1}
    assert pts[S.REQUEST_LATENCY.name][0].count == 2
    assert S.USAGE_RATIO.name in pts
    thresholds = {p.attributes["threshold"]: p.value for p in pts[S.THRESHOLD.name]}
    assert thresholds["usage_ratio"] == S.THRESHOLDS.usage_ratio
    assert pts[S.LEAK_SUSPECTED_FLAG.name][0].value == 0
    assert pts[S.ALLOCATIONS.base_name][0].value == mon.metrics.value(S.ALLOCATIONS.name) > 0
    mirror.shutdown()
