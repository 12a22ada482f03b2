"""Issue 21: an OTLP receiver that is down, silent or answering 500 is a signal, by reason
(``kvsidecar_otlp_export_failures_total{signal, reason}``), not a count on an object.

Real receivers on 127.0.0.1: a bound socket that never listens (connection refused), a
listening one that never accepts (the request is sent, no answer comes), and an
``http.server`` that answers every POST with 500 (or a redirect, which the SDK calls a
success). The exports are driven one by one; nothing here waits on a clock."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from sidecar import signals as S
from sidecar.export.metrics import Metrics
from sidecar.export.otel_push import OtlpPush
from tests.otlp_receiver import OtlpReceiver
from tests.stub_http import StubHandler, StubServer

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")


@contextlib.contextmanager
def _down() -> Iterator[str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, not listening: every connection is refused
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


@contextlib.contextmanager
def _silent() -> Iterator[str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)  # the kernel completes the handshake; nobody ever reads or answers
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


@contextlib.contextmanager
def _answering(status: int) -> Iterator[str]:
    class Handler(StubHandler):
        def do_POST(self) -> None:
            self.body()
            where = {"Location": "http://127.0.0.1:1/elsewhere"} if 300 <= status < 400 else {}
            self.reply(status, b"boom", headers=where)

    with StubServer(Handler) as stub:
        yield stub.url


RECEIVERS = {"down": (_down, S.OtlpFailure.CONNECT),
             "silent": (_silent, S.OtlpFailure.TIMEOUT),
             "500": (lambda: _answering(500), S.OtlpFailure.HTTP),
             "redirect": (lambda: _answering(307), S.OtlpFailure.HTTP)}


def _failures(metrics: Metrics, signal: str, reason: S.OtlpFailure) -> float:
    return metrics.value(S.OTLP_EXPORT_FAILURES.name, signal=signal, reason=reason.value)


@pytest.mark.parametrize("kind", sorted(RECEIVERS))
def test_a_failing_receiver_is_counted_by_reason(kind: str) -> None:
    receiver, reason = RECEIVERS[kind]
    metrics = Metrics("reference", "tiny")
    metrics.inc(S.LOOKUPS)
    with receiver() as url:
        push = OtlpPush(metrics.registry, url, interval_s=3600, timeout_s=0.5,
                        metrics=metrics)
        for _ in range(3):
            assert push.metrics.export_once() is False  # never raised
        # A verification span goes the same way, from the span processor's thread.
        push.provider.get_tracer("t").start_span("kvsidecar.verify").end()
        push.provider.force_flush()
        push.shutdown()  # one more metric export (the final values): it fails too
    assert _failures(metrics, "metrics", reason) == 4
    assert _failures(metrics, "traces", reason) >= 1
    other = [r for r in S.OtlpFailure if r is not reason]
    assert all(_failures(metrics, s, r) == 0 for s in ("metrics", "traces") for r in other)
    assert metrics.value(S.OTLP_EXPORTS.name, signal="metrics") == 4
    assert push.counts.failures[("metrics", reason.value)] == 4
    # The counter is a signal like any other: on the sidecar's /metrics (its registry).
    value = metrics.registry.get_sample_value(
        S.OTLP_EXPORT_FAILURES.name,
        {"engine": "reference", "model": "tiny", "signal": "metrics", "reason": reason.value})
    assert value == 4


def test_a_receiver_that_takes_the_batches_counts_exports_and_no_failure() -> None:
    metrics = Metrics("reference", "tiny")
    with OtlpReceiver() as rx:
        push = OtlpPush(metrics.registry, rx.url, interval_s=3600, metrics=metrics)
        assert push.metrics.export_once() is True
        push.shutdown()
        got = rx.metrics()
    assert metrics.value(S.OTLP_EXPORTS.name, signal="metrics") == 2
    assert metrics.value_sum(S.OTLP_EXPORT_FAILURES.name) == 0
    assert S.OTLP_EXPORTS.base_name in got  # pushed like every other signal


def test_the_receiver_coming_back_stops_the_failures() -> None:
    """Down, then up on the same port: the failures stop growing, the exports go on."""
    metrics = Metrics("reference", "tiny")
    with OtlpReceiver() as rx:
        url = rx.url
    push = OtlpPush(metrics.registry, url, interval_s=3600, timeout_s=0.5, metrics=metrics)
    assert push.metrics.export_once() is False
    port = int(url.rsplit(":", 1)[1])
    with _answering_on(port):
        assert push.metrics.export_once() is True
    push.provider.shutdown()
    assert _failures(metrics, "metrics", S.OtlpFailure.CONNECT) == 1
    assert metrics.value(S.OTLP_EXPORTS.name, signal="metrics") == 2


@contextlib.contextmanager
def _answering_on(port: int) -> Iterator[None]:
    class Handler(StubHandler):
        def do_POST(self) -> None:
            self.body()
            self.reply(200)

    with StubServer(Handler, port=port, reuse_address=True):
        yield


def test_a_sidecar_without_otlp_push_exports_no_otlp_series() -> None:
    metrics = Metrics("reference", "tiny")
    names = {fam.name for fam in metrics.registry.collect()}
    assert not {s.base_name for s in S.OTLP_SIGNALS} & names
