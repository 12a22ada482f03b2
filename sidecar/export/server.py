"""HTTP endpoints: ``/metrics`` (Prometheus exposition), ``/healthz``, ``/status`` (JSON).

A ``ThreadingHTTPServer`` on a daemon thread, bound to 127.0.0.1 unless told otherwise: the
sidecar is scraped by a local Prometheus or a pod-local agent, not exposed to the world.
Hardened so clients cannot hurt it or the engine beside it (issue 12, issue 21):

* every request is read whole (request line, headers, body) by one reception thread
  (:mod:`sidecar.export.http_reception`) within one deadline, ``timeout_s``, for the whole request,
  not per byte: a slow-loris client holds a buffer, never a handler thread;
* ``/healthz`` is answered on that thread, so it answers while every handler is busy;
* at most :data:`MAX_HANDLERS` handler threads (half of them per peer address), at most
  :data:`MAX_WAITING` connections held in all and :data:`MAX_PER_PEER` per peer; a response
  must be taken within its own deadline; one request per connection;
* ``/metrics`` is generated at most once a second however many scrape, concurrent scrapes
  sharing one generation (:mod:`sidecar.export.exposition`): scrape cost stays off the engine.

``/status`` never emits NaN (non-finite numbers become ``null``) and never answers 500 for
bad state. Opt-in auth: with a bearer token (:func:`load_token`: a file or an environment
variable) the control surface (``/status``, any future control endpoint) needs exactly one
``Authorization: Bearer <token>``; ``/metrics`` and ``/healthz`` stay open for probes.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import io
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from sidecar.export.exposition import DEFAULT_TTL_S, CachedExposition
from sidecar.export.http_reception import Connection, Reception, response

log = logging.getLogger(__name__)

BACKLOG = 256
MAX_HANDLERS = 64
MAX_WAITING = 1024  # connections held (their request not yet whole, or waiting for a slot)
MAX_PER_PEER = 256  # of those, from one peer address
CONNECTION_TIMEOUT_S = 5.0  # for a whole request, and for a whole response
TOKEN_ENV = "KVSIDECAR_TOKEN"
# A token is what a client can send in `Authorization: Bearer <token>`: RFC 6750's token68
# characters, and short enough to fit in a request head (every server here caps heads).
TOKEN68 = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
MAX_TOKEN_CHARS = 1024
PROTECTED = frozenset({"/status"})


def bearer_authorized(headers: Sequence[str], token: str) -> bool:
    """Exactly one ``Authorization: Bearer <token>`` (scheme case-insensitive, RFC 6750)
    with the token compared in constant time; a bare token, another scheme, two headers,
    trailing junk or whitespace other than SP/HTAB around it are refused. Every kv-sidecar
    server (the metrics server, the guard's /guard/*) checks its token here."""
    if len(headers) != 1:
        return False
    # Only SP and HTAB are whitespace around a field value (RFC 9110 5.5): str.strip()
    # would also take a form feed or a latin-1 NBSP off a wrong token.
    scheme, _, given = headers[0].strip(" \t").partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        given_bytes = given.strip(" ").encode("ascii")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(given_bytes, token.encode())


def load_token(path: str | os.PathLike[str] | None = None, env: str = TOKEN_ENV,
               environ: Mapping[str, str] | None = None) -> str | None:
    """The bearer token from ``path`` (first line) or the ``env`` variable; ``None`` (no
    auth) when neither is set. A set but empty or whitespace-only token is refused
    (``ValueError``, one line): taken as "no token" it would silently turn auth off; so is
    one no client could send (not RFC 6750 token68 characters, over ``MAX_TOKEN_CHARS``). The
    file must be a small regular UTF-8 file
    (:func:`sidecar.config.toml_file.read_small_text`)."""
    from sidecar.config.toml_file import MAX_TOKEN_BYTES, read_small_text

    environ = os.environ if environ is None else environ
    if path:
        lines = read_small_text(path, "token file", MAX_TOKEN_BYTES).splitlines()
        token = lines[0].strip() if lines else ""
        where = f"token file {path}"
    elif env in environ:
        token, where = environ[env].strip(), f"${env}"
    else:
        return None
    if not token:
        raise ValueError(f"{where} is empty or whitespace: refusing to run without auth "
                         f"by accident (unset it to turn auth off)")
    if not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"{where} holds whitespace or control characters inside the token")
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"{where} is {len(token)} characters long: at most "
                         f"{MAX_TOKEN_CHARS} fit in a request's Authorization header")
    if not TOKEN68.fullmatch(token):
        raise ValueError(f"{where} holds characters a client cannot send as a bearer token: "
                         f"use only A-Z a-z 0-9 - . _ ~ + / (and trailing =), RFC 6750")
    return token


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


