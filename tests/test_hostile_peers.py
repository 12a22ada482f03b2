"""Issue 21, tried from outside: hostile HTTP peers the other suites do not send, against the
sidecar's server and the forwarding proxy (the guard's and the replay proxy's core), both
real, on 127.0.0.1.

Breaks found (each case fails before the fix): a bare CR or LF inside a header value went
through the proxy to the upstream, whose parser ends the line there: a second
``Content-Length`` smuggled past the proxy's framing (the upstream waited for a body the
proxy never sent); a form feed, vertical tab or latin-1 NBSP after a bearer token was
stripped (``str.strip``) and the request let in; two different ``Content-Length`` values
reached the server's handler."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.export.server import SidecarServer
from sidecar.protect.forward import ForwardApp, ForwardServer
from tests.stub_http import StubHandler, StubServer

TOKEN = "tok-123"


def _exchange(addr: tuple[str, int], data: bytes) -> bytes:
    with socket.create_connection(addr, timeout=30) as s:
        with contextlib.suppress(OSError):  # answered and closed before all was read
            s.sendall(data)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
        return out


def _status(answer: bytes) -> bytes:
    return answer[9:12]


@pytest.fixture
def server() -> Iterator[SidecarServer]:
    srv = SidecarServer(CollectorRegistry(), lambda: {"ok": 1}, port=0, token=TOKEN,
                        timeout_s=2.0).start()
    yield srv
    srv.stop()


def _get(srv: SidecarServer, head: bytes) -> bytes:
    return _exchange(("127.0.0.1", srv.port), head)


@pytest.mark.parametrize("value", [
    f"Bearer {TOKEN}\x0c".encode(),  # form feed
    f"Bearer {TOKEN}\x0b".encode(),  # vertical tab
    f"\x0bBearer {TOKEN}".encode(),
    f"Bearer {TOKEN}".encode() + b"\xa0",  # latin-1 NBSP, as the header is decoded
    f"Bearer {TOKEN}".encode() + b"\x85",  # latin-1 NEL
    f"Bearer {TOKEN}\x1c".encode(),  # a file separator: whitespace to str.strip
    f"Bearer\xa0{TOKEN}".encode("latin-1"),
])
def test_whitespace_beyond_sp_and_htab_around_a_token_is_refused(server: SidecarServer,
                                                                   value: bytes) -> None:
    answer = _get(server, b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: " + value
                  + b"\r\n\r\n")
    assert _status(answer) == b"401", answer[:80]


@pytest.mark.parametrize("value", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"\tBearer {TOKEN}\t",
                                   f"Bearer  {TOKEN}", f" BEARER {TOKEN} "])
def test_the_token_with_optional_whitespace_is_let_in(server: SidecarServer,
                                                      value: str) -> None:
    answer = _get(server, b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: "
                  + value.encode() + b"\r\n\r\n")
    assert _status(answer) == b"200", answer[:80]


@pytest.mark.parametrize("head", [
    b"GET /status HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\rX: y\r\n\r\n",
    b"POST /status HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 5\r\n\r\nabcde",
    b"POST /status HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\nabc\r\n0\r\n\r\n",
    "POST /status HTTP/1.1\r\nContent-Length: \u0665\r\n\r\nx".encode(),
])
def test_ambiguous_framing_is_a_400(server: SidecarServer, head: bytes) -> None:
    assert _status(_get(server, head)) == b"400"


def test_huge_request_line_and_10k_header_fields_are_431(server: SidecarServer) -> None:
    line = b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n"
    fields = b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i
                                                       for i in range(10_000)) + b"\r\n"
    assert _status(_get(server, line)) == b"431"
    assert _status(_get(server, fields)) == b"431"
    assert _status(_get(server, b"GET /healthz HTTP/1.1\r\n\r\n")) == b"200"


def test_pipelined_requests_get_one_answer_and_a_close(server: SidecarServer) -> None:
    answer = _get(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
    assert answer.count(b"HTTP/1.1 ") == 1 and _status(answer) == b"200"
    assert b"Connection: close" in answer


# ------------------------------------------------------------------ the forwarding proxy
class _Upstream:
    """Echoes the first KiB of each POST body; keeps the headers it saw."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        up = self

        class H(StubHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                up.seen.append(dict(self.headers))
                self.reply(200, self.body(cap=1024))

        self.stub = StubServer(H)

    def close(self) -> None:
        self.stub.stop()


@pytest.fixture
def proxy() -> Iterator[tuple[ForwardServer, _Upstream]]:
    up = _Upstream()
    try:
        px = ForwardServer(up.stub.address, app=ForwardApp()).start()
        try:
            yield px, up
        finally:
            px.stop()
    finally:
        up.close()


@pytest.mark.parametrize("head", [
    b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\nContent-Length: 50\r\nContent-Length: 0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\rContent-Length: 50\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nX\nContent-Length: 50\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length:\x0b5\r\n\r\nabcde",
    b"POST /a\nb HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    "P\u00d6ST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode("latin-1"),
])
def test_the_proxy_refuses_what_the_upstream_would_parse_otherwise(
        proxy: tuple[ForwardServer, _Upstream], head: bytes) -> None:
    px, up = proxy
    answer = _exchange(px.address, head)
    assert _status(answer) == b"400", answer[:80]
    assert up.seen == []  # nothing smuggled through


def test_the_proxy_still_forwards_a_clean_request(
        proxy: tuple[ForwardServer, _Upstream]) -> None:
    px, up = proxy
    answer = _exchange(px.address, b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\tb\r\n"
                                   b"Content-Length: 3\r\n\r\nabc")
    assert _status(answer) == b"200" and answer.endswith(b"abc")
    assert up.seen[0]["X-A"] == "a\tb"
