"""Kept-alive connections to the upstream, so a forwarded request does not pay a TCP connect
(and the upstream an accept, a thread or a task) each time: what the guard's overhead when
closed comes down to on loopback (``kv-sidecar bench perf --guard``).

Bounded: at most ``workers`` idle connections (a worker holds one at a time), each idle for
at most ``upstream_idle_s`` (shorter than servers' own keep-alive timeouts, uvicorn's 5 s,
so the proxy closes first and does not race the server's close). Before reuse a connection is
checked (a non-blocking peek): one the upstream closed or wrote to while idle is dropped.
"""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
import threading
import time

from sidecar.protect.http_messages import ForwardLimits


def _family(host: str) -> int | None:
    """The address family of an IP literal (no resolver call per connect), else None."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None


class UpstreamPool:
    def __init__(self, address: tuple[str, int], limits: ForwardLimits) -> None:
        self.address = address
        self.limits = limits
        self.max_idle = limits.workers
        self._family = _family(address[0])
        self._idle: list[tuple[socket.socket, float]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.stats = {"connects": 0, "reused": 0, "stale": 0}

    def take(self) -> tuple[socket.socket, bool]:
        """A connection and whether it was reused; raises OSError when none can be made."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    break
                sock, since = self._idle.pop()
            if now - since <= self.limits.upstream_idle_s and self._alive(sock):
                self.stats["reused"] += 1
                return sock, True
            self.stats["stale"] += 1
            sock.close()
        return self.connect(), False

    def connect(self) -> socket.socket:
        lim = self.limits
        if self._family is None:
            sock = socket.create_connection(self.address, timeout=lim.connect_timeout_s)
        else:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
            try:
                sock.settimeout(lim.connect_timeout_s)
                sock.connect(self.address)
            except OSError:
                sock.close()
                raise
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.stats["connects"] += 1
        return sock

    def give(self, sock: socket.socket) -> None:
        """Back to the pool after a complete answer (closed when the pool is full)."""
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    @staticmethod
    def _alive(sock: socket.socket) -> bool:
        """Nothing to read: an idle HTTP connection the server still holds. Readable means
        closed (EOF), reset, or bytes nobody asked for: not reusable either way. One poll
        (no fd-number limit, unlike select)."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