class _DeadlineWriter(io.RawIOBase):
    """The handler's ``wfile``: the whole response must be taken by the client before
    ``deadline`` (a slow reader cannot hold a handler thread for ever, one byte at a
    time)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        sent = 0
        while sent < len(view):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("response not taken before the deadline")
            self.sock.settimeout(left)
            sent += self.sock.send(view[sent:])
        return sent


class _BoundedServer(ThreadingHTTPServer):
    """Accepts on ``serve_forever``'s thread, reads whole requests on the reception thread
    (:mod:`sidecar.export.http_reception`), and handles complete requests on at most
    ``max_handlers`` threads."""

    request_queue_size = BACKLOG
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_handlers: int, deadline_s: float, healthz: Callable[[], bytes],
                 max_held: int = MAX_WAITING, max_per_peer: int = MAX_PER_PEER,
                 max_per_peer_handlers: int | None = None,
                 fresh_scrape: Callable[[], bytes | None] | None = None) -> None:
        self._slots = threading.BoundedSemaphore(max_handlers)
        self.deadline_s = deadline_s
        super().__init__(address, handler)
        per_peer = max_per_peer_handlers or max(1, max_handlers // 2)
        self.reception = Reception(self.dispatch, healthz, self.shutdown_request, deadline_s,
                                   max_held, max_per_peer, per_peer,
                                   fresh_scrape=fresh_scrape)
        self.reception.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self.reception.add(request, client_address)  # no thread until it is whole

    def dispatch(self, conn: Connection) -> bool:
        """Start a handler thread for a complete request; False when none is free."""
        if not self._slots.acquire(blocking=False):
            return False
        try:
            ThreadingHTTPServer.process_request(self, conn, conn.address)  # type: ignore[arg-type]
        except BaseException:
            self._slots.release()
            self.shutdown_request(conn.sock)
            self.reception.handler_done(conn)
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            self.reception.handler_done(request)  # a waiting request may take the slot

    def server_close(self) -> None:
        # Also called by TCPServer.__init__ when bind fails, before there is a reception:
        # the caller then sees the OSError (port in use) alone, not an AttributeError on it.
        reception = getattr(self, "reception", None)
        if reception is not None:
            reception.stop()
            reception.join(2.0)
        super().server_close()


def _listen_error(exc: OSError, host: str, port: int) -> OSError:
    """``exc`` from binding the HTTP port, said with the address (the CLI prints it as its
    one error line; ``errno`` kept for callers)."""
    if exc.errno == errno.EADDRINUSE:
        msg = (f"port {port} on {host} is in use (another sidecar or demo?): pass --port 0 "
               "for any free port, or another port")
    else:
        msg = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    out = OSError(msg)
    out.errno = exc.errno
    return out


class SidecarServer:
    """``/metrics``, ``/healthz`` and ``/status`` on ``host:port`` (see the module docstring).
    ``timeout_s`` is the deadline for a whole request (head and body) and, separately, for
    the whole response; ``scrape_ttl_s`` how long one ``/metrics`` body is served."""

    def __init__(self, registry: CollectorRegistry, status: Callable[[], dict[str, Any]],
                 host: str = "127.0.0.1", port: int = 0,
                 health: Callable[[], dict[str, Any]] | None = None,
                 token: str | None = None, timeout_s: float = CONNECTION_TIMEOUT_S,
                 max_handlers: int = MAX_HANDLERS, max_per_peer: int = MAX_PER_PEER,
                 max_connections: int = MAX_WAITING,
                 scrape_ttl_s: float = DEFAULT_TTL_S) -> None:
        self.registry = registry
        self.status = status
        self.health = health
        self.token = token
        self.unauthorized = 0
        self.exposition = CachedExposition(registry, scrape_ttl_s)
        handler = self._handler(timeout_s)
        try:
            self.httpd = _BoundedServer((host, port), handler, max_handlers, timeout_s,
                                        self._healthz_response, max_connections,
                                        max_per_peer, fresh_scrape=self._fresh_scrape)
        except OSError as exc:  # said with the address and the way out, not errno alone
            raise _listen_error(exc, host, port) from None
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
        """Complete requests answered 503 because no handler slot freed in time."""
        return self.httpd.reception.rejected

    @property
    def idle_closed(self) -> int:
        """Connections closed because their request was not complete by the deadline."""
        return self.httpd.reception.idle_closed

    def start(self) -> SidecarServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        name="kvsidecar-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:  # serve_forever has returned: this ends at once
            self._thread.join(5.0)

    def authorized(self, headers: list[str]) -> bool:
        """:func:`bearer_authorized` against this server's token (``None``: open)."""
        return self.token is None or bearer_authorized(headers, self.token)

    def _health(self) -> tuple[int, bytes]:
        if self.health is None:
            return 200, b"ok\n"
        try:
            report = self.health()
            ok = bool(report.get("ok"))
            body = ("ok\n" if ok else "unhealthy\n") + json.dumps(finite(report),
                                                               sort_keys=True, default=str)
        except Exception as exc:
            ok, body = False, "unhealthy\n" + json.dumps({"ok": False,
                                                         "error": type(exc).__name__})
        return (200 if ok else 503), body.encode() + b"\n"

    def _fresh_scrape(self) -> bytes | None:
        """The whole ``/metrics`` response while the cached body is fresh, else ``None``."""
        body = self.exposition.fresh()
        return None if body is None else response(200, "OK", body, CONTENT_TYPE_LATEST)

    def _healthz_response(self) -> bytes:
        """The whole ``/healthz`` response, built on the reception thread."""
        code, body = self._health()
        return response(code, "OK" if code == 200 else "Service Unavailable", body)

    def _status(self) -> bytes:
        return json.dumps(finite(self.status()), indent=1, default=str,
                          allow_nan=False).encode()

    def _handler(self, timeout_s: float) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            """Handles one complete request, already read (``self.request`` is a
            :class:`~sidecar.export.http_reception.Connection`); one request per connection."""

            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                conn: Connection = self.request
                self.connection = conn.sock
                conn.sock.setblocking(True)
                self.rfile = io.BytesIO(bytes(conn.data))
                self.wfile = io.BufferedWriter(
                    _DeadlineWriter(conn.sock, time.monotonic() + timeout_s))

            def handle(self) -> None:
                conn: Connection = self.request
                if conn.pending:  # a scrape the reception began: send the rest
                    with contextlib.suppress(OSError):
                        self.wfile.write(conn.pending)
                    return
                super().handle()

            def finish(self) -> None:
                with contextlib.suppress(OSError):
                    self.wfile.flush()

            def handle_expect_100(self) -> bool:
                """The reception sent ``100 Continue`` before it read the body (or the
                body came without one); the body is read by now: never a second one."""
                return True

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    if path in PROTECTED and not server.authorized(
                            self.headers.get_all("Authorization") or []):
                        server.unauthorized += 1
                        self._send(401, "text/plain; charset=utf-8", b"unauthorized\n",
                                   {"WWW-Authenticate": 'Bearer realm="kv-sidecar"'})
                    elif path == "/metrics":
                        self._send(200, CONTENT_TYPE_LATEST, server.exposition.get())
                    elif path == "/healthz":  # normally answered by the reception
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
                self.send_header("Connection", "close")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: %s", format % args)

        return Handler
