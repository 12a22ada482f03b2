"""The guard salts every spelling of a salted route while open, and never forwards a
generation request it cannot salt as if it had (the outside tester's bypasses)."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
from collections.abc import Iterator

import pytest

from sidecar import signals as S
from sidecar.protect.breaker import State
from sidecar.protect.bypass_guard import SALT_PREFIX, BypassGuard, GuardConfig
from sidecar.protect.http_messages import normal_path
from tests.stub_http import StubHandler, StubServer


@contextlib.contextmanager
def recording_upstream() -> Iterator[tuple[int, list[tuple[str, bytes]]]]:
    """An upstream that records (path, body) of every POST and answers 200 {}."""
    seen: list[tuple[str, bytes]] = []

    class H(StubHandler):
        def do_POST(self) -> None:
            seen.append((self.path, self.body()))
            self.reply(200, b"{}")

    with StubServer(H) as stub:
        yield stub.port, seen


def _post(guard: BypassGuard, target: str, body: bytes, *extra: str) -> int:
    """A raw POST (urllib would normalise the target); the status answered."""
    host, port = guard.server.address
    head = [f"POST {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}",
            "Content-Type: application/json", *extra]
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return int(answer[9:12])


@contextlib.contextmanager
def open_guard() -> Iterator[tuple[BypassGuard, list[tuple[str, bytes]]]]:
    with recording_upstream() as (port, seen):
        guard = BypassGuard(GuardConfig(upstream=("127.0.0.1", port), model="m",
                                        verify_every=0)).start()
        try:
            guard.breaker.force(State.OPEN)
            yield guard, seen
        finally:
            guard.stop()


def _count(guard: BypassGuard, route: str) -> float:
    return guard.metrics.value(S.GUARD_REQUESTS.name, route=route)


@pytest.mark.parametrize("target, route", [
    ("/v1/completions", "/v1/completions"), ("/v1/completions/", "/v1/completions"),
    ("/v1//completions", "/v1/completions"), ("/v1/../v1/completions", "/v1/completions"),
    ("/v1/./chat//completions?x=1", "/v1/chat/completions?x=1"),
    ("/v1/%63ompletions", "/v1/completions"), ("/V1/completions", "/V1/completions"),
    ("/v1/responses", "/v1/responses"), ("/v1/messages", "/v1/messages"),
    ("/v1/embeddings", "/v1/embeddings"), ("/invocations", "/invocations"),
    ("//Invocations/", "/Invocations")])
def test_every_spelling_of_a_v1_post_is_salted_while_open(target: str, route: str) -> None:
    with open_guard() as (guard, seen):
        assert _post(guard, target, b'{"prompt": "hi"}') == 200
        (path, body), = seen
        assert path == route  # the path decided on is the one forwarded
        assert json.loads(body)["cache_salt"].startswith(SALT_PREFIX)
        assert _count(guard, "bypassed") == 1 and _count(guard, "forwarded") == 0


@pytest.mark.parametrize("body, extra, status", [
    (gzip.compress(b'{"prompt": "hi"}'), ("Content-Encoding: gzip",), 415),
    (b"not json", (), 400), (b'["a list"]', (), 400),
    # the outside tester's: a RecursionError was a 502 with a traceback per request; 1e400
    # went on as Infinity (not JSON); a 5,000-digit integer was "not a JSON object"
    (b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", (), 400),
    (b'{"prompt": "hi", "t": 1e400}', (), 400),
    (b'{"prompt": "hi", "n": ' + b"7" * 5000 + b"}", (), 400)])
def test_a_generation_request_it_cannot_salt_is_refused_while_open(
        body: bytes, extra: tuple[str, ...], status: int) -> None:
    with open_guard() as (guard, seen):
        assert _post(guard, "/v1/responses/", body, *extra) == status
        assert seen == []
        assert _count(guard, "refused") == 1 and _count(guard, "forwarded") == 0


def test_why_a_body_cannot_be_salted_is_said() -> None:
    from sidecar.protect.bypass_guard import LARGE_BODY_BYTES, salted

    assert salted(b"[" * 5000 + b"]" * 5000) == "a body nested too deep"
    assert salted(b'{"t": 1e400}') == "a body with a number beyond the float range"
    assert salted(b'{"n": ' + b"7" * 5000 + b"}") == "a body with an integer too long to read"
    big = b'{"prompt": [' + b",".join([b"1"] * (LARGE_BODY_BYTES // 2)) + b"]}"
    assert len(big) > LARGE_BODY_BYTES  # the one-at-a-time path
    assert json.loads(salted(big))["cache_salt"].startswith(SALT_PREFIX)


@pytest.mark.parametrize("target", ["//guard/status", "/GUARD/status", "/x/../guard/status",
                                    "/guard", "/guard/status/", "/guard/./status"])
def test_no_spelling_of_a_guard_path_goes_upstream(target: str) -> None:
    with recording_upstream() as (port, seen):
        guard = BypassGuard(GuardConfig(upstream=("127.0.0.1", port), model="m",
                                        verify_every=0, token="secret")).start()
        try:
            assert _post(guard, target, b"{}", "Authorization: Bearer wrong") == 401
            assert _post(guard, target, b"{}", "Authorization: Bearer secret") in (200, 404)
            assert seen == []
        finally:
            guard.stop()


def test_an_unsaltable_non_generation_post_is_counted_unprotected() -> None:
    with open_guard() as (guard, seen):
        assert _post(guard, "/v1/responses/r1/cancel", b"") == 200
        assert len(seen) == 1 and seen[0][1] == b""
        assert _count(guard, "unprotected") == 1 and _count(guard, "forwarded") == 0


def test_closed_forwards_as_sent() -> None:
    with open_guard() as (guard, seen):
        guard.breaker.force(State.CLOSED)
        assert _post(guard, "/v1/completions", b'{"prompt": "hi"}') == 200
        assert seen == [("/v1/completions", b'{"prompt": "hi"}')]
        assert _count(guard, "forwarded") == 1


def test_normal_path() -> None:
    assert normal_path("/a/b/../../../c/") == "/c"
    assert normal_path("http://h:1/v1//x?q") == "/v1/x"
    assert normal_path("/") == "/"


def test_a_reply_carries_its_own_reason_phrase() -> None:
    from sidecar.protect.http_messages import Reply

    assert Reply(401, b"").encode().startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert Reply(200, b"").encode().startswith(b"HTTP/1.1 200 OK\r\n")
    assert Reply(415, b"").encode().startswith(b"HTTP/1.1 415 Unsupported Media Type\r\n")
