"""Test-only proxy in front of a real server that doctors ``usage``: every completions
answer claims ``cached_tokens = prompt_tokens - 1`` (hits that never happened, the lie the
hit-rate audit must catch). Everything else passes through unchanged."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class UsageDoctor:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.rewritten = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> UsageDoctor:
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def doctor(self, raw: bytes) -> bytes:
        body = json.loads(raw)
        usage = body.get("usage") or {}
        usage["prompt_tokens_details"] = {"cached_tokens": max(0, usage["prompt_tokens"] - 1)}
        body["usage"] = usage
        self.rewritten += 1
        return json.dumps(body).encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        doc = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall per answer

            def _relay(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(n) if n else None
                conn = http.client.HTTPConnection("127.0.0.1", doc.upstream_port, timeout=60)
                conn.request(self.command, self.path, body=data,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                out = resp.read()
                if self.path.endswith("/completions") and resp.status == 200:
                    out = doc.doctor(out)
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.getheader("Content-Type") or "")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                conn.close()

            do_GET = do_POST = _relay

            def log_message(self, fmt: str, *args: Any) -> None:
                return None

        return Handler
