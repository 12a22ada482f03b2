"""The HTTP server's front door: one thread that reads every request whole before a handler
thread is spent on it.

A slow client (slow-loris: one header byte every few seconds, each under a per-read
timeout) used to hold a handler thread per connection; 66 of them took all 64 and
``/healthz`` answered 503, which a liveness probe reads as "restart the pod" (issue 21).
Here a connection costs a buffer until its request line, headers and body (if any) have
all arrived, within one deadline for the whole request (not per byte). Then:

* ``GET /healthz`` is answered right here, on this thread: it never waits for a handler
  slot, so the orchestrator sees the truth however busy the pool is;
* anything else waits (oldest first) for a handler slot, at most
  ``max_per_peer_handlers`` of them per peer address, up to the same deadline, then 503;
  ``/metrics`` goes in rounds (:data:`SCRAPE_ROUNDS_PER_S`, all peers together).

A client that sends ``Expect: 100-continue`` gets ``100 Continue`` once its head is accepted
and its body is to be read (never before a 413 or another refusal); an expectation other
than ``100-continue`` is answered 417 (RFC 9110 10.1.1).

Connections held are bounded in total and per peer. A new connection over either bound
evicts the oldest still-incomplete one (of that peer, or of all) rather than being
refused: a request sent whole (a probe, a scrape) completes on its first read, so an
attacker trickling bytes loses its own connections first.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 8 * 1024  # no endpoint takes a body; a small one is read and ignored
# /metrics requests are handed to handlers in rounds, at most this many a second: every
# scrape waiting when a round starts goes (they share one cached body), later ones wait for
# the next round, holding no thread and burning no CPU. A storm of tight-loop scrapers then
# costs the engine's process a few rounds a second, not thousands of requests; Prometheus
# (one scrape per 15 s per target) only sees up to half a second more latency.
SCRAPE_ROUNDS_PER_S = 2.0


def response(code: int, reason: str, body: bytes, ctype: str = "text/plain; charset=utf-8",
             extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + body


BUSY = response(503, "Service Unavailable", b"busy\n", extra="Retry-After: 1\r\n")
TOO_LARGE = response(431, "Request Header Fields Too Large", b"request too large\n")
BODY_TOO_LARGE = response(413, "Content Too Large", b"request body too large\n")
BAD_REQUEST = response(400, "Bad Request", b"bad request\n")
TIMED_OUT = response(408, "Request Timeout", b"request not complete in time\n")
EXPECTATION_FAILED = response(417, "Expectation Failed",
                              b"unsupported expectation: only 100-continue is known\n")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(eq=False)
class Connection:
    """An accepted connection and what it has sent so far."""

    sock: socket.socket
    address: Any
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    head_end: int = -1  # index just past the blank line, once seen
    need: int = 0  # total bytes the request takes (head + body), once known
    method: str = ""
    path: str = ""
    released: bool = False  # a /metrics request whose round has come
    pending: bytes = b""  # the rest of a response the reception began to send
    # The client waits for "100 Continue" before sending its body (RFC 9110 10.1.1): set
    # once the head says so and the body will be read; cleared when it is sent.
    wants_continue: bool = False

    @property
    def peer(self) -> str:
        return str(self.address[0]) if isinstance(self.address, tuple) else str(self.address)

    def fileno(self) -> int:
        return self.sock.fileno()

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()


class Reception(threading.Thread):
    """See the module docstring. ``dispatch(conn)`` starts a handler (False: no slot free),
    ``healthz()`` is the ``/healthz`` answer (bytes of a whole response), ``close(sock)``
    ends a connection."""

    def __init__(self, dispatch: Callable[[Connection], bool], healthz: Callable[[], bytes],
                 close: Callable[[Any], None], deadline_s: float, max_held: int,
                 max_per_peer: int, max_per_peer_handlers: int,
                 scrape_rounds_per_s: float = SCRAPE_ROUNDS_PER_S,
                 fresh_scrape: Callable[[], bytes | None] | None = None) -> None:
        super().__init__(name="kvsidecar-http-reception", daemon=True)
        self._dispatch, self._healthz, self._close = dispatch, healthz, close
        self.deadline_s = deadline_s
        self.max_held = max_held
        self.max_per_peer = max_per_peer
        self.max_per_peer_handlers = max_per_peer_handlers
        self._fresh_scrape = fresh_scrape  # the whole /metrics response while cached
        self.scrapes_inline = 0
        self.round_gap_s = 1.0 / scrape_rounds_per_s if scrape_rounds_per_s > 0 else 0.0
        self._next_round = 0.0
        self.scrape_rounds = 0
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._new: deque[Connection] = deque()
        self._incomplete: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._by_peer: dict[str, OrderedDict[Connection, None]] = {}
        self._ready: list[Connection] = []
        self._in_handler: dict[str, int] = {}
        self._lock = threading.Lock()  # _in_handler: released from handler threads
        self._halt = threading.Event()
        self.idle_closed = 0  # incomplete at the deadline (idle, slow-loris)
        self.evicted = 0  # incomplete, pushed out by a newer connection over a bound
        self.rejected = 0  # complete, but no handler slot by the deadline (503)
        self.healthz_answered = 0
        self.refused = 0  # malformed or too large (4xx)

    # ---------------------------------------------------------------- other threads
    def add(self, sock: socket.socket, address: Any) -> None:
        self._new.append(Connection(sock, address, time.monotonic() + self.deadline_s))
        self.wake()

    def handler_done(self, conn: Connection) -> None:
        with self._lock:
            left = self._in_handler.get(conn.peer, 1) - 1
            if left > 0:
                self._in_handler[conn.peer] = left
            else:
                self._in_handler.pop(conn.peer, None)
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def stop(self) -> None:
        self._halt.set()
        self.wake()

    @property
    def held(self) -> int:
        return len(self._incomplete) + len(self._ready)

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self._step(0.02 if self._ready else 0.25)
        finally:
            for conn in [*self._incomplete, *self._ready, *self._new]:
                self._close(conn.sock)
            self.sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _step(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            if key.data is None:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                self._read(key.data)
        while self._new:
            self._admit(self._new.popleft())
        now = time.monotonic()
        self._dispatch_ready(now)
        while self._incomplete:  # oldest first: stop at the first still in time
            conn = next(iter(self._incomplete))
            if conn.deadline >= now:
                break
            self.idle_closed += 1
            self._drop(conn, TIMED_OUT if conn.data else None)

    def _admit(self, conn: Connection) -> None:
        peer = self._by_peer.get(conn.peer)
        if peer is not None and len(peer) >= self.max_per_peer:
            self.evicted += 1
            self._drop(next(iter(peer)), None)
        if self.held >= self.max_held:
            if not self._incomplete:  # everything held is a complete request: refuse
                self.rejected += 1
                self._send_close(conn.sock, BUSY)
                return
            self.evicted += 1
            self._drop(next(iter(self._incomplete)), None)
        try:
            conn.sock.setblocking(False)
            self.sel.register(conn.sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):
            self._close(conn.sock)
            return
        self._incomplete[conn] = None
        self._by_peer.setdefault(conn.peer, OrderedDict())[conn] = None

    def _forget(self, conn: Connection) -> None:
        if conn in self._incomplete:
            del self._incomplete[conn]
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.sel.unregister(conn.sock)
            peer = self._by_peer.get(conn.peer)
            if peer is not None:
                peer.pop(conn, None)
                if not peer:
                    del self._by_peer[conn.peer]

    def _drop(self, conn: Connection, answer: bytes | None) -> None:
        self._forget(conn)
        if answer is not None:
            self._send_close(conn.sock, answer)
        else:
            self._close(conn.sock)

    def _send_close(self, sock: socket.socket, answer: bytes) -> None:
        with contextlib.suppress(OSError):  # small: fits the send buffer, never blocks
            sock.setblocking(False)
            sock.send(answer)
        self._close(sock)

    def _read(self, conn: Connection) -> None:
        try:
            chunk = conn.sock.recv(8192)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client went away
            self._drop(conn, None)
            return
        start = max(0, len(conn.data) - 3)
        conn.data += chunk
        verdict = examine(conn, start)
        if verdict == MORE:
            if conn.wants_continue:  # the head is in, accepted: now the body may come
                conn.wants_continue = False
                with contextlib.suppress(OSError):  # 25 bytes: fits the send buffer
                    conn.sock.send(CONTINUE)
            return  # head or body still coming, within the same deadline
        if isinstance(verdict, bytes):
            self.refused += 1
            self._drop(conn, verdict)
            return
        self._forget(conn)
        if verdict == HEALTHZ:
            self.healthz_answered += 1
            self._send_close(conn.sock, healthz_answer(conn, self._healthz))
            return
        self._ready.append(conn)

    def _scrape_inline(self, conn: Connection) -> bool:
        """Answer a released scrape from the cached body on this thread (no handler thread
        for the storm's usual case); what the socket does not take at once goes to a
        handler (``pending``). False: no fresh body, a handler generates one."""
        answer = self._fresh_scrape() if self._fresh_scrape is not None else None
        if answer is None:
            return False
        try:
            sent = conn.sock.send(answer)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn.sock)
            return True
        if sent >= len(answer):
            self.scrapes_inline += 1
            self._close(conn.sock)
            return True
        conn.pending = answer[sent:]
        return False

    def _dispatch_ready(self, now: float) -> None:
        keep: list[Connection] = []
        waiting = [c for c in self._ready if c.path == "/metrics" and not c.released]
        if waiting and now >= self._next_round:  # a round: every scrape waiting now goes
            self.scrape_rounds += 1
            self._next_round = now + self.round_gap_s
            for conn in waiting:
                conn.released = True
        for conn in self._ready:
            with self._lock:
                busy = self._in_handler.get(conn.peer, 0)
            held_back = conn.path == "/metrics" and not conn.released
            if conn.released and not conn.pending and self._scrape_inline(conn):
                continue
            if not held_back and busy < self.max_per_peer_handlers and self._dispatch(conn):
                with self._lock:
                    self._in_handler[conn.peer] = self._in_handler.get(conn.peer, 0) + 1
            elif conn.deadline < now:
                self.rejected += 1
                self._send_close(conn.sock, BUSY)
            else:
                keep.append(conn)
        self._ready = keep


MORE, HEALTHZ, READY = "more", "healthz", "ready"


def examine(conn: Connection, start: int = 0) -> str | bytes:
    """What to do with ``conn`` after new bytes (``start``: where to look for the head's
    end): :data:`MORE` (incomplete), :data:`HEALTHZ` (answer it here), :data:`READY` (for a
    handler), or the error response to send before closing."""
    if conn.head_end < 0:
        end = _head_end(conn.data, start)
        if end < 0:
            return TOO_LARGE if len(conn.data) > MAX_HEADER_BYTES else MORE
        problem = _parse_head(conn, end)
        if problem is not None:
            return problem
    if len(conn.data) < conn.need:
        return MORE
    if conn.path == "/healthz" and conn.method in ("GET", "HEAD"):
        return HEALTHZ
    return READY


def healthz_answer(conn: Connection, healthz: Callable[[], bytes]) -> bytes:
    answer = healthz()
    return answer[:answer.index(b"\r\n\r\n") + 4] if conn.method == "HEAD" else answer


def _head_end(data: bytearray, start: int) -> int:
    """Index just past the blank line ending the head (CRLF or bare LF), or -1."""
    crlf = data.find(b"\r\n\r\n", start)
    lf = data.find(b"\n\n", start)
    ends = [i + 4 for i in (crlf,) if i >= 0] + [i + 2 for i in (lf,) if i >= 0]
    return min(ends) if ends else -1


def _parse_head(conn: Connection, end: int) -> bytes | None:
    """Method, path and body length from the head; an error response, or None."""
    conn.head_end = end
    head = bytes(conn.data[:end])
    if head.count(b"\r") != head.count(b"\r\n"):
        return BAD_REQUEST  # a bare CR ends a line for some parsers, not others (RFC 9112 2.2)
    lines = head.split(b"\n")
    parts = lines[0].strip().split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return BAD_REQUEST
    conn.method = parts[0].decode("latin-1")
    conn.path = parts[1].split(b"?", 1)[0].decode("latin-1")
    length = -1
    expected: set[bytes] = set()
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"expect":  # a list, maybe over several lines (RFC 9110 10.1.1)
            expected.update(m.strip().lower() for m in value.split(b",") if m.strip())
        if name == b"transfer-encoding":
            return BAD_REQUEST  # no endpoint takes a chunked body
        if name == b"content-length":
            text = value.strip()
            if not text.isdigit() or len(text) > 12 or not text.isascii():
                return BAD_REQUEST
            if length >= 0 and int(text) != length:
                return BAD_REQUEST  # two lengths: which body? (RFC 9112 6.3)
            length = int(text)
    length = max(length, 0)
    if expected - {b"100-continue"}:
        return EXPECTATION_FAILED
    if length > MAX_BODY_BYTES:
        return BODY_TOO_LARGE  # before the client sends it: no 100 Continue
    conn.need = end + length
    # 100 Continue only for a body still to come, to an HTTP/1.1 client (an HTTP/1.0 one's
    # expectation is ignored, RFC 9110 10.1.1); a body already arriving needs none.
    conn.wants_continue = bool(expected) and length > 0 and len(conn.data) == end \
        and parts[2] != b"HTTP/1.0"
    return None
