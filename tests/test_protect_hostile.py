"""The forwarding core and the guard against hostile peers (issue 25, item 5): request
smuggling shapes, header injection, an upstream that cuts its answer short, sends bytes past
its end or streams 1 GiB, and 10 000 idle client connections. Each case found broken was
fixed where it broke; each stays here as its regression test."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sidecar.protect.breaker import State
from sidecar.protect.bypass_guard import SALT_PREFIX, BypassGuard, GuardConfig
from sidecar.protect.forward import ForwardApp, ForwardLimits, ForwardServer, Request
from tests.test_protect_forward import Upstream, _post, _raw, _wait_for

Answer = Callable[[socket.socket, bytes], None]


class RawUpstream:
    """A loopback server whose answers are written by the test, byte for byte: ``answer``
    gets the connection and the request (head and body) and writes what it likes; the
    connection is kept open for the next request unless ``answer`` closes it."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", int(self._sock.getsockname()[1])

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        chunk = conn.recv(65536)
                    except OSError:
                        return
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                request, buf = head + b"\r\n\r\n" + buf[:length], buf[length:]
                self.requests.append(request)
                try:
                    self.answer(conn, request)
                except OSError:
                    return
                if conn.fileno() < 0:
                    return

    def close(self) -> None:
        """Shut the listening socket (a blocked accept returns), join the acceptor, then
        close. Closing first raced the acceptor: it could read the fd number just before it
        was closed and reused by the next test's server, and then accept that server's
        connections and answer them with this test's answers (CI: three tests got another
        test's answer, one hung in the stub server's accept)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(10)
        self._sock.close()


@pytest.fixture
def raw_upstream() -> Iterator[Callable[[Answer], RawUpstream]]:
    made: list[RawUpstream] = []

    def make(answer: Answer) -> RawUpstream:
        made.append(RawUpstream(answer))
        return made[-1]

    yield make
    for u in made:
        u.close()


class Told(ForwardApp):
    """Records what the proxy told its app was answered."""

    def __init__(self) -> None:
        self.answered_statuses: list[int] = []

    def answered(self, request: Request, forwarded: bytes, status: int) -> None:
        self.answered_statuses.append(status)


def _proxy(address: tuple[str, int], app: ForwardApp | None = None,
           **limits: Any) -> ForwardServer:
    return ForwardServer(address, limits=ForwardLimits(**limits), app=app).start()


POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok"


# ---------------------------------------------------------------- hostile clients
@pytest.mark.parametrize("head", [
    # a header smuggled inside another's value, for servers that end lines on LF alone
    b"POST / HTTP/1.1\r\nX-A: a\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\nok",
    b"POST / HTTP/1.1\r\nX-A: a\rTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\nok",
    b"POST / HTTP/1.1\nContent-Length: 2\r\n\r\nok",
    b"POST / HTTP/1.1\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    # the classic CL.TE / TE.CL shapes and their spellings
    b"POST / HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok",
    b"POST / HTTP/1.1\r\nTransfer-Encoding:\tchunked\r\nContent-Length: 2\r\n\r\nok",
    b"POST / HTTP/1.1\r\nTransfer-Encoding : chunked\r\nContent-Length: 2\r\n\r\nok",
    b"POST / HTTP/1.1\r\nContent-Length: 2\r\n Transfer-Encoding: chunked\r\n\r\nok",
    b"POST / HTTP/1.1\r\ntransfer-encoding: identity\r\nContent-Length: 2\r\n\r\nok",
    b"POST / HTTP/1.1\r\nContent-Length: +2\r\n\r\nok",
    b"POST / HTTP/1.1\r\nContent-Length: 2, 2\r\n\r\nok",
])
def test_smuggling_shapes_are_refused_before_anything_reaches_the_upstream(
        head: bytes) -> None:
    up = Upstream()
    proxy = _proxy(up.address)
    try:
        answer = _raw(proxy, head)
        assert answer[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 411"), answer[:80]
        assert not up.seen
    finally:
        proxy.stop()
        up.close()


def test_ten_thousand_idle_connections_are_bounded_and_then_served() -> None:
    """10 000 connections that send half a head and wait: at most max_connections are held
    (each new one displaces the oldest incomplete one, 408), no thread is added, and once the
    deadline has dropped the held ones, a request is served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = 10_000
    if hard < n + 1000:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {n + 1000}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, n + 1000), hard))
    up = Upstream()
    proxy = _proxy(up.address, max_connections=256, workers=4, request_deadline_s=2.0)
    threads = threading.active_count()
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(proxy.address, timeout=60)
            s.sendall(b"POST / HTTP/1.1\r\n")
            socks.append(s)
            assert proxy.held() <= 256
        # no thread added (a thread an earlier test left may end meanwhile: <=, not ==)
        assert threading.active_count() <= threads
        _wait_for(lambda: proxy.held() == 0, "the held ones dropped at their deadline")
        assert proxy.rejected.get(503, 0) + proxy.rejected.get(408, 0) == n
        assert proxy.stats["evicted_incomplete"] >= n - 256 * 10  # displaced, never queued
        status, _, body = _post(proxy, "/", b"after")
        assert status == 201 and body == b"after"
    finally:
        for s in socks:
            s.close()
        proxy.stop()
        up.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_real_request_is_served_while_slow_clients_hold_every_connection() -> None:
    """An outside check: one slow-loris client holding every slot (a byte every 0.5 s, under
    the deadline) starved the guard (16 of 86 real requests served in 30 s). A request that
    arrives whole takes the slot of the oldest incomplete one."""
    up = Upstream()
    proxy = _proxy(up.address, max_connections=16, workers=4, request_deadline_s=60.0)
    socks: list[socket.socket] = []
    try:
        for _ in range(16):
            s = socket.create_connection(proxy.address, timeout=60)
            s.sendall(b"POST / HTTP/1.1\r\n")
            socks.append(s)
        _wait_for(lambda: proxy.held() == 16, "every slot held by a slow client")
        for i in range(20):  # each served at once, none refused with a 503
            status, _, body = _post(proxy, "/", b"real %d" % i)
            assert status == 201 and body == b"real %d" % i
        # the first took a slow client's slot; the others the slot the one before freed
        assert proxy.rejected.get(503, 0) == 0 and proxy.stats["evicted_incomplete"] >= 1
        assert proxy.held() <= 16
    finally:
        for s in socks:
            s.close()
        proxy.stop()
        up.close()


