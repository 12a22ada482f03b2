"""The tests' stand-in HTTP servers (upstreams, fake engines, OTLP receivers), one way.

:class:`StubServer` is a ``ThreadingHTTPServer`` on 127.0.0.1 serving on its own thread
from the moment it is made; :meth:`StubServer.stop` (or leaving its ``with`` block) ends it
whole: the accept loop, every connection still open and every handler thread, joined.
Handler threads are tracked rather than left to ``block_on_close``: a keep-alive client (a
proxy's pooled upstream connection) would make that join wait for ever, and a handler
thread left running on a daemon thread would answer a later test's request that reached
its still-open socket. No state outside the instance: nothing here outlives a test.

:class:`StubHandler` is the handler boilerplate: quiet logging, the request body read by
its Content-Length, and a whole answer in one call.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

STOP_TIMEOUT_S = 60.0  # bounds a hang only: a stub's handler that never ends is a test bug
HANDLER_THREAD = "stub-http-handler"  # each connection's thread: a test counting its own skips it


class StubHandler(BaseHTTPRequestHandler):
    """Quiet, with the two things every stub does: read the body, send a whole answer."""

    def body(self, cap: int | None = None) -> bytes:
        """The request body (its Content-Length; at most ``cap`` bytes of it)."""
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n if cap is None else min(n, cap))

    def reply(self, status: int, body: bytes = b"", content_type: str | None = None,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Tracking(ThreadingHTTPServer):
    """Remembers each accepted connection and its handler thread, so stop() can end both."""

    daemon_threads = True  # joined by StubServer.stop, after their sockets are shut
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 reuse_address: bool) -> None:
        self.allow_reuse_address = reuse_address
        self.open: set[socket.socket] = set()
        self.handlers: list[threading.Thread] = []
        self.lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        t = threading.Thread(target=self.process_request_thread,
                             args=(request, client_address), daemon=True,
                             name=HANDLER_THREAD)
        with self.lock:
            self.open.add(request)
            self.handlers = [h for h in self.handlers if h.is_alive()]
            self.handlers.append(t)
        t.start()

    def shutdown_request(self, request: Any) -> None:
        with self.lock:
            self.open.discard(request)
        super().shutdown_request(request)


class StubServer:
    """``handler`` served on ``127.0.0.1:port`` (0: any free port) until :meth:`stop`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0,
                 reuse_address: bool = False) -> None:
        self.httpd = _Tracking(("127.0.0.1", port), handler, reuse_address)
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                        daemon=True, name="stub-http")
        self._thread.start()
        self._stopped = False

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop accepting, shut every open connection (a handler waiting for a keep-alive
        client's next request sees the end), join every thread, close the socket."""
        if self._stopped:
            return
        self._stopped = True
        self.httpd.shutdown()
        self._thread.join(STOP_TIMEOUT_S)
        with self.httpd.lock:
            still_open, handlers = list(self.httpd.open), list(self.httpd.handlers)
        for sock in still_open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for t in handlers:
            t.join(STOP_TIMEOUT_S)
        self.httpd.server_close()
        stuck = [t for t in handlers if t.is_alive()]
        assert not stuck and not self._thread.is_alive(), \
            f"a stub HTTP handler still running {STOP_TIMEOUT_S:g}s after stop"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
