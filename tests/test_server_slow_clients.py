"""Issue 21 break 1: slow clients, connection floods and scrape storms against the HTTP
server. Every wait here is on a condition (with a generous cap against hangs), never on a
wall-clock bound holding."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from sidecar.export.server import SidecarServer, load_token


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait(cond, cap_s: float = 60.0) -> bool:
    deadline = time.monotonic() + cap_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Loris:
    """``n`` connections each trickling one header byte every ``every_s`` (under the
    server's timeout), reconnecting when the server closes one: an attacker keeping up the
    pressure."""

    def __init__(self, port: int, n: int, every_s: float) -> None:
        self.port, self.n, self.every_s = port, n, every_s
        self.socks: list[socket.socket | None] = [None] * n
        self.closed_by_server = 0
        self.opened = 0
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        return s

    def _run(self) -> None:
        while not self.halt.is_set():
            for i in range(self.n):
                s = self.socks[i]
                try:
                    if s is None:
                        self.socks[i] = self._open()
                        self.opened += 1
                    else:
                        s.sendall(b"a")
                except OSError:
                    self.closed_by_server += 1
                    if s is not None:
                        s.close()
                    self.socks[i] = None
            self.halt.wait(self.every_s)

    def __enter__(self) -> Loris:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.thread.join(10)
        for s in self.socks:
            if s is not None:
                s.close()


def test_66_slow_loris_connections_cannot_take_healthz_or_the_handlers() -> None:
    """On 75d8333 the 66 trickling connections held all 64 handlers: /healthz and
    /metrics answered 503 for as long as it lasted, and none was ever closed (the
    timeout reset on every byte)."""
    srv = SidecarServer(CollectorRegistry(), dict, port=0, timeout_s=1.0).start()
    try:
        with Loris(srv.port, 66, every_s=0.3) as loris:
            assert _wait(lambda: loris.opened >= 66)
            time.sleep(0.5)  # let them reach the server (a head start, not a bound)
            answers = []
            # Through at least one whole generation of lorises cut by the deadline (they
            # trickle within the per-byte timeout, so only a whole-request deadline ends them).
            while srv.idle_closed < 66 or len(answers) < 10:
                answers.append(_get(srv.url + "/healthz")[0])
                answers.append(_get(srv.url + "/metrics")[0])
                assert set(answers) == {200}, answers
                assert len(answers) < 5000, "the trickling connections were never closed"
            assert _wait(lambda: loris.closed_by_server >= 1)  # the server ended them
        assert srv.httpd.reception.healthz_answered >= 5
    finally:
        srv.stop()


def test_per_peer_and_total_connection_limits_evict_the_oldest_incomplete() -> None:
    srv = SidecarServer(CollectorRegistry(), dict, port=0, timeout_s=30.0, max_per_peer=8,
                        max_connections=12).start()
    socks = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"GET /status HTTP/1.1\r\n")  # never finished
            socks.append(s)
        rec = srv.httpd.reception
        assert _wait(lambda: rec.evicted >= 12 and rec.held <= 8)
        assert _get(srv.url + "/healthz")[0] == 200  # same peer, over its limit: answered
        first = socks[0]
        first.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            assert first.recv(100) == b""  # the oldest was the one evicted
    finally:
        for s in socks:
            s.close()
        srv.stop()


class _Blocking:
    """A collector whose first collect blocks until released; counts collects."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def describe(self) -> list[object]:
        return []

    def collect(self):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.release.wait(60)
        yield GaugeMetricFamily("kvsidecar_test_gauge", "a test gauge", value=1.0)


def test_concurrent_scrapes_coalesce_into_one_generation() -> None:
    """On 75d8333 every scrape walked the registry itself: 16 scrapers, 16 generations."""
    registry = CollectorRegistry()
    slow = _Blocking()
    registry.register(slow)
    srv = SidecarServer(registry, dict, port=0, timeout_s=60.0, scrape_ttl_s=60.0).start()
    results: list[tuple[int, bytes]] = []
    threads = [threading.Thread(target=lambda: results.append(_get(srv.url + "/metrics")))
               for _ in range(16)]
    try:
        for t in threads:
            t.start()
        assert _wait(lambda: srv.exposition.waiting == 15)  # 1 generating, 15 waiting on it
        slow.release.set()
        for t in threads:
            t.join(60)
        assert len(results) == 16 and {code for code, _ in results} == {200}
        assert len({body for _, body in results}) == 1
        assert slow.calls == 1 and srv.exposition.generations == 1
        assert _get(srv.url + "/metrics")[0] == 200  # within the TTL: served, not generated
        assert slow.calls == 1
    finally:
        slow.release.set()
        srv.stop()


def test_bodies_and_heads_are_bounded() -> None:
    srv = SidecarServer(CollectorRegistry(), dict, port=0, timeout_s=5.0).start()
    try:
        for request, code in [
                (b"GET /status HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n", b"413"),
                (b"GET /status HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"400"),
                (b"GET /status HTTP/1.1\r\nX: " + b"a" * 20000, b"431"),
                (b"NONSENSE\r\n\r\n", b"400"),
                (b"GET /status HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcd", b"200")]:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            with contextlib.suppress(OSError):
                s.sendall(request)
            assert s.recv(12)[9:12] == code, request[:60]
            s.close()
    finally:
        srv.stop()


def test_bearer_auth_takes_exactly_one_well_formed_header() -> None:
    """On 75d8333 a bare token (no scheme) was accepted."""
    srv = SidecarServer(CollectorRegistry(), dict, port=0, token="t0ken").start()
    try:
        url = srv.url + "/status"
        assert _get(url, {"Authorization": "Bearer t0ken"})[0] == 200
        assert _get(url, {"Authorization": "bearer t0ken"})[0] == 200  # scheme: any case
        for bad in ("t0ken", "Basic t0ken", "Bearer t0ke", "Bearer t0ken2", "Bearer",
                    "Bearer t0ken junk", "Bearer t0k\u00e9n", ""):
            assert _get(url, {"Authorization": bad})[0] == 401, bad
        req = urllib.request.Request(url)
        req.add_unredirected_header("Authorization", "Bearer t0ken")
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(b"GET /status HTTP/1.1\r\nAuthorization: Bearer t0ken\r\n"
                  b"Authorization: Bearer other\r\n\r\n")
        assert s.recv(12)[9:12] == b"401"  # two headers: ambiguous, refused
        s.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_a_blank_token_is_an_error_not_auth_off(tmp_path, value) -> None:
    with pytest.raises(ValueError, match="empty or whitespace"):
        load_token(environ={"KVSIDECAR_TOKEN": value})
    path = tmp_path / "token"
    path.write_text(value)
    with pytest.raises(ValueError, match="empty or whitespace"):
        load_token(path)
    assert load_token(environ={}) is None  # unset: auth off, as documented
    with pytest.raises(ValueError, match="not a regular file"):
        load_token("/dev/zero")


@pytest.mark.parametrize("value, match", [("t\u00f6k\u00e9n\u2713", "cannot send"),
                                          ("a,b", "cannot send"), ("x" * 100_000, "long")])
def test_a_token_no_client_can_send_is_refused_at_start(tmp_path, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        load_token(environ={"KVSIDECAR_TOKEN": value})
    path = tmp_path / "token"
    path.write_text(value[:4000])
    with pytest.raises(ValueError, match=match if len(value) < 4000 else "long"):
        load_token(path)
    token = "A-z0.9_~+/" + "x" * 1000 + "=="
    assert load_token(environ={"KVSIDECAR_TOKEN": token}) == token