# ---------------------------------------------------------------- hostile upstreams
@pytest.mark.parametrize("cut", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n5\r\nwor",
])
def test_an_answer_cut_short_is_an_upstream_error_not_an_answer(
        cut: bytes, raw_upstream: Callable[[Answer], RawUpstream]) -> None:
    def answer(conn: socket.socket, request: bytes) -> None:
        if request.startswith(b"POST /cut"):
            conn.sendall(cut)
            conn.close()
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    up = raw_upstream(answer)
    told = Told()
    proxy = _proxy(up.address, app=told)
    try:
        got = _raw(proxy, POST.replace(b"/v1/completions", b"/cut"))
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(cut.split(b"\r\n\r\n")[1])
        assert b"Connection: close" in got  # the client's copy of the head
        assert told.answered_statuses == [] and proxy.stats["upstream_errors"] == 1
        assert _raw(proxy, POST).endswith(b"\r\n\r\nok")  # served again, on a new connection
        assert told.answered_statuses == [200] and up.connections == 2
    finally:
        proxy.stop()


@pytest.mark.parametrize("extra", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsmuggl",  # a whole second answer
    b"garbage",
])
def test_bytes_past_an_answer_never_reach_the_next_client(
        extra: bytes, raw_upstream: Callable[[Answer], RawUpstream]) -> None:
    """An upstream that writes past the end of its answer (a desynchronised or hostile
    server): the connection is not reused, so the next client gets its own answer."""
    seen = [0]

    def answer(conn: socket.socket, request: bytes) -> None:
        seen[0] += 1
        body = b"first" if seen[0] == 1 else b"second"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                     + (extra if seen[0] == 1 else b""))

    up = raw_upstream(answer)
    proxy = _proxy(up.address)
    try:
        assert _raw(proxy, POST).endswith(b"\r\n\r\nfirst")
        assert _raw(proxy, POST).endswith(b"\r\n\r\nsecond")
        assert up.connections == 2
    finally:
        proxy.stop()


