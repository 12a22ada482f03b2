"""OTLP push: every signal and one span per verification to an OpenTelemetry receiver.

The alternative to Prometheus pull for sites that run an OpenTelemetry Collector. Two
readers of what the sidecar already has, nothing new on the engine's thread:

* metrics: :class:`sidecar.export.otel.OtelExporter` walks the one registry every ``interval_s`` and
  pushes it with the SDK's OTLP/HTTP protobuf exporter to ``ENDPOINT/v1/metrics``;
* traces: :class:`VerificationSpans` listens to the verdict reporter and ends one span per
  verified sample (already finished: start = end - the verifier's duration), batched by the
  SDK's ``BatchSpanProcessor`` and pushed to ``ENDPOINT/v1/traces`` from its own thread.

``protocol="grpc"`` sends both over OTLP/gRPC to the same ``host:port`` instead (the
``otlp-grpc`` extra: grpcio); an ``http://`` endpoint is then a plaintext channel.

A span says what was verified and how it went, never what the user wrote: the attributes are
counts, block ids, group ids, check names and the verdict (:data:`SPAN_ATTRIBUTES`); token
ids and key-field values stay out. Collector trouble is the SDK's to retry and log: it never
reaches the verifier; every batch and every failed one (by reason: the receiver down, silent
or answering an error) is counted (:mod:`sidecar.export.otlp_failures`). Needs the ``otlp`` extra
(``opentelemetry-exporter-otlp-proto-http``).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sidecar import __version__
from sidecar.core.extras import require
from sidecar.core.verdict_listeners import Stage
from sidecar.export.otel import OtelExporter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from sidecar.checks.verifier import Verdict
    from sidecar.core.monitor import Monitor
    from sidecar.export.metrics import Metrics

log = logging.getLogger(__name__)

SPAN_NAME = "kvsidecar.verify"
PROTOCOLS = ("http/protobuf", "grpc")  # the OTEL_EXPORTER_OTLP_PROTOCOL spellings
# Every attribute a verification span carries (the receiver test checks exactly these).
SPAN_ATTRIBUTES = (
    "kvsidecar.kind",           # what was verified: "hit" (a sampled hit) unless the sample says
    "kvsidecar.verdict",        # clean | anomalous | dropped | undecided
    "kvsidecar.groups",         # cache group ids of the sampled blocks
    "kvsidecar.blocks",         # how many blocks were sampled
    "kvsidecar.block_ids",      # their engine block ids (identifiers, not content)
    "kvsidecar.verified_blocks",
    "kvsidecar.tokens",         # hit length in tokens (a count, never the ids)
    "kvsidecar.duration_s",
    "kvsidecar.anomaly_kinds",  # the checks that fired (sidecar.signals.AnomalyKind)
    "kvsidecar.drop_reasons",   # why blocks could not be decided (DropReason)
)


def parse_endpoint(url: str) -> str:
    """The receiver's base URL (``http://127.0.0.1:4318``), checked; the per-signal paths
    ``/v1/metrics`` and ``/v1/traces`` are appended to it. :class:`ValueError` says what
    is wrong with a bad one."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"OTLP endpoint must be an http(s) URL such as "
                         f"http://127.0.0.1:4318, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"OTLP endpoint takes no query or fragment, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"OTLP endpoint has a bad port: {url!r}") from None
    path = parts.path.rstrip("/")
    for suffix in ("/v1/metrics", "/v1/traces"):
        path = path.removesuffix(suffix)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def check_endpoint(endpoint: str, protocol: str) -> None:
    """:class:`ValueError` when ``endpoint`` (already parsed) cannot be used with
    ``protocol``: gRPC addresses a ``host:port``, no path."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got "
                         f"{protocol!r}")
    if protocol == "grpc" and urllib.parse.urlsplit(endpoint).path:
        raise ValueError(f"an OTLP/gRPC endpoint is host:port, without a path: {endpoint!r}")


def add_arguments(p: Any) -> None:
    """The OTLP push flags, the same on every command that runs a sidecar (``demo``,
    ``vllm serve``): ``--otlp-endpoint``, ``--otlp-interval``, ``--otlp-protocol``."""
    import argparse

    def endpoint(text: str) -> str:
        try:
            return parse_endpoint(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def interval(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= 0.1:
            raise argparse.ArgumentTypeError(f"must be >= 0.1, got {text}")
        return value

    p.add_argument("--otlp-endpoint", type=endpoint, default=None, metavar="URL",
                   help="push every signal and one span per verification over OTLP/HTTP "
                        "protobuf to this receiver, e.g. http://127.0.0.1:4318 (needs the "
                        "otlp extra)")
    p.add_argument("--otlp-interval", type=interval, default=10.0, metavar="SECONDS",
                   help="metric push interval (default: 10)")
    p.add_argument("--otlp-protocol", choices=PROTOCOLS, default="http/protobuf",
                   help="OTLP transport (grpc: host:port, needs the otlp-grpc extra)")


def check_arguments(args: Any) -> None:
    """:class:`ValueError` naming the flag when the OTLP flags cannot work together, and
    the missing extra (:class:`sidecar.core.extras.MissingExtra`) when push is asked for."""
    if args.otlp_endpoint:
        try:
            check_endpoint(args.otlp_endpoint, args.otlp_protocol)
        except ValueError as exc:
            raise ValueError(f"--otlp-endpoint: {exc}") from None
        require("otlp-grpc" if args.otlp_protocol == "grpc" else "otlp")


def verdict_label(verdict: Verdict) -> str:
    if verdict.findings:
        return "anomalous"
    if verdict.verified:
        return "clean"
    return "dropped" if verdict.dropped else "undecided"


def span_attributes(verdict: Verdict) -> dict[str, Any]:
    """The attributes of one verification's span (see :data:`SPAN_ATTRIBUTES`)."""
    sample = verdict.sample
    return {
        "kvsidecar.kind": str(getattr(sample, "kind", "hit")),
        "kvsidecar.verdict": verdict_label(verdict),
        "kvsidecar.groups": sorted({r.group_id for r in sample.refs}),
        "kvsidecar.blocks": len(sample.refs),
        "kvsidecar.block_ids": [int(r.block_id) for r in sample.refs],
        "kvsidecar.verified_blocks": len(verdict.verified),
        "kvsidecar.tokens": int(sample.hit.hit_tokens),
        "kvsidecar.duration_s": float(verdict.duration_s),
        "kvsidecar.anomaly_kinds": sorted({f.kind.value for f in verdict.findings}),
        "kvsidecar.drop_reasons": sorted(r.value for r in verdict.dropped),
    }


