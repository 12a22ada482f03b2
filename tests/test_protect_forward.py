"""The bounded forwarding core (sidecar/protect/forward.py) against real local servers:
pass-through (streaming included), and every bound issue 21 found missing in the replay
proxy (a thread per connection, no timeout, a 400 MB body buffered, Content-Length: -1)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar.protect.forward import ForwardApp, ForwardLimits, ForwardServer, Reply, Request
from tests.stub_http import HANDLER_THREAD, StubHandler, StubServer


class Upstream:
    """An echo server: answers the body it got; ``/stream`` sends two SSE chunks, the second
    only once ``release`` is set; ``/silent`` never answers until ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        up = self

        class H(StubHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.body()
                if self.path == "/drop":  # a large body: not kept, answered in two bytes
                    body = b"ok"
                else:
                    up.seen.append((self.path, dict(self.headers), body))
                if self.path == "/silent":
                    up.release.wait(30)
                    return
                if self.path == "/stream":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for part in (b"data: one\n\n", b"data: two\n\n"):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.flush()
                        up.release.wait(30)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self.reply(201, body, headers={"X-Upstream": "yes"})

            do_GET = do_POST

        self.stub = StubServer(H)

    @property
    def address(self) -> tuple[str, int]:
        return self.stub.address

    def close(self) -> None:
        self.release.set()
        self.stub.stop()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.close()


def _proxy(upstream: Upstream, app: ForwardApp | None = None, **limits: Any) -> ForwardServer:
    return ForwardServer(upstream.address, limits=ForwardLimits(**limits), app=app).start()


def _post(proxy: ForwardServer, path: str, body: bytes,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*proxy.address, timeout=30)
    try:
        conn.request("POST", path, body, headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _raw(proxy: ForwardServer, data: bytes) -> bytes:
    """Send ``data`` and read the answer until the proxy closes the connection."""
    with socket.create_connection(proxy.address, timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _wait_for(cond: Any, what: str) -> None:
    ev = threading.Event()
    for _ in range(600):
        if cond():
            return
        ev.wait(0.05)
    raise AssertionError(f"never happened: {what}")


def test_forwards_method_path_headers_and_body_unchanged(upstream: Upstream) -> None:
    proxy = _proxy(upstream)
    try:
        status, headers, body = _post(proxy, "/v1/completions?x=1", b'{"prompt": [1, 2]}',
                                      {"X-Client": "c1", "Content-Type": "application/json"})
        assert status == 201 and body == b'{"prompt": [1, 2]}'
        assert headers["x-upstream"] == "yes"  # the answer as the upstream sent it
        path, seen_headers, seen_body = upstream.seen[-1]
        assert path == "/v1/completions?x=1" and seen_body == b'{"prompt": [1, 2]}'
        assert seen_headers["X-Client"] == "c1"
        _wait_for(lambda: proxy.stats["forwarded"] == 1, "counted")
    finally:
        proxy.stop()
    assert proxy.held() == 0


def test_streams_pass_through_as_they_come(upstream: Upstream) -> None:
    """The first SSE event reaches the client while the upstream still holds the second."""
    proxy = _proxy(upstream)
    try:
        conn = http.client.HTTPConnection(*proxy.address, timeout=30)
        conn.request("POST", "/stream", b"{}")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        first = r.read1(65536)
        assert first == b"data: one\n\n"  # arrived before release: not buffered whole
        upstream.release.set()
        assert r.read() == b"data: two\n\n"
        conn.close()
    finally:
        proxy.stop()


def test_a_body_over_the_cap_gets_413_before_it_is_read(upstream: Upstream) -> None:
    proxy = _proxy(upstream, max_body_bytes=1 << 20)
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: 400000000\r\n\r\n")
        answer = _raw(proxy, head)  # no body sent at all: the answer cannot wait for it
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert proxy.rejected == {413: 1} and not upstream.seen
    finally:
        proxy.stop()


@pytest.mark.parametrize("length", [b"-1", b"abc", b"1e3", b"99999999999999999999"])
def test_a_bad_content_length_is_a_400_and_holds_nothing(upstream: Upstream,
                                                         length: bytes) -> None:
    proxy = _proxy(upstream)
    try:
        answer = _raw(proxy, b"POST / HTTP/1.1\r\nContent-Length: " + length + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        _wait_for(lambda: proxy.held() == 0, "the connection released")
    finally:
        proxy.stop()


def test_conflicting_lengths_and_chunked_requests_are_refused(upstream: Upstream) -> None:
    proxy = _proxy(upstream)
    try:
        two = _raw(proxy, b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx")
        chunked = _raw(proxy, b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert two.startswith(b"HTTP/1.1 400 ") and chunked.startswith(b"HTTP/1.1 411 ")
        assert not upstream.seen
    finally:
        proxy.stop()


def test_a_slow_client_gets_408_at_the_whole_request_deadline_and_holds_no_worker(
        upstream: Upstream) -> None:
    """One header byte at a time, each within any per-read timeout: the deadline is for the
    whole request. Meanwhile, with a single worker, other requests are served."""
    proxy = _proxy(upstream, request_deadline_s=1.0, workers=1)
    try:
        slow = socket.create_connection(proxy.address, timeout=30)
        slow.sendall(b"P")
        tick = threading.Event()
        answer = b""
        for b in b"OST / HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
            status, _, body = _post(proxy, "/", b"fast")  # served while the slow one trickles
            assert status == 201 and body == b"fast"
            try:
                slow.sendall(bytes([b]))
            except OSError:
                break
            tick.wait(0.05)
            if proxy.rejected.get(408):
                break
        _wait_for(lambda: proxy.rejected.get(408) == 1, "408 for the slow client")
        slow.settimeout(5)
        try:
            while chunk := slow.recv(65536):
                answer += chunk
        except ConnectionResetError:  # it was still sending when the proxy closed
            pass
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer
        _wait_for(lambda: proxy.held() == 0, "the slow connection released")
        slow.close()
    finally:
        proxy.stop()


def test_800_connections_hold_no_thread_and_excess_ones_displace_the_oldest(
        upstream: Upstream) -> None:
    before = threading.active_count()
    proxy = _proxy(upstream, max_connections=300, workers=4)
    socks = []
    try:
        assert threading.active_count() == before + 5  # reception + 4 workers, once
        for _ in range(800):
            socks.append(socket.create_connection(proxy.address, timeout=30))
            socks[-1].sendall(b"POST / HTTP/1.1\r\n")  # a request head, never finished
        _wait_for(lambda: proxy.held() == 300, "300 connections held")
        _wait_for(lambda: proxy.stats["evicted_incomplete"] == 500, "500 oldest displaced")
        assert proxy.rejected.get(408) == 500 and not proxy.rejected.get(503)
        assert threading.active_count() == before + 5
        for s in socks:
            s.close()
        _wait_for(lambda: proxy.held() == 0, "every connection released")
        status, _, _ = _post(proxy, "/", b"after")
        assert status == 201
    finally:
        for s in socks:
            s.close()
        proxy.stop()


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


DISCARD = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        left = int(self.headers["Content-Length"])
        while left:
            left -= len(self.rfile.read(min(left, 65536)))
        self.send_response(201); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
class S(ThreadingHTTPServer):
    request_queue_size = 64
s = S(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def test_large_bodies_are_forwarded_and_their_memory_returned() -> None:
    """Bodies up to the cap are forwarded; afterwards the process gives the memory back
    (the old replay proxy kept +420 MB after 400 MB POSTs). The upstream runs in its own
    process so that only the proxy's memory is measured here."""
    up = subprocess.Popen([sys.executable, "-c", DISCARD], stdout=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        port = int(up.stdout.readline())
        proxy = ForwardServer(("127.0.0.1", port), limits=ForwardLimits(
            max_body_bytes=8 << 20, buffer_budget_bytes=256 << 20)).start()
        big = b"x" * (6 << 20)  # under glibc's mmap threshold once it has risen: heap
        try:
            _post(proxy, "/", b"warm")
            base = _rss_mb()
            results: list[int] = []
            threads = [threading.Thread(target=lambda: results.append(
                _post(proxy, "/", big)[0])) for _ in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert results == [201] * 24, (results, proxy.stats, proxy.rejected)
            _wait_for(lambda: proxy.held() == 0, "released")
            grown = _rss_mb() - base
            assert grown < 40, f"RSS still {grown:.0f} MB above where it was"
        finally:
            proxy.stop()
    finally:
        up.kill()
        up.wait()


def test_upstream_down_is_502_and_upstream_silent_is_504(upstream: Upstream) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()
    proxy = ForwardServer(dead).start()
    try:
        assert _post(proxy, "/", b"x")[0] == 502
    finally:
        proxy.stop()
    proxy = _proxy(upstream, upstream_timeout_s=0.3)
    try:
        assert _post(proxy, "/silent", b"x")[0] == 504
    finally:
        proxy.stop()


def test_an_app_answers_its_paths_and_rewrites_the_rest(upstream: Upstream) -> None:
    class App(ForwardApp):
        answered_with: list[tuple[bytes, int]] = []

        def local(self, request: Request) -> Reply | None:
            return Reply(200, b"mine") if request.route == "/own" else None

        def rewrite(self, request: Request) -> bytes:
            return request.body.upper()

        def answered(self, request: Request, forwarded: bytes, status: int) -> None:
            self.answered_with.append((forwarded, status))

    app = App()
    proxy = _proxy(upstream, app)
    try:
        assert _post(proxy, "/own?q", b"x")[2] == b"mine"
        assert _post(proxy, "/v1", b"abc")[2] == b"ABC"
        _wait_for(lambda: app.answered_with == [(b"ABC", 201)], "answered() told")
        assert [s[2] for s in upstream.seen] == [b"ABC"]
    finally:
        proxy.stop()


def test_the_reliability_bench_surface_checks_every_case() -> None:
    """bench reliability's replay-proxy surface: each hostile case answered as it should
    be, the proxy still serving, no thread or connection left behind."""
    from kvtestbed.bench.reliability_proxy import proxy_surface

    row, extra = proxy_surface(200, seed=3)
    assert row.cases == 220 and row.survived == row.cases
    assert row.escaped == 0 and row.lost == 0
    assert extra["slow_answered_408"] == 20 and extra["held_after"] == 0
    assert extra["threads_added"] == 0


def test_the_replay_proxy_itself_is_bounded(upstream: Upstream) -> None:
    """Issue 21 break 7, on the replay proxy's own surface (its constructor as at 75d8333):
    a 400 MB Content-Length is a 413 at once, -1 is a 400, and 200 idle connections add no
    thread (the old proxy: a thread per connection, never closed)."""
    from sidecar.canary.client import OpenAIClient
    from sidecar.canary.compare import Tolerance
    from sidecar.canary.endpoint import parse_endpoint
    from sidecar.canary.exporter import CanaryExporter
    from sidecar.canary.replay import ReplayProxy

    client = OpenAIClient(parse_endpoint(f"http://127.0.0.1:{upstream.address[1]}/v1"))
    proxy = ReplayProxy(client, CanaryExporter("m"), Tolerance("float32", 1), 10).start()
    host, port = proxy.url.removeprefix("http://").split(":")
    addr = (host, int(port))
    socks: list[socket.socket] = []
    try:
        def raw(data: bytes) -> bytes:
            with socket.create_connection(addr, timeout=30) as s:
                s.sendall(data)
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
                return out

        assert raw(b"POST / HTTP/1.1\r\nContent-Length: 400000000\r\n\r\n").startswith(
            b"HTTP/1.1 413 ")
        assert raw(b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n").startswith(
            b"HTTP/1.1 400 ")
        def threads() -> int:  # the in-process upstream runs one per (kept-alive) connection
            return sum(t.name != HANDLER_THREAD for t in threading.enumerate())

        before = threads()
        for _ in range(200):  # under the default max_connections (256): all held
            socks.append(socket.create_connection(addr, timeout=30))
            socks[-1].sendall(b"POST / HTTP/1.1\r\n")
        assert raw(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nok").endswith(b"ok")
        assert threads() == before
    finally:
        for s in socks:
            s.close()
        proxy.stop()