def test_a_kept_alive_connection_serves_the_next_request(
        raw_upstream: Callable[[Answer], RawUpstream]) -> None:
    """The other side of the two tests above: a clean answer leaves the connection to the
    upstream open, and the next request goes on it (no connect per request)."""
    up = raw_upstream(lambda conn, _: conn.sendall(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"))
    proxy = _proxy(up.address)
    try:
        for _ in range(5):
            assert _raw(proxy, POST).endswith(b"\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        assert up.connections == 1 and len(up.requests) == 5
        assert proxy.upstream_stats() == {"connects": 1, "reused": 4, "stale": 0}
    finally:
        proxy.stop()


def test_an_upstream_that_closed_an_idle_connection_costs_no_request(
        raw_upstream: Callable[[Answer], RawUpstream]) -> None:
    def answer(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        conn.shutdown(socket.SHUT_RDWR)  # keep-alive refused after the fact
        conn.close()

    up = raw_upstream(answer)
    proxy = _proxy(up.address)
    try:
        for _ in range(3):
            assert _raw(proxy, POST).endswith(b"\r\n\r\nok")
        assert len(up.requests) == 3 and proxy.stats["upstream_errors"] == 0
    finally:
        proxy.stop()


def test_a_1_gib_streamed_answer_goes_through_in_bounded_memory(
        raw_upstream: Callable[[Answer], RawUpstream]) -> None:
    size, piece = 1 << 30, b"d" * (1 << 20)

    def answer(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // len(piece)):
            conn.sendall(piece)

    up = raw_upstream(answer)
    proxy = _proxy(up.address)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    try:
        with socket.create_connection(proxy.address, timeout=120) as s:
            s.sendall(POST)
            buf = bytearray(1 << 20)
            got = 0
            while n := s.recv_into(buf):
                got += n
        head = len(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                   % size)
        assert got == head + size
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        assert grown_mib < 64, f"peak RSS grew {grown_mib:.0f} MiB relaying 1 GiB"
    finally:
        proxy.stop()


# ---------------------------------------------------------------- the guard's salt
def test_the_salt_cannot_be_chosen_or_used_to_inject_anything() -> None:
    """Open, the guard writes the salt into the JSON body it re-serialises: a client's own
    cache_salt is replaced, CR/LF and quotes in the body stay escaped JSON, the length is
    the new body's, and the upstream reads exactly one request with no header added."""
    up = Upstream()
    guard = BypassGuard(GuardConfig(upstream=up.address, model="m", verify_every=0)).start()
    try:
        guard.breaker.force(State.OPEN)
        hostile = {"prompt": "x\r\n\r\nGET /evil HTTP/1.1\r\nHost: y\r\n\r\n\"}",
                   "cache_salt": "kvsidecar-guard-chosen\r\nX-Injected: 1",
                   "model": "m"}
        status, _, _ = _post_json(guard, hostile)
        assert status == 201
        assert len(up.seen) == 1
        path, headers, forwarded = up.seen[0]
        sent = json.loads(forwarded)
        assert path == "/v1/completions" and int(headers["Content-Length"]) == len(forwarded)
        assert sent["prompt"] == hostile["prompt"] and sent["model"] == "m"
        assert sent["cache_salt"].startswith(SALT_PREFIX)
        assert sent["cache_salt"] != hostile["cache_salt"] and "\n" not in sent["cache_salt"]
        assert b"\r" not in forwarded and b"\n" not in forwarded
        assert not any(k.lower() == "x-injected" for k in headers)
    finally:
        guard.stop()
        up.close()


def _post_json(guard: BypassGuard, obj: Any) -> tuple[int, dict[str, str], bytes]:
    return _post(guard.server, "/v1/completions", json.dumps(obj).encode(),
                 {"Content-Type": "application/json"})
