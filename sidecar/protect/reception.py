"""The forwarding core's reception: one thread reads every connection's request with a
selector until it is complete, under the bounds of
:class:`~sidecar.protect.http_messages.ForwardLimits` (head size, body cap, deadline, shared
buffer budget), and hands complete requests to the forwarding workers
(:mod:`sidecar.protect.forward`). A slow client costs a buffer, not a thread, and gives its
connection up to a new one when every connection is held (oldest incomplete first)."""

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

from sidecar.protect.http_messages import (
    BadRequest,
    ForwardLimits,
    Request,
    error,
    parse_head,
    wants_continue,
)

log = logging.getLogger("sidecar.protect.forward")

TRIM_AFTER_BYTES = 1 << 20  # bodies this large are followed by a heap trim


class _Incoming:
    """A connection whose request is still arriving (reception thread only)."""

    __slots__ = ("buf", "deadline", "head_end", "length", "peer", "request", "reserved",
                 "sock", "watched")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.buf = bytearray()
        self.head_end = -1
        self.length = 0
        self.reserved = 0
        self.request: Request | None = None
        self.watched = False  # registered with the selector


class Heap:
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


class Reception:
    """The reception half of :class:`~sidecar.protect.forward.ForwardServer` (a mixin: the
    server owns the state, this reads requests into it)."""

    limits: ForwardLimits
    name: str
    stats: dict[str, int]
    _lock: threading.Lock
    _budget: int
    _held: int
    _heap: Heap
    _sock: socket.socket
    _ready: queue.SimpleQueue[_Incoming | None]
    _stop: threading.Event

    def _count(self, key: str, status: int | None = None) -> None:
        raise NotImplementedError

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
            full = self._take_slot()
            if full and pending:
                # Full while requests are still arriving: the one that has been arriving
                # longest gives its slot up (slow-loris clients would otherwise hold every
                # slot while real clients, whose requests arrive at once, get 503s).
                oldest = min(pending.values(), key=lambda c: c.deadline)
                self._count("evicted_incomplete")
                self._refuse(sel, pending, oldest, 408, "the request was still incomplete "
                             "when the proxy needed its connection")
                full = self._take_slot()
            if full:
                self._count("rejected_busy", 503)
                with contextlib.suppress(OSError):
                    sock.send(error(503, "proxy busy: too many connections").encode())
                sock.close()
                continue
            c = _Incoming(sock, f"{addr[0]}:{addr[1]}",
                          time.monotonic() + self.limits.request_deadline_s)
            fd = sock.fileno()
            pending[fd] = c
            # A client writes its request right after connecting: on loopback it is often
            # there already, and reading it now saves a trip round the selector (and the
            # selector's register and unregister, when it is complete).
            self._read(sel, pending, c)
            if fd in pending:
                sel.register(sock, selectors.EVENT_READ, c)
                c.watched = True

    def _take_slot(self) -> bool:
        """Take a connection slot; True when all ``max_connections`` are held."""
        with self._lock:
            if self._held >= self.limits.max_connections:
                return True
            self._held += 1
            self.stats["accepted"] += 1
            return False

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
            if c.watched:  # not when read whole at accept
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
        head = bytes(c.buf[:end])
        method, target, headers, length = parse_head(head)
        expects_continue = wants_continue(head, headers, length)  # 417 for another one
        if length > lim.max_body_bytes:  # refused before the client sends it: no 100
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
        if expects_continue and not tail:  # accepted, the body will be read: now send it
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
        if c.watched:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(c.sock)
            c.watched = False
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
