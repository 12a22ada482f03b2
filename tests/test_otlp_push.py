"""Issue 13 item 2: every signal and one span per verification over OTLP/HTTP protobuf, seen
by a real receiver on 127.0.0.1 that decodes the payloads with opentelemetry-proto."""

from __future__ import annotations

import json
import time

import pytest
from kvtestbed.demo import DemoOptions, build
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive

from sidecar import signals as S
from sidecar.cli.main import main
from sidecar.export.otel_push import (
    SPAN_ATTRIBUTES,
    SPAN_NAME,
    OtlpPush,
    parse_endpoint,
    start_otlp_push,
)
from tests.otlp_receiver import OtlpReceiver  # opentelemetry-proto: the dev/otlp extras

# Every feature on (scrub, quarantine, breaker), so every family has something to say.
ALL_ON = {"scrub": True, "scrub_every_s": 0.1, "scrub_jitter_s": 0.0, "scrub_idle_s": 0.0,
          "quarantine": True, "breaker": True}


def _otel_name(sig: S.Signal) -> str:
    return sig.base_name  # OTel counters carry no _total (the Prometheus bridge adds it)


def test_receiver_sees_every_metric_family_and_one_span_per_verification() -> None:
    # premature-free: anomalies, drops, invariant violations; calibration: noise-floor gauges
    engine, mon = build(DemoOptions(fault="premature-free", sample_every=2, port=0,
                                    progress=False, num_blocks=64,
                                    sidecar={"calibration_samples": 4, **ALL_ON}))
    verdicts = []
    with OtlpReceiver() as rx:
        push = start_otlp_push(mon, rx.url, interval_s=0.3)
        mon.reporter.listeners.append(verdicts.append)
        mon.start()
        try:
            drive(engine, ChatWorkload(WorkloadConfig(seed=0, conversations=20,
                                                      block_size=engine.block_size)),
                  max_requests=60)
            mon.drain(timeout_s=60)
            mon.poll_allocator()
            time.sleep(0.4)  # at least one periodic push besides the final one
        finally:
            mon.stop()
            push.shutdown()
        got = rx.metrics()
        spans = rx.spans()
        assert len(rx.requests["/v1/metrics"]) >= 2
        assert rx.content_types == {"application/x-protobuf"}

    missing = [s.name for s in S.core_signals() if _otel_name(s) not in got]
    assert missing == []
    # the values are the registry's, not a second set of instruments
    lookups = got[S.LOOKUPS.base_name].sum
    assert lookups.is_monotonic and lookups.data_points[0].as_int == 0
    assert lookups.data_points[0].as_double == mon.metrics.value(S.LOOKUPS.name) > 0
    anomalies = {dict((a.key, a.value.string_value) for a in p.attributes)["kind"]: p.as_double
                 for p in got[S.ANOMALIES.base_name].sum.data_points if p.as_double}
    assert anomalies == mon.metrics.by_label(S.ANOMALIES.name, "kind")
    assert sum(anomalies.values()) > 0
    latency = got[S.REQUEST_LATENCY.name].histogram.data_points[0]
    assert list(latency.explicit_bounds) == list(S.REQUEST_LATENCY.buckets)
    assert latency.count == 60 == sum(latency.bucket_counts)

    # one span per verification, the documented attributes only (never token content)
    assert len(spans) == len(verdicts) > 0
    assert {s.name for s, _ in spans} == {SPAN_NAME}
    for span, attrs in spans:
        assert set(attrs) == set(SPAN_ATTRIBUTES)
        assert isinstance(attrs["kvsidecar.tokens"], int)
        assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(
            attrs["kvsidecar.duration_s"] * 1e9, abs=2e3)
        assert (span.status.code == 2) == (attrs["kvsidecar.verdict"] == "anomalous")
    by_verdict: dict[str, int] = {}
    for _, attrs in spans:
        by_verdict[attrs["kvsidecar.verdict"]] = by_verdict.get(attrs["kvsidecar.verdict"],
                                                                 0) + 1
    assert by_verdict.get("anomalous", 0) == sum(1 for v in verdicts if v.findings) > 0
    kinds = {k for _, a in spans for k in a["kvsidecar.anomaly_kinds"]}
    assert kinds == {f.kind.value for v in verdicts for f in v.findings}
    tokens = {tuple(v.sample.hit.tokens[: v.sample.hit.hit_tokens]) for v in verdicts}
    for _, attrs in spans:
        for value in attrs.values():
            assert not (isinstance(value, list) and len(value) > 4 and tuple(value) in tokens)


def test_demo_flag_pushes_to_the_receiver(capsys) -> None:
    with OtlpReceiver() as rx:
        rc = main(["demo", "--requests", "16", "--quiet", "--port", "0", "--json",
                   "--otlp-endpoint", rx.url, "--otlp-interval", "0.5"])
        out = capsys.readouterr()
        assert rc == 0, out.err[-3000:]
        summary = json.loads(out.out)
        got = rx.metrics()
        spans = rx.spans()
    assert got[S.LOOKUPS.base_name].sum.data_points[0].as_double == summary["lookups"] == 16
    assert len(spans) >= 1
    assert {r.get("service.name") for r in rx.resources()} == {"kv-sidecar"}


@pytest.mark.parametrize("bad", ["ftp://127.0.0.1:4318", "127.0.0.1:4318",
                                 "http://127.0.0.1:99999", "http://127.0.0.1:4318/?x=1"])
