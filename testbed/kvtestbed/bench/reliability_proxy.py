"""``bench reliability``: the replay proxy (and so the cache-bypass guard, which forwards
through the same core, :mod:`sidecar.protect.forward`) under hostile clients.

Every case is a raw request on its own connection: a valid one (must come back 200 with
its body echoed), a malformed or hostile head (bad request line, negative / malformed /
conflicting / huge Content-Length, chunked, too many or too long headers, more bytes than
declared), a body cut short, or a slow client (a few, with a short deadline). "Checked"
means the proxy answered with the status that case calls for, or closed a connection the
client abandoned; "lost" is a case with no answer or the wrong one; "escaped" is a case
after which the proxy no longer answered a valid request. At the end, the threads it runs
and the connections it holds must be back where they started.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvtestbed.bench.fuzz import FuzzResult

VALID = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"


def _echo_upstream() -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    return httpd


def _case(rng: random.Random, big: int) -> tuple[bytes, str | None, bool]:
    """(bytes to send, the status line prefix expected or None for a valid echo, whether
    the client closes its sending side after them)."""
    body = bytes(rng.randrange(32, 127) for _ in range(rng.randint(0, 64)))
    kind = rng.randrange(11)
    if kind == 0:
        return VALID % (len(body), body), None, False
    if kind == 1:
        cl = rng.choice([b"-1", b"-99999", b"abc", b"1e3", b" ", b"0x10", b"9" * 30])
        return b"POST / HTTP/1.1\r\nContent-Length: " + cl + b"\r\n\r\n", "400", False
    if kind == 2:
        return (b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (big + rng.randint(1, 2**40)),
                "413", False)
    if kind == 3:
        return b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "400", \
            False
    if kind == 4:
        return b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "411", False
    if kind == 5:
        return b"POST / HTTP/1.1\r\n" + b"X-A: b\r\n" * 150 + b"\r\n", "431", False
    if kind == 6:
        return b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", "431", False
    if kind == 7:
        line = rng.choice([b"GARBAGE", b"get / HTTP/1.1", b"GET http://evil/ HTTP/1.1",
                           b"GET / HTTP/2.0", b"\x00\xff\xfe", b"GET  / HTTP/1.1"])
        return line + b"\r\n\r\n", "400", False
    if kind == 8:
        return VALID % (len(body), body) + b"EXTRA", "400", False
    if kind == 9:  # a body cut short, then the client gives up
        return (b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (len(body) + 10) + body,
                "", True)
    bad = rng.choice([b"Bad Header",  # and a CR, LF or NUL an upstream would split on
                      b"X-A: a\nContent-Length: 50", b"X-A: a\rContent-Length: 50",
                      b"X\nContent-Length: 50", b"X-A: a\x00b", b"Content-Length:\x0b0"])
    return b"POST / HTTP/1.1\r\n" + bad + b"\r\n\r\n", "400", False


def _exchange(addr: tuple[str, int], data: bytes, half_close: bool) -> bytes:
    with socket.create_connection(addr, timeout=30) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the proxy answered and closed before reading it all
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def proxy_surface(cases: int, seed: int = 0) -> tuple[FuzzResult, dict[str, Any]]:
    from sidecar.canary.client import OpenAIClient
    from sidecar.canary.compare import Tolerance
    from sidecar.canary.endpoint import parse_endpoint
    from sidecar.canary.exporter import CanaryExporter
    from sidecar.canary.replay import ReplayProxy
    from sidecar.protect.forward import ForwardLimits

    rng = random.Random(seed)
    up = _echo_upstream()
    client = OpenAIClient(parse_endpoint(f"http://127.0.0.1:{up.server_address[1]}/v1"))
    limits = ForwardLimits(max_body_bytes=1 << 20, request_deadline_s=0.5, workers=4)
    threads_before = _threads()
    proxy = ReplayProxy(client, CanaryExporter("bench"), Tolerance("float32", 1), 10**9,
                        limits=limits).start()
    res = FuzzResult("replay proxy", "malformed heads, bad lengths, 413, 431, chunked, "
                                     "cut-short bodies, slow clients")
    extra: dict[str, Any] = {}
    addr = proxy.server.address
    try:
        threads_running = _threads()
        for i in range(cases):
            data, expect, half = _case(rng, limits.max_body_bytes)
            res.cases += 1
            answer = _exchange(addr, data, half)
            if expect is None:
                ok = answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(
                    data.split(b"\r\n\r\n", 1)[1])
            elif expect == "":
                ok = answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
            else:
                ok = answer.startswith(b"HTTP/1.1 " + expect.encode() + b" ")
            res.survived += int(ok)
            res.lost += int(not ok)
            if i % 50 == 49:  # still serving?
                probe = _exchange(addr, VALID % (2, b"ok"), False)
                res.escaped += int(not probe.startswith(b"HTTP/1.1 200 "))
        slow = [socket.create_connection(addr, timeout=30) for _ in range(20)]
        for s in slow:
            s.sendall(b"POST / HTTP")  # and nothing more: the deadline answers 408
        started = time.monotonic()
        answers = [_exchange_rest(s) for s in slow]
        extra["slow_clients"] = len(slow)
        extra["slow_answered_408"] = sum(a.startswith(b"HTTP/1.1 408 ") for a in answers)
        extra["slow_seconds"] = round(time.monotonic() - started, 2)
        res.cases += len(slow)
        res.survived += extra["slow_answered_408"]
        res.lost += len(slow) - extra["slow_answered_408"]
        deadline = time.monotonic() + 10
        while proxy.server.held() and time.monotonic() < deadline:
            time.sleep(0.01)
        extra["held_after"] = proxy.server.held()
        extra["threads_added"] = _threads() - threads_running
        extra["proxy_threads"] = threads_running - threads_before
        res.lost += int(extra["held_after"] != 0) + int(extra["threads_added"] > 0)
    finally:
        proxy.stop()
        up.shutdown()
        up.server_close()
    return res, extra


def _threads() -> int:
    """Threads of this process but the echo upstream's: it runs one per connection, and the
    proxy keeps its connections to the upstream alive (upstream_pool.py) by design."""
    return sum("process_request_thread" not in t.name for t in threading.enumerate())


def _exchange_rest(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    s.close()
    return out
