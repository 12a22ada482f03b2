"""Test-only proxy in front of a real server that doctors ``usage``: every completions
answer claims ``cached_tokens = prompt_tokens - 1`` (hits that never happened, the lie the
hit-rate audit must catch). Everything else passes through unchanged."""

from __future__ import annotations

import http.client
import json
from http.server import BaseHTTPRequestHandler

from tests.stub_http import StubHandler, StubServer


class UsageDoctor:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.rewritten = 0
        self.stub: StubServer | None = None

    @property
    def url(self) -> str:
        assert self.stub is not None, "a UsageDoctor serves inside its with block"
        return self.stub.url

    def __enter__(self) -> UsageDoctor:
        self.stub = StubServer(self._handler())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stub is not None:
            self.stub.stop()

    def doctor(self, raw: bytes) -> bytes:
        body = json.loads(raw)
        usage = body.get("usage") or {}
        usage["prompt_tokens_details"] = {"cached_tokens": max(0, usage["prompt_tokens"] - 1)}
        body["usage"] = usage
        self.rewritten += 1
        return json.dumps(body).encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        doc = self

        class Handler(StubHandler):
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall per answer

            def _relay(self) -> None:
                data = self.body() or None
                conn = http.client.HTTPConnection("127.0.0.1", doc.upstream_port, timeout=60)
                conn.request(self.command, self.path, body=data,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                out = resp.read()
                if self.path.endswith("/completions") and resp.status == 200:
                    out = doc.doctor(out)
                self.reply(resp.status, out, resp.getheader("Content-Type") or "")
                conn.close()

            do_GET = do_POST = _relay

        return Handler