def test_bad_endpoint_is_a_usage_error(bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--otlp-endpoint", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--otlp-endpoint" in err and "OTLP endpoint" in err


def test_grpc_endpoint_with_a_path_is_a_usage_error(capsys) -> None:
    assert main(["demo", "--otlp-protocol", "grpc", "--otlp-endpoint",
                 "http://127.0.0.1:4317/v1/metrics/x"]) == 2
    assert "host:port" in capsys.readouterr().err


def test_endpoint_paths() -> None:
    assert parse_endpoint("http://127.0.0.1:4318/") == "http://127.0.0.1:4318"
    assert parse_endpoint("http://127.0.0.1:4318/v1/metrics") == "http://127.0.0.1:4318"
    assert parse_endpoint("https://127.0.0.1/otlp") == "https://127.0.0.1/otlp"


def test_receiver_down_is_logged_not_raised() -> None:
    from prometheus_client import CollectorRegistry

    with OtlpReceiver() as rx:
        url = rx.url  # a port that nothing listens on once the receiver is closed
    push = OtlpPush(CollectorRegistry(), url, interval_s=60, timeout_s=0.5)
    started = time.monotonic()
    assert push.metrics.export_once() is False
    push.shutdown()
    assert push.metrics.failures >= 1
    assert time.monotonic() - started < 10


def test_adapter_owned_families_go_through_otlp_too() -> None:
    """The vLLM, canary and LMCache adapters register their own families where they run;
    each (counter, gauge, histogram, with its labels) reaches the receiver as well."""
    from sidecar.export.metrics import Metrics

    owned = [s for group in S.ADAPTER_SIGNALS.values() for s in group]
    metrics = Metrics("vllm", "m")
    metrics.register(owned)  # the one path an adapter's set takes
    for sig in owned:
        labels = {name: "x" for name in sig.labels}
        if sig.type is S.MetricType.COUNTER:
            metrics.inc(sig, 2, **labels)
        elif sig.type is S.MetricType.HISTOGRAM:
            metrics.observe(sig, 0.01, **labels)
        else:
            metrics.gauge(sig, **labels).set(3)
    with OtlpReceiver() as rx:
        push = OtlpPush(metrics.registry, rx.url, interval_s=60)
        push.shutdown()
        got = rx.metrics()
    assert [s.name for s in owned if _otel_name(s) not in got] == []
    assert {s.name for s in S.ALL_SIGNALS} == {s.name for s in (*S.core_signals(), *owned)}
    point = got[owned[0].base_name].sum.data_points[0]
    assert point.as_double == 2


def test_grpc_receiver_sees_the_same_signals_and_spans() -> None:
    pytest.importorskip("grpc")
    from tests.otlp_receiver import OtlpGrpcReceiver

    engine, mon = build(DemoOptions(fault="zero-block", sample_every=2, port=0,
                                    progress=False, num_blocks=64, sidecar=ALL_ON))
    verdicts = []
    with OtlpGrpcReceiver() as rx:
        push = start_otlp_push(mon, rx.url, interval_s=60, protocol="grpc")
        mon.reporter.listeners.append(verdicts.append)
        mon.start()
        try:
            drive(engine, ChatWorkload(WorkloadConfig(seed=0, conversations=10,
                                                      block_size=engine.block_size)),
                  max_requests=30)
            mon.drain(timeout_s=60)
        finally:
            mon.stop()
            push.shutdown()
        got, spans = rx.metrics(), rx.spans()
    assert [s.name for s in S.core_signals()
            if _otel_name(s) not in got and s.name not in (
                S.RECOMPUTE_NOISE_FLOOR.name, S.RECOMPUTE_ERROR_DRIFT.name)] == []
    assert got[S.LOOKUPS.base_name].sum.data_points[0].as_double == 30
    assert len(spans) == len(verdicts) > 0
    assert all(set(a) == set(SPAN_ATTRIBUTES) for _, a in spans)


def test_a_failing_verdict_listener_never_breaks_reporting() -> None:
    from tests.conftest import make_toy

    engine, _, mon = make_toy()
    calls = []

    def broken(verdict) -> None:
        calls.append(verdict)
        raise RuntimeError("span exporter bug")

    mon.reporter.listeners.append(broken)
    prompt = list(range(1, 17))
    engine.serve(prompt)
    engine.kv[engine.index[tuple(prompt)]][0].zero_()
    mon.verify(engine.serve(prompt + [3]))
    mon.verify(engine.serve(prompt + [4]))
    assert len(calls) == 2
    assert mon.metrics.value(S.ANOMALIES.name, group="0", kind="zeros") >= 1
    assert mon.reporter._listener_errors == 2


def test_vllm_serve_takes_the_same_otlp_flags() -> None:
    """``kv-sidecar vllm serve`` pushes like ``demo`` does: the same three flags, the same
    checks (a bad URL is a usage error naming the flag)."""
    from sidecar.adapters.vllm.cli import parser

    base = ["serve", "--model", "m", "--dtype", "float32", "--block-size", "16"]
    args = parser().parse_args([*base, "--otlp-endpoint", "http://127.0.0.1:4318",
                                "--otlp-interval", "2", "--otlp-protocol", "grpc"])
    assert (args.otlp_endpoint, args.otlp_interval, args.otlp_protocol) == (
        "http://127.0.0.1:4318", 2.0, "grpc")
    assert parser().parse_args(base).otlp_endpoint is None  # off by default
    with pytest.raises(SystemExit) as exc:
        parser().parse_args([*base, "--otlp-endpoint", "ftp://127.0.0.1:4318"])
    assert exc.value.code == 2
