"""HTTP endpoints: ``/metrics`` (Prometheus exposition), ``/healthz``, ``/status`` (JSON).

A plain ``ThreadingHTTPServer`` on a daemon thread, bound to 127.0.0.1 unless told otherwise:
the sidecar is scraped by a local Prometheus or a pod-local agent, not exposed to the world.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class SidecarServer:
    def __init__(self, registry: CollectorRegistry, status: Callable[[], dict[str, Any]],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = registry
        self.status = status
        handler = self._handler()
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        if isinstance(host, bytes):
            host = host.decode()
        return f"http://{host}:{self.port}"

    def start(self) -> SidecarServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        name="kvsidecar-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        self._send(200, CONTENT_TYPE_LATEST, generate_latest(server.registry))
                    elif path == "/healthz":
                        self._send(200, "text/plain; charset=utf-8", b"ok\n")
                    elif path == "/status":
                        body = json.dumps(server.status(), indent=1, default=str).encode()
                        self._send(200, "application/json", body)
                    else:
                        self._send(404, "text/plain; charset=utf-8",
                                   b"not found: try /metrics, /healthz, /status\n")
                except Exception as exc:  # a scrape must never take the sidecar down
                    log.exception("HTTP %s failed", path)
                    self._send(500, "text/plain; charset=utf-8", f"error: {exc}\n".encode())

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: %s", format % args)

        return Handler
