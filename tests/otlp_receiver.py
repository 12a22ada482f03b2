"""A real OTLP/HTTP receiver on 127.0.0.1 for the tests: an ``http.server`` that decodes
``ExportMetricsServiceRequest`` / ``ExportTraceServiceRequest`` with opentelemetry-proto
(the protobuf classes the exporter itself uses; nothing here parses protobuf by hand)."""

from __future__ import annotations

import gzip
import threading
import zlib
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.stub_http import StubHandler, StubServer

_ROUTES: dict[str, tuple[Any, Any]] = {
    "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
}


class OtlpReceiver:
    """Keeps every decoded request; ``metric_names()``, ``spans()`` read them."""

    def __init__(self) -> None:
        self.requests: dict[str, list[Any]] = {path: [] for path in _ROUTES}
        self.content_types: set[str] = set()
        self.rejected = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(StubHandler):
            def do_POST(self) -> None:
                route = _ROUTES.get(self.path)
                body = self.body()
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if route is None:
                    receiver.rejected += 1
                    self.send_error(404)
                    return
                request_cls, response_cls = route
                msg = request_cls()
                msg.ParseFromString(body)
                with receiver.lock:
                    receiver.requests[self.path].append(msg)
                    receiver.content_types.add(self.headers.get("Content-Type", ""))
                out = response_cls().SerializeToString()
                self.reply(200, out, "application/x-protobuf")

        self._handler = Handler
        self.stub: StubServer | None = None
        self.url = ""

    def __enter__(self) -> OtlpReceiver:
        self.stub = StubServer(self._handler)
        self.url = self.stub.url
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stub is not None:
            self.stub.stop()

    def metrics(self) -> dict[str, Any]:
        """The latest decoded Metric per name (protobuf messages)."""
        out: dict[str, Any] = {}
        with self.lock:
            for req in self.requests["/v1/metrics"]:
                for rm in req.resource_metrics:
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            out[m.name] = m
        return out

    def resources(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{a.key: _value(a.value) for a in rm.resource.attributes}
                    for req in self.requests["/v1/metrics"] for rm in req.resource_metrics]

    def spans(self) -> list[tuple[Any, dict[str, Any]]]:
        """Every decoded span with its attributes as Python values."""
        out = []
        with self.lock:
            for req in self.requests["/v1/traces"]:
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            out.append((span, {a.key: _value(a.value)
                                               for a in span.attributes}))
        return out


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpGrpcReceiver(OtlpReceiver):
    """The same receiver over OTLP/gRPC (grpcio's server and opentelemetry-proto's service
    stubs); decoded requests land where the HTTP receiver puts them."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mg
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tg

        self.requests = {path: [] for path in _ROUTES}
        self.content_types = {"application/grpc"}
        self.rejected = 0
        self.lock = threading.Lock()
        receiver = self

        class Metrics(mg.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with receiver.lock:
                    receiver.requests["/v1/metrics"].append(request)
                return ExportMetricsServiceResponse()

        class Traces(tg.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with receiver.lock:
                    receiver.requests["/v1/traces"].append(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        mg.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        tg.add_TraceServiceServicer_to_server(Traces(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> OtlpGrpcReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)
