"""One bounded HTTP forwarding core: what every proxy kv-sidecar puts in front of a server
(the canary's replay proxy, the cache-bypass guard) is built on it, so the hardening is
written once.

Why each bound exists (a proxy in the request path must never be the thing that falls over):

* **A slow client costs a buffer, not a thread.** One reception thread reads every
  connection's request with a selector until it is complete; only a complete request goes
  to one of ``workers`` forwarding threads. 800 trickling connections hold 800 sockets and
  no extra thread.
* **A deadline for the whole request** (``request_deadline_s``), not per byte: a client
  that sends one byte every few seconds gets a 408 at the deadline.
* **Bounded memory.** At most ``max_connections`` connections are held (more get a 503 at
  once); a request head is at most ``max_header_bytes`` (431); a body over
  ``max_body_bytes`` gets a 413 before a byte of it is read; a negative, malformed or
  repeated ``Content-Length`` is a 400; all bodies held at once share
  ``buffer_budget_bytes`` (503 when spent). After a large body the heap is trimmed so that
  the memory goes back to the system instead of staying in the allocator's arenas.
* **Timeouts to the upstream**: connect, idle between bytes, and a total deadline for the
  answer; a client that stops reading the answer is dropped after ``write_timeout_s``.
* **Streaming pass-through**: the upstream's answer (an SSE stream included) is written to
  the client as it arrives, never buffered whole.

One request per connection (``Connection: close``): the simplest behaviour that cannot leak
a connection, and on loopback the extra connect costs microseconds against an engine's
milliseconds (measured by ``kv-sidecar bench perf --guard``).

What a proxy adds goes in a :class:`ForwardApp`: answer some paths itself, rewrite the
body it forwards, look at what was answered.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable

from sidecar.protect.http_messages import (
    HOP_BY_HOP,
    BadRequest,
    ForwardLimits,
    Reply,
    Request,
    error,
    header_list,
    parse_head,
    status_of,
)

__all__ = ["HOP_BY_HOP", "BadRequest", "ForwardApp", "ForwardLimits", "ForwardServer", "Reply",
           "Request", "error", "header_list", "parse_head"]
log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 1 << 20  # bodies this large are followed by a heap trim


class ForwardApp:
    """What a proxy adds to plain forwarding; every method runs on a forwarding thread and
    must not raise (a raise is logged, and the request is answered 502)."""

    def local(self, request: Request) -> Reply | None:
        """Answer ``request`` here instead of forwarding it (None: forward)."""
        return None

    def rewrite(self, request: Request) -> bytes:
        """The body to forward (default: unchanged)."""
        return request.body

    def answered(self, request: Request, forwarded: bytes, status: int) -> None:
        """Told after the upstream's answer went to the client in full."""


class _Incoming:
    """A connection whose request is still arriving (reception thread only)."""

    __slots__ = ("buf", "deadline", "head_end", "length", "peer", "request", "reserved",
                 "sock")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.buf = bytearray()
        self.head_end = -1
        self.length = 0
        self.reserved = 0
        self.request: Request | None = None


class _Heap:
    """``malloc_trim(0)`` after large bodies, so their pages go back to the system (glibc
    raises its mmap threshold after a large free and keeps later large blocks in arenas)."""

    def __init__(self) -> None:
        self._trim = None
        name = ctypes.util.find_library("c")
        with contextlib.suppress(OSError, AttributeError):
            self._trim = ctypes.CDLL(name).malloc_trim if name else None

    def trim(self) -> None:
        if self._trim is not None:
            self._trim(0)


