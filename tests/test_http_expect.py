"""Issue 21: ``Expect: 100-continue`` as RFC 9110 10.1.1 has it, in the sidecar's HTTP server
and in the forwarding proxy (the guard's and the replay proxy's core), both real, on
127.0.0.1: ``100 Continue`` is sent once the head is accepted and only when the body will be
read (not for a body over the cap, which is refused 413 before the client sends it; not for
a request without a body; not to an HTTP/1.0 client); an expectation other than
``100-continue`` is answered 417. On 75d8333 the server sent its ``100 Continue`` only after
the body had arrived (a client waiting for it stalled) and ignored unknown expectations, and
the proxy sent one for bodiless and HTTP/1.0 requests and forwarded unknown expectations'
requests as if nothing had been asked."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from sidecar.export.http_reception import MAX_BODY_BYTES
from sidecar.export.server import SidecarServer
from sidecar.protect.forward import ForwardLimits, ForwardServer
from tests.stub_http import StubHandler, StubServer

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
PROXY_BODY_CAP = 4096
WAIT_S = 60.0  # bounds a hang only


@dataclass
class Target:
    """A server under test: where to connect, its body cap, the path that reads a body and
    answers ``ok_status``, and how many requests reached what stands behind it."""

    address: tuple[str, int]
    body_cap: int
    path: str
    ok_status: bytes
    reached: Callable[[], int]


@pytest.fixture(params=["sidecar_server", "forward_proxy"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    if request.param == "sidecar_server":
        srv = SidecarServer(CollectorRegistry(), lambda: {}).start()
        try:
            handled = srv.httpd.reception
            yield Target(("127.0.0.1", srv.port), MAX_BODY_BYTES, "/metrics", b"200",
                         lambda: handled.scrape_rounds + handled.healthz_answered)
        finally:
            srv.stop()
        return
    seen: list[bytes] = []

    class Upstream(StubHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            seen.append(self.body())
            self.reply(200, b"upstream")

    with StubServer(Upstream) as up:
        proxy = ForwardServer(up.address, limits=ForwardLimits(
            max_body_bytes=PROXY_BODY_CAP, buffer_budget_bytes=PROXY_BODY_CAP * 4)).start()
        try:
            yield Target(proxy.address, PROXY_BODY_CAP, "/v1/anything", b"200",
                         lambda: len(seen))
        finally:
            proxy.stop()


def _head(t: Target, length: int, expect: str | None = "100-continue",
          version: str = "HTTP/1.1") -> bytes:
    lines = [f"GET {t.path} {version}", "Host: x", f"Content-Length: {length}"]
    if expect is not None:
        lines.append(f"Expect: {expect}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_until(sock: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    sock.settimeout(WAIT_S)
    got = b""
    while not done(got):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _to_close(sock: socket.socket) -> bytes:
    return _read_until(sock, lambda _: False)


def _status(answer: bytes) -> bytes:
    return answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.") else answer[:40]


def test_continue_comes_before_the_body_and_once(target: Target) -> None:
    body = b"b" * 10
    with socket.create_connection(target.address, timeout=WAIT_S) as s:
        s.sendall(_head(target, len(body)))
        # A client that waits for it, as curl and Python's clients do: without it, this
        # read is what stalled (the old server sent it only after the body had come).
        first = _read_until(s, lambda got: b"\r\n\r\n" in got)
        assert first == CONTINUE
        s.sendall(body)
        rest = _to_close(s)
    assert _status(rest) == target.ok_status, rest[:80]
    assert CONTINUE not in rest  # not a second time
    assert target.reached() == 1


@pytest.mark.parametrize("expect", ["bananas", "100-continue, bananas", "100-continue=1"])
def test_an_unknown_expectation_is_417(target: Target, expect: str) -> None:
    with socket.create_connection(target.address, timeout=WAIT_S) as s:
        s.sendall(_head(target, 10, expect))
        answer = _to_close(s)
    assert _status(answer) == b"417", answer[:80]
    assert CONTINUE not in answer and target.reached() == 0


def test_a_body_over_the_cap_is_413_before_it_is_sent(target: Target) -> None:
    with socket.create_connection(target.address, timeout=WAIT_S) as s:
        s.sendall(_head(target, target.body_cap + 1))
        answer = _to_close(s)  # the client has sent no byte of its body
    assert _status(answer) == b"413", answer[:80]
    assert not answer.startswith(CONTINUE) and target.reached() == 0


def test_no_continue_without_a_body(target: Target) -> None:
    with socket.create_connection(target.address, timeout=WAIT_S) as s:
        s.sendall(_head(target, 0))
        answer = _to_close(s)
    assert _status(answer) == target.ok_status, answer[:80]
    assert CONTINUE not in answer


def test_an_http_1_0_clients_expectation_is_ignored(target: Target) -> None:
    with socket.create_connection(target.address, timeout=WAIT_S) as s:
        s.sendall(_head(target, 3, version="HTTP/1.0"))
        time.sleep(0.5)  # a 100 Continue would be sent now, before the body arrives
        s.sendall(b"abc")
        answer = _to_close(s)
    assert _status(answer) == target.ok_status, answer[:80]
    assert CONTINUE not in answer


def test_a_body_sent_without_waiting_needs_no_continue(target: Target) -> None:
    with socket.create_connection(target.address, timeout=WAIT_S) as s:
        s.sendall(_head(target, 3) + b"abc")
        answer = _to_close(s)
    assert _status(answer) == target.ok_status, answer[:80]
    assert target.reached() == 1
