"""OTLP push health: every export batch counted, and every failed one by its reason.

The SDK's exporters retry, log and return ``FAILURE``; nothing of that reaches a dashboard,
so a receiver that is down, silent or answering 500 looked like a quiet sidecar. The
exporters here wrap the SDK's and count each batch in :data:`sidecar.signals.OTLP_EXPORTS`
and each one the receiver did not take in :data:`sidecar.signals.OTLP_EXPORT_FAILURES`,
with the reason (:class:`sidecar.signals.OtlpFailure`) read from what the HTTP session saw
on the batch's last attempt: refused or reset (``connect``), no answer within the timeout
(``timeout``), a status that is not 2xx (``http``; the SDK counts a redirect as success,
but a redirected batch was not received). gRPC failures carry no detail: ``error``.

Counting is a cell update on the exporter's own thread (the metric reader's or the span
processor's), never the engine's, and a failure to count is logged, never raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from sidecar import signals as S

log = logging.getLogger(__name__)

# (signal, reason or None for success) -> None: how a wrapper reports one batch.
Record = Callable[[str, "S.OtlpFailure | None"], None]


def recording_session() -> Any:
    """A ``requests.Session`` that remembers how its last request ended (``.outcome``:
    ``None`` for a 2xx answer, else an :class:`~sidecar.signals.OtlpFailure`)."""
    import requests

    class RecordingSession(requests.Session):
        outcome: S.OtlpFailure | None = None

        def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                response = super().request(method, url, *args, **kwargs)
            except requests.exceptions.Timeout:  # ConnectTimeout included: no answer
                self.outcome = S.OtlpFailure.TIMEOUT
                raise
            except requests.exceptions.ConnectionError:
                self.outcome = S.OtlpFailure.CONNECT
                raise
            except Exception:
                self.outcome = S.OtlpFailure.ERROR
                raise
            self.outcome = None if 200 <= response.status_code < 300 else S.OtlpFailure.HTTP
            return response

    return RecordingSession()


def failure_reason(session: Any, succeeded: bool) -> S.OtlpFailure | None:
    """Why a batch failed (``None`` when it was received): the session's last outcome, or
    ``error`` where the exporter failed without sending (or over gRPC, with no session)."""
    seen = getattr(session, "outcome", None) if session is not None else None
    if seen is not None:
        return S.OtlpFailure(seen)
    return None if succeeded else S.OtlpFailure.ERROR


def _reset(session: Any) -> None:
    if session is not None:
        session.outcome = None


class CountingMetricExporter(MetricExporter):
    """The SDK's metric exporter, with every batch reported to ``record``."""

    def __init__(self, inner: MetricExporter, record: Record, session: Any = None) -> None:
        super().__init__(preferred_temporality=getattr(inner, "_preferred_temporality", None),
                         preferred_aggregation=getattr(inner, "_preferred_aggregation", None))
        self.inner, self.record, self.session = inner, record, session

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        def attempt() -> bool:
            return self.inner.export(metrics_data, timeout_millis=timeout_millis,
                                     **kwargs) == MetricExportResult.SUCCESS

        ok = _counted_export(self.session, self.record, "metrics", "metric", attempt)
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class CountingSpanExporter(SpanExporter):
    """The SDK's span exporter, with every batch reported to ``record``."""

    def __init__(self, inner: SpanExporter, record: Record, session: Any = None) -> None:
        self.inner, self.record, self.session = inner, record, session

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        ok = _counted_export(self.session, self.record, "traces", "span",
                             lambda: self.inner.export(spans) == SpanExportResult.SUCCESS)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self.inner.shutdown()


def _counted_export(session: Any, record: Record, signal: str, what: str,
                    export: Callable[[], bool]) -> bool:
    """One export attempt of either exporter: the session's last answer cleared first, the
    SDK's trouble logged and counted (never raised), the outcome counted under ``signal``;
    True when it went through."""
    _reset(session)
    try:
        ok = export()
    except Exception as exc:
        log.warning("OTLP %s export failed: %s", what, exc)
        ok = False
    reason = failure_reason(session, ok)
    _count(record, signal, reason)
    return reason is None


def _count(record: Record, signal: str, reason: S.OtlpFailure | None) -> None:
    try:
        record(signal, reason)
    except Exception as exc:  # counting must not turn a failed export into a crash
        log.warning("could not count an OTLP export: %s", exc)


class ExportCounts:
    """Counts of exported and failed batches: in a sidecar's :class:`~sidecar.export.metrics.
    Metrics` (its signals registered here) when given one, and always on the object (for
    a push built on a bare registry)."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        if metrics is not None:
            metrics.register(S.OTLP_SIGNALS)
        self.exports: dict[str, int] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()  # the metric reader and the span processor both count

    def __call__(self, signal: str, reason: S.OtlpFailure | None) -> None:
        with self._lock:
            self.exports[signal] = self.exports.get(signal, 0) + 1
            if self.metrics is not None:
                self.metrics.inc(S.OTLP_EXPORTS, signal=signal)
            if reason is None:
                return
            key = (signal, reason.value)
            self.failures[key] = self.failures.get(key, 0) + 1
            if self.metrics is not None:
                self.metrics.inc(S.OTLP_EXPORT_FAILURES, signal=signal, reason=reason.value)