class ForwardServer:
    """A bounded forwarding proxy on ``listen`` to ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0),
                 limits: ForwardLimits | None = None, app: ForwardApp | None = None,
                 name: str = "kvsidecar-proxy",
                 on_refused: Callable[[int], None] | None = None) -> None:
        self.upstream = upstream
        self.on_refused = on_refused  # told the status of every error the proxy answers
        self.limits = limits or ForwardLimits()
        self.app = app or ForwardApp()
        self.name = name
        self.stats: dict[str, int] = {"accepted": 0, "forwarded": 0, "answered_locally": 0,
                                      "rejected_busy": 0, "upstream_errors": 0,
                                      "client_errors": 0}
        self.rejected: dict[int, int] = {}  # status -> count, for answers the proxy gave
        self._lock = threading.Lock()
        self._budget = self.limits.buffer_budget_bytes
        self._held = 0
        self._heap = _Heap()
        self._sock = socket.create_server(listen, backlog=min(self.limits.max_connections,
                                                              1024))
        self._sock.setblocking(False)
        self._ready: queue.Queue[_Incoming | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> ForwardServer:
        self._threads.append(threading.Thread(target=self._reception, daemon=True,
                                              name=f"{self.name}-reception"))
        self._threads += [threading.Thread(target=self._worker, daemon=True,
                                           name=f"{self.name}-worker-{i}")
                          for i in range(self.limits.workers)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for _ in range(self.limits.workers):
            self._ready.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._sock.close()

    def held(self) -> int:
        """Connections held now (reading or being forwarded)."""
        with self._lock:
            return self._held

    def _count(self, key: str, status: int | None = None) -> None:
        with self._lock:
            self.stats[key] = self.stats.get(key, 0) + 1
            if status is not None:
                self.rejected[status] = self.rejected.get(status, 0) + 1
        if status is not None and self.on_refused is not None:
            self.on_refused(status)

    # ------------------------------------------------------------- reception (one thread)
    def _reception(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        pending: dict[int, _Incoming] = {}
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                soonest = min((c.deadline for c in pending.values()), default=now + 0.5)
                for key, _ in sel.select(max(0.0, min(soonest - now, 0.5))):
                    if key.data is None:
                        self._accept(sel, pending)
                    else:
                        self._read(sel, pending, key.data)
                now = time.monotonic()
                for c in [c for c in pending.values() if c.deadline <= now]:
                    self._refuse(sel, pending, c, 408, "the request did not arrive within "
                                 f"{self.limits.request_deadline_s:g}s")
        finally:
            for c in list(pending.values()):
                self._drop(sel, pending, c)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[int, _Incoming]) -> None:
        for _ in range(64):  # a burst of connects is accepted in one go
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: log, keep serving
                log.warning("%s: accept failed: %s", self.name, exc)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # the head and the body go as they are written
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                full = self._held >= self.limits.max_connections
                if not full:
                    self._held += 1
                    self.stats["accepted"] += 1
            if full:
                self._count("rejected_busy", 503)
                with contextlib.suppress(OSError):
                    sock.send(error(503, "proxy busy: too many connections").encode())
                sock.close()
                continue
            c = _Incoming(sock, f"{addr[0]}:{addr[1]}",
                          time.monotonic() + self.limits.request_deadline_s)
            pending[sock.fileno()] = c
            sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, sel: selectors.BaseSelector, pending: dict[int, _Incoming],
              c: _Incoming) -> None:
        """Read what arrived. The head accumulates in ``buf``; once it is parsed, ``buf``
        becomes the body, allocated once at its declared size and filled in place (no
        growing buffer, no copies of a large body)."""
        try:
            if c.request is None:
                data = c.sock.recv(65536)
                n = len(data)
            else:
                n = c.sock.recv_into(memoryview(c.buf)[c.head_end:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self._drop(sel, pending, c)
            return
        try:
            if c.request is None:
                c.buf += data
                self._head(c)
            else:
                c.head_end += n
        except BadRequest as exc:
            self._refuse(sel, pending, c, exc.status, str(exc))
            return
        if c.request is not None and c.head_end == c.length:
            sel.unregister(c.sock)
            del pending[c.sock.fileno()]
            c.request.body = c.buf  # type: ignore[assignment]  # bytes-like, not copied
            c.buf = bytearray()
            self._ready.put(c)

    def _head(self, c: _Incoming) -> None:
        """Parse the request head once it is complete; raises :class:`BadRequest`."""
        lim = self.limits
        end = c.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(c.buf) > lim.max_header_bytes:
                raise BadRequest(431, "request head too large")
            return
        if end > lim.max_header_bytes:
            raise BadRequest(431, "request head too large")
        method, target, headers, length = parse_head(bytes(c.buf[:end]))
        if length > lim.max_body_bytes:
            raise BadRequest(413, f"body of {length} bytes is over the proxy's "
                                  f"limit of {lim.max_body_bytes}")
        tail = c.buf[end + 4:]
        if len(tail) > length:
            raise BadRequest(400, "more bytes than Content-Length (pipelining is not "
                                  "supported)")
        with self._lock:
            if length > self._budget:
                raise BadRequest(503, "proxy busy: request buffers full")
            self._budget -= length
        c.reserved = length
        c.buf = bytearray(length)
        c.buf[:len(tail)] = tail
        c.head_end, c.length = len(tail), length  # head_end: body bytes received so far
        c.request = Request(method, target, headers, b"", c.peer)
        expect = c.request.header("Expect")
        if expect and expect.lower() == "100-continue" and not tail:
            with contextlib.suppress(OSError):
                c.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _refuse(self, sel: selectors.BaseSelector, pending: dict[int, _Incoming],
                c: _Incoming, status: int, message: str) -> None:
        self._count("client_errors", status)
        with contextlib.suppress(OSError):
            c.sock.send(error(status, message).encode())
        self._drop(sel, pending, c)

    def _drop(self, sel: selectors.BaseSelector, pending: dict[int, _Incoming],
              c: _Incoming) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(c.sock)
        pending.pop(c.sock.fileno(), None)
        self._release(c)

    def _release(self, c: _Incoming) -> None:
        with contextlib.suppress(OSError):
            c.sock.close()
        large = c.reserved >= TRIM_AFTER_BYTES
        c.buf = bytearray()
        if c.request is not None:
            c.request.body = b""
        with self._lock:
            self._budget += c.reserved
            self._held -= 1
        c.reserved = 0
        if large:
            self._heap.trim()

    # ------------------------------------------------------------- forwarding (workers)
    def _worker(self) -> None:
        while True:
            c = self._ready.get()
            if c is None:
                return
            try:
                c.sock.setblocking(True)
                c.sock.settimeout(self.limits.write_timeout_s)
                self._serve(c)
            except Exception:  # one request must never take a worker down
                log.exception("%s: forwarding failed", self.name)
            finally:
                self._release(c)

    def _serve(self, c: _Incoming) -> None:
        req = c.request
        assert req is not None, "only complete requests reach a worker"
        try:
            reply = self.app.local(req)
            body = self.app.rewrite(req) if reply is None else b""
        except Exception:
            log.exception("%s: the proxy's app failed on %s %s", self.name, req.method,
                          req.route)
            reply = error(502, "proxy error")
        if reply is not None:
            self._count("answered_locally")
            self._send(c.sock, reply.encode())
            return
        status = self._forward(c.sock, req, body)
        if status is not None:
            self._count("forwarded")
            try:
                self.app.answered(req, body, status)
            except Exception:
                log.exception("%s: answered() failed", self.name)

    def _forward(self, client: socket.socket, req: Request, body: bytes) -> int | None:
        """Send the request to the upstream with ``Connection: close`` and relay its answer
        byte for byte until the upstream closes (its own framing, chunked SSE included,
        goes through untouched: nothing is parsed but the status line). Returns the status,
        or None when no complete answer reached the client."""
        lim = self.limits
        host, port = self.upstream
        head = [f"{req.method} {req.path} HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in req.headers if k.lower() not in HOP_BY_HOP]
        if body or req.method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body)}")
        head.append("Connection: close")
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        deadline = time.monotonic() + lim.response_deadline_s
        try:
            upstream = socket.create_connection((host, port), timeout=lim.connect_timeout_s)
        except OSError as exc:
            self._count("upstream_errors", 502)
            self._send(client, error(502, f"upstream unreachable: {exc}").encode())
            return None
        status: int | None = None
        try:
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.settimeout(lim.upstream_timeout_s)
            try:
                upstream.sendall(message + bytes(body) if len(body) < 65536 else message)
                if len(body) >= 65536:
                    upstream.sendall(body)
            except OSError as exc:
                self._count("upstream_errors", 502)
                self._send(client, error(502, f"upstream refused the request: {exc}").encode())
                return None
            first = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                upstream.settimeout(min(lim.upstream_timeout_s, left))
                chunk = upstream.recv(65536)
                if not chunk:
                    break
                if status is None:
                    first += chunk
                    if b"\r\n" not in first and len(first) < 1024:
                        continue
                    status = status_of(first)
                    if status is None:
                        self._count("upstream_errors", 502)
                        self._send(client, error(502, "upstream answered no HTTP").encode())
                        return None
                    chunk, first = first, b""
                if not self._send(client, chunk):
                    return None
        except TimeoutError:
            if status is None:
                self._count("upstream_errors", 504)
                self._send(client, error(504, "upstream timed out").encode())
            else:
                log.warning("%s: upstream answer stalled or past its deadline: cut", self.name)
                self._count("upstream_errors")
            return None
        except OSError as exc:
            log.info("%s: upstream answer broke off: %s", self.name, exc)
            self._count("upstream_errors", None if status else 502)
            if status is None:
                self._send(client, error(502, f"upstream failed: {exc}").encode())
            return None
        finally:
            upstream.close()
        if status is None:
            self._count("upstream_errors", 502)
            self._send(client, error(502, "upstream closed without an answer").encode())
        return status

    def _send(self, sock: socket.socket, data: bytes) -> bool:
        try:
            sock.sendall(data)
            return True
        except OSError:  # the client went away or stopped reading past write_timeout_s
            return False
