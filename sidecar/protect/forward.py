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
* **Bounded memory.** At most ``max_connections`` connections are held: a new one takes
  the slot of the request that has been arriving longest (408 to it, ``evicted_incomplete``),
  and only when every held request is complete does it get a 503 at once; a request head
  is at most ``max_header_bytes`` (431); a body over
  ``max_body_bytes`` gets a 413 before a byte of it is read; a negative, malformed or
  repeated ``Content-Length`` is a 400; all bodies held at once share
  ``buffer_budget_bytes`` (503 when spent). After a large body the heap is trimmed so that
  the memory goes back to the system instead of staying in the allocator's arenas.
* **Timeouts to the upstream**: connect, idle between bytes, and a total deadline for the
  answer; a client that stops reading the answer is dropped after ``write_timeout_s``.
* **Streaming pass-through**: the upstream's answer (an SSE stream included) is written to
  the client as it arrives, never buffered whole.

* **Cheap when it only forwards**: a fixed pool of forwarding threads (none spawned per
  request), kept-alive upstream connections (at most one idle per worker, each for at most
  ``upstream_idle_s``), the body forwarded as the bytes received (a proxy's app rewrites it
  only when it must), the answer relayed in large reads as it arrives. Measured by
  ``kv-sidecar bench perf --guard``.

One request per client connection (``Connection: close`` in every answer): the simplest
behaviour that cannot leak a connection or let one client's bytes reach another's answer.

The reception is :mod:`sidecar.protect.reception`, the upstream relay
:mod:`sidecar.protect.relay`; this module ties them to the forwarding workers. What a proxy
adds goes in a :class:`ForwardApp`: answer some paths itself, rewrite the
body it forwards, look at what was answered.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
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
)
from sidecar.protect.reception import Heap, Reception, _Incoming
from sidecar.protect.relay import Relay
from sidecar.protect.upstream_pool import UpstreamPool

__all__ = ["HOP_BY_HOP", "BadRequest", "ForwardApp", "ForwardLimits", "ForwardServer", "Reply",
           "Request", "error", "header_list", "parse_head"]
log = logging.getLogger(__name__)


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


class ForwardServer(Reception, Relay):
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
                                      "rejected_busy": 0, "evicted_incomplete": 0,
                                      "upstream_errors": 0, "client_errors": 0}
        self.rejected: dict[int, int] = {}  # status -> count, for answers the proxy gave
        self._lock = threading.Lock()
        self._budget = self.limits.buffer_budget_bytes
        self._held = 0
        self._heap = Heap()
        self._sock = socket.create_server(listen, backlog=min(self.limits.max_connections,
                                                              1024))
        self._sock.setblocking(False)
        self._ready: queue.SimpleQueue[_Incoming | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pool = UpstreamPool(upstream, self.limits)

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
        self._pool.close()

    def upstream_stats(self) -> dict[str, int]:
        """Connections to the upstream: made, reused (kept alive), dropped stale."""
        return dict(self._pool.stats)

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

    # ------------------------------------------------------------- forwarding (workers)
    def _worker(self) -> None:
        while True:
            c = self._ready.get()
            if c is None:
                return
            try:
                c.sock.settimeout(self.limits.write_timeout_s)  # blocking, bounded
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