class VerificationSpans:
    """One finished span per verdict, handed to ``provider``'s processors."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("kv-sidecar", __version__)
        self.spans = 0

    def on_verdict(self, verdict: Verdict) -> None:
        from opentelemetry.trace import Status, StatusCode

        end = time.time_ns()
        span = self.tracer.start_span(SPAN_NAME, start_time=end - int(verdict.duration_s * 1e9),
                                      attributes=span_attributes(verdict))
        if verdict.findings:
            span.set_status(Status(StatusCode.ERROR, "KV anomaly"))
        span.end(end_time=end)
        self.spans += 1


class OtlpPush:
    """Metrics and verification spans over OTLP/HTTP protobuf to one receiver."""

    def __init__(self, registry: CollectorRegistry, endpoint: str, interval_s: float = 10.0,
                 resource_attributes: Mapping[str, str] | None = None,
                 timeout_s: float = 5.0, protocol: str = "http/protobuf",
                 metrics: Metrics | None = None) -> None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from sidecar.export.otlp_failures import (
            CountingMetricExporter,
            CountingSpanExporter,
            ExportCounts,
        )

        self.endpoint = parse_endpoint(endpoint)
        self.protocol = protocol
        # Batches and failures by reason, in ``metrics`` (the sidecar's signals) if given.
        self.counts = ExportCounts(metrics)
        sessions = _sessions(protocol)
        metric_sdk, span_sdk = _exporters(protocol, self.endpoint, timeout_s, sessions)
        metric_exporter = CountingMetricExporter(metric_sdk, self.counts, sessions[0])
        span_exporter = CountingSpanExporter(span_sdk, self.counts, sessions[1])
        self.metrics = OtelExporter(registry, metric_exporter, interval_s=interval_s,
                                    resource_attributes=resource_attributes)
        self.provider = TracerProvider(resource=self.metrics.resource)
        self.provider.add_span_processor(BatchSpanProcessor(
            span_exporter, schedule_delay_millis=max(100, int(interval_s * 1000 / 2))))
        self.spans = VerificationSpans(self.provider)

    def start(self) -> OtlpPush:
        self.metrics.start()
        return self

    def shutdown(self) -> None:
        """Flush the spans, push the final metric values, stop both exporters."""
        try:
            self.provider.shutdown()
        except Exception as exc:
            log.warning("OTLP span shutdown failed: %s", exc)
        self.metrics.shutdown()


def _sessions(protocol: str) -> tuple[Any, Any]:
    """One HTTP session per exporter that records how its last request ended (the
    failure reason); none over gRPC."""
    if protocol != "http/protobuf":
        return None, None
    require("otlp")
    from sidecar.export.otlp_failures import recording_session

    return recording_session(), recording_session()


def _exporters(protocol: str, endpoint: str, timeout_s: float,
               sessions: tuple[Any, Any] = (None, None)) -> tuple[Any, Any]:
    """The SDK's OTLP metric and span exporters for ``protocol``."""
    if protocol == "http/protobuf":
        require("otlp")
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return (OTLPMetricExporter(endpoint=f"{endpoint}/v1/metrics", timeout=timeout_s,
                                   session=sessions[0]),
                OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=timeout_s,
                                 session=sessions[1]))
    if protocol == "grpc":
        require("otlp-grpc")
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        check_endpoint(endpoint, protocol)
        parts = urllib.parse.urlsplit(endpoint)
        target, insecure = parts.netloc, parts.scheme == "http"
        return (GrpcMetricExporter(endpoint=target, insecure=insecure, timeout=timeout_s),
                GrpcSpanExporter(endpoint=target, insecure=insecure, timeout=timeout_s))
    raise ValueError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")


def start_otlp_push(monitor: Monitor, endpoint: str, interval_s: float = 10.0,
                    protocol: str = "http/protobuf") -> OtlpPush:
    """Push ``monitor``'s signals and a span per verification to ``endpoint``."""
    push = OtlpPush(monitor.metrics.registry, endpoint, interval_s,
                    {"kvsidecar.engine": monitor.info.engine,
                     "kvsidecar.model": monitor.info.model}, protocol=protocol,
                    metrics=monitor.metrics)
    monitor.reporter.listeners.add(push.spans.on_verdict, Stage.EXPORT)
    return push.start()
