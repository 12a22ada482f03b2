"""HTTP endpoints: ``/metrics`` (Prometheus exposition), ``/healthz``, ``/status`` (JSON).

A ``ThreadingHTTPServer`` on a daemon thread, bound to 127.0.0.1 unless told otherwise: the
sidecar is scraped by a local Prometheus or a pod-local agent, not exposed to the world.
Hardened so scrapers cannot hurt it or the engine beside it: a listen backlog of
:data:`BACKLOG` (200 concurrent scrapers no longer wait for SYN retries), a per-connection
socket timeout (an idle or slow-loris connection is closed, it does not hold a thread for
ever; until it sends a byte it holds no thread at all, see :class:`_Reception`), at most
:data:`MAX_HANDLERS` handler threads (a connection that finds none free waits for one up
to its timeout, then gets a 503).
``/status`` never emits NaN (non-finite numbers become ``null``) and never answers 500 for
bad state. Opt-in auth: with a bearer token (:func:`load_token`: a file or an environment
variable) the control surface (``/status``, any future control endpoint) needs
``Authorization: Bearer <token>``; ``/metrics`` and ``/healthz`` stay open for probes.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

BACKLOG = 256
MAX_HANDLERS = 64
MAX_WAITING = 4096  # accepted connections held (idle) without a thread
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


class _Reception(threading.Thread):
    """Holds accepted connections until they send something, so an idle (or slow-loris)
    connection costs a file descriptor, not a handler thread. A readable connection waits
    here for a free handler slot; one idle past ``idle_s`` is closed, one still waiting
    for a slot at its deadline gets a 503. At most ``max_waiting`` are held."""

    def __init__(self, server: _BoundedServer, idle_s: float, max_waiting: int) -> None:
        super().__init__(name="kvsidecar-http-reception", daemon=True)
        self.server = server
        self.idle_s = idle_s
        self.max_waiting = max_waiting
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._new: deque[tuple[Any, Any]] = deque()
        self._idle: dict[Any, tuple[Any, float]] = {}  # sock -> (address, deadline)
        self._ready: deque[tuple[Any, Any, float]] = deque()
        self._halt = threading.Event()
        self.idle_closed = 0

    def add(self, sock: Any, address: Any) -> None:
        self._new.append((sock, address))
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def stop(self) -> None:
        self._halt.set()
        self.wake()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self._step(0.05 if self._ready else 0.5)
        finally:
            for sock in [*self._idle, *(r[0] for r in self._ready),
                         *(n[0] for n in self._new)]:
                self.server.shutdown_request(sock)
            self.sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _step(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            if key.data is None:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
                continue
            sock = key.fileobj
            self.sel.unregister(sock)
            address, deadline = self._idle.pop(sock)
            self._ready.append((sock, address, deadline))
        now = time.monotonic()
        while self._new:
            sock, address = self._new.popleft()
            if len(self._idle) >= self.max_waiting:
                self.server.refuse(sock)
                continue
            self._idle[sock] = (address, now + self.idle_s)
            self.sel.register(sock, selectors.EVENT_READ, True)
        while self._ready:  # oldest first, while handler slots are free
            sock, address, deadline = self._ready[0]
            if self.server.dispatch(sock, address):
                self._ready.popleft()
            elif deadline < now:
                self._ready.popleft()
                self.server.refuse(sock)
            else:
                break
        for sock, (_address, deadline) in list(self._idle.items()):
            if deadline < now:
                self.sel.unregister(sock)
                del self._idle[sock]
                self.idle_closed += 1
                self.server.shutdown_request(sock)


class _BoundedServer(ThreadingHTTPServer):
    request_queue_size = BACKLOG
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_handlers: int, idle_s: float, max_waiting: int = MAX_WAITING) -> None:
        self._slots = threading.BoundedSemaphore(max_handlers)
        self.rejected = 0
        super().__init__(address, handler)
        self.reception = _Reception(self, idle_s, max_waiting)
        self.reception.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self.reception.add(request, client_address)  # no thread until it sends something

    def dispatch(self, request: Any, client_address: Any) -> bool:
        """Start a handler thread for a connection that has data; False when none is free."""
        if not self._slots.acquire(blocking=False):
            return False
        try:
            ThreadingHTTPServer.process_request(self, request, client_address)
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
        return True

    def refuse(self, request: Any) -> None:
        self.rejected += 1
        try:
            request.settimeout(0.5)
            request.sendall(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            self.reception.wake()  # a waiting connection may take the slot

    def server_close(self) -> None:
        self.reception.stop()
        self.reception.join(2.0)
        super().server_close()


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
        self.httpd = _BoundedServer((host, port), handler, max_handlers, timeout_s)
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

    @property
    def idle_closed(self) -> int:
        """Connections closed because they sent nothing within the timeout."""
        return self.httpd.reception.idle_closed

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
