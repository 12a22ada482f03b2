"""HTTP endpoints: ``/metrics`` (Prometheus exposition), ``/healthz``, ``/status`` (JSON).

A ``ThreadingHTTPServer`` on a daemon thread, bound to 127.0.0.1 unless told otherwise: the
sidecar is scraped by a local Prometheus or a pod-local agent, not exposed to the world.
Hardened so scrapers cannot hurt it or the engine beside it: a listen backlog of
:data:`BACKLOG` (200 concurrent scrapers no longer wait for SYN retries), a per-connection
socket timeout (an idle or slow-loris connection is closed, it does not hold a thread for
ever), at most :data:`MAX_HANDLERS` handler threads (more connections get a 503 at once).
``/status`` never emits NaN (non-finite numbers become ``null``) and never answers 500 for
bad state. Opt-in auth: with a bearer token (:func:`load_token`: a file or an environment
variable) the control surface (``/status``, any future control endpoint) needs
``Authorization: Bearer <token>``; ``/metrics`` and ``/healthz`` stay open for probes.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

BACKLOG = 256
MAX_HANDLERS = 64
CONNECTION_TIMEOUT_S = 5.0
TOKEN_ENV = "KVSIDECAR_TOKEN"
PROTECTED = frozenset({"/status"})
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\nConnection: close\r\n"
         b"Retry-After: 1\r\n\r\nbusy\n")


def load_token(path: str | os.PathLike[str] | None = None, env: str = TOKEN_ENV) -> str | None:
    """The bearer token from ``path`` (first line) or the ``env`` variable; ``None`` (no
    auth) when neither is set. An empty token is refused: it would let anyone in."""
    token = Path(path).read_text().strip() if path else os.environ.get(env, "").strip()
    if path and not token:
        raise ValueError(f"token file {path} is empty")
    return token or None


def finite(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every NaN/inf float replaced by ``None`` (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if depth > 32:
        return None
    if isinstance(obj, dict):
        return {str(k): finite(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v, depth + 1) for v in obj]
    return obj


class _BoundedServer(ThreadingHTTPServer):
    request_queue_size = BACKLOG
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_handlers: int) -> None:
        self._slots = threading.BoundedSemaphore(max_handlers)
        self.rejected = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.rejected += 1
            try:
                request.settimeout(0.5)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class SidecarServer:
    def __init__(self, registry: CollectorRegistry, status: Callable[[], dict[str, Any]],
                 host: str = "127.0.0.1", port: int = 0,
                 health: Callable[[], dict[str, Any]] | None = None,
                 token: str | None = None, timeout_s: float = CONNECTION_TIMEOUT_S,
                 max_handlers: int = MAX_HANDLERS) -> None:
        self.registry = registry
        self.status = status
        self.health = health
        self.token = token
        self.unauthorized = 0
        handler = self._handler(timeout_s)
        self.httpd = _BoundedServer((host, port), handler, max_handlers)
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

    @property
    def rejected(self) -> int:
        """Connections answered 503 because every handler thread was busy."""
        return int(getattr(self.httpd, "rejected", 0))

    def start(self) -> SidecarServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        name="kvsidecar-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        given = (header or "").removeprefix("Bearer ").strip().encode()
        return hmac.compare_digest(given, self.token.encode())

    def _health(self) -> tuple[int, bytes]:
        if self.health is None:
            return 200, b"ok\n"
        try:
            report = self.health()
        except Exception as exc:
            report = {"ok": False, "error": type(exc).__name__}
        ok = bool(report.get("ok"))
        body = ("ok\n" if ok else "unhealthy\n") + json.dumps(finite(report), sort_keys=True)
        return (200 if ok else 503), body.encode() + b"\n"

    def _status(self) -> bytes:
        return json.dumps(finite(self.status()), indent=1, default=str,
                          allow_nan=False).encode()

    def _handler(self, timeout_s: float) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = timeout_s  # per connection: idle keep-alives are closed
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    if path in PROTECTED and not server.authorized(
                            self.headers.get("Authorization")):
                        server.unauthorized += 1
                        self._send(401, "text/plain; charset=utf-8", b"unauthorized\n",
                                   {"WWW-Authenticate": 'Bearer realm="kv-sidecar"'})
                    elif path == "/metrics":
                        self._send(200, CONTENT_TYPE_LATEST, generate_latest(server.registry))
                    elif path == "/healthz":
                        code, body = server._health()
                        self._send(code, "text/plain; charset=utf-8", body)
                    elif path == "/status":
                        self._send(200, "application/json", server._status())
                    else:
                        self._send(404, "text/plain; charset=utf-8",
                                   b"not found: try /metrics, /healthz, /status\n")
                except OSError:  # TimeoutError included
                    self.close_connection = True  # the client went away
                except Exception as exc:  # a scrape must never take the sidecar down
                    log.exception("HTTP %s failed", path)
                    self._send(500, "text/plain; charset=utf-8",
                               f"error: {type(exc).__name__}\n".encode())

            def _send(self, code: int, ctype: str, body: bytes,
                      headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: %s", format % args)

        return Handler
