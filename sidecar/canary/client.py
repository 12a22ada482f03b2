"""A minimal OpenAI-compatible client for ``/v1/completions`` (and, for the replay proxy,
``/v1/chat/completions``), standard library only.

The canary needs exactly one call: a prompt (token ids where the server takes them, so the
prompt length and block boundaries are exact), greedy decoding, the top-k logprobs of every
generated position, and the usage block the server reports. Every failure becomes a
:class:`RequestFailed` whose message says what to fix, with a ``reason`` the exporter counts.

A server under test may be broken in any way, so each request has bounds of its own: one
deadline for the whole exchange (connect, headers, body: a server trickling a byte every
2 s times out at the deadline, not per read; a watchdog shuts the socket), and a cap on the
answer's size (an endless body stops at :data:`MAX_ANSWER_BYTES`). Redirects are not
followed: a ``3xx`` is an ``http`` error naming where it points.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from typing import Any

from sidecar.canary.answers import Completion, RequestFailed, model_id, parse_chat, parse_completion
from sidecar.canary.endpoint import Endpoint

__all__ = ["MAX_ANSWER_BYTES", "Completion", "OpenAIClient", "RequestFailed", "parse_chat",
           "parse_completion"]

MAX_ANSWER_BYTES = 16 * 2**20  # a completion with logprobs is KBs; vLLM's /metrics ~1 MB


class OpenAIClient:
    """``complete()`` over one keep-alive-free connection per request (simple, and a hung
    server costs one timeout, not a poisoned pool)."""

    def __init__(self, endpoint: Endpoint, model: str | None = None,
                 timeout_s: float = 30.0, max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s  # for the whole request, not per read
        self.max_answer_bytes = max_answer_bytes
        self.model = model
        self.token_id_keys = True  # vLLM's return_tokens_as_token_ids; dropped if refused

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 base: str | None = None) -> tuple[int, bytes]:
        ep = self.endpoint
        conn_cls = (http.client.HTTPSConnection if ep.scheme == "https"
                    else http.client.HTTPConnection)
        conn = conn_cls(ep.host, ep.port, timeout=self.timeout_s)
        url = (ep.path if base is None else base) + path
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        expired = threading.Event()
        watchdog = threading.Timer(self.timeout_s, _expire, (conn, expired))
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            if expired.is_set():  # fired while connecting, before there was a socket
                raise TimeoutError
            conn.request(method, url, body=data, headers=headers)
            resp = conn.getresponse()
            raw = self._read_capped(resp, url)
            if expired.is_set():  # a shut socket reads as the end of the body
                raise TimeoutError
            return resp.status, raw
        except ConnectionRefusedError:
            raise RequestFailed("connect", f"connection refused by {ep.root}: is the "
                                "server running on that port?") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if expired.is_set() or isinstance(exc, TimeoutError):
                raise RequestFailed("timeout", f"{ep.root}{url} did not answer within "
                                    f"{self.timeout_s:g}s") from None
            raise RequestFailed("connect", f"cannot talk to {ep.root}: {exc}") from None
        finally:
            watchdog.cancel()
            conn.close()

    def _read_capped(self, resp: http.client.HTTPResponse, url: str) -> bytes:
        """The body, at most ``max_answer_bytes`` (refused early when the length says so)."""
        cap = self.max_answer_bytes
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > cap:
            raise RequestFailed("protocol", f"{url}: a {int(length)}-byte answer, over the "
                                f"{cap}-byte limit")
        chunks: list[bytes] = []
        got = 0
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            got += len(chunk)
            if got > cap:
                raise RequestFailed("protocol", f"{url}: the answer passed the {cap}-byte "
                                    "limit (an endless body?)")
            chunks.append(chunk)
        return b"".join(chunks)

    def _json(self, status: int, raw: bytes, what: str) -> Any:
        if status != 200:
            snippet = raw[:300].decode("utf-8", "replace")
            raise RequestFailed("http", f"{what} answered HTTP {status}: {snippet}")
        try:
            return json.loads(raw)
        except RecursionError:
            raise RequestFailed("protocol", f"{what} answered JSON nested too deep") from None
        except ValueError:
            raise RequestFailed("protocol", f"{what} answered with something other than "
                                "JSON: is this an OpenAI-compatible endpoint?") from None

    def resolve_model(self) -> str:
        """The model to probe: the configured one, else the server's first ``/models``."""
        if self.model:
            return self.model
        status, raw = self._request("GET", "/models")
        body = self._json(status, raw, f"{self.endpoint.base}/models")
        self.model = model_id(body, f"{self.endpoint.base}/models")
        return self.model

    def complete(self, prompt: list[int] | str, max_tokens: int, logprobs: int,
                 salt: str | None = None, model: str | None = None) -> Completion:
        body: dict[str, Any] = {"model": model or self.resolve_model(), "prompt": prompt,
                                "max_tokens": max_tokens, "temperature": 0.0,
                                "logprobs": logprobs, "stream": False}
        if salt is not None:
            body["cache_salt"] = salt
        if self.token_id_keys:
            body["return_tokens_as_token_ids"] = True
        started = time.perf_counter()
        status, raw = self._request("POST", "/completions", body)
        if status == 400 and self.token_id_keys and b"return_tokens_as_token_ids" in raw:
            self.token_id_keys = False  # a server without the extension: string keys
            return self.complete(prompt, max_tokens, logprobs, salt, model)
        latency = time.perf_counter() - started
        return parse_completion(self._json(status, raw, f"{self.endpoint.base}/completions"),
                                latency)

    def chat(self, messages: list[dict[str, Any]], max_tokens: int, logprobs: int,
             salt: str | None = None, model: str | None = None) -> Completion:
        """A greedy chat completion with the top-k logprobs of each generated token."""
        body: dict[str, Any] = {"model": model or self.resolve_model(), "messages": messages,
                                "max_tokens": max_tokens, "temperature": 0.0,
                                "logprobs": True, "top_logprobs": logprobs, "stream": False}
        if salt is not None:
            body["cache_salt"] = salt
        if self.token_id_keys:
            body["return_tokens_as_token_ids"] = True
        started = time.perf_counter()
        status, raw = self._request("POST", "/chat/completions", body)
        if status == 400 and self.token_id_keys and b"return_tokens_as_token_ids" in raw:
            self.token_id_keys = False
            return self.chat(messages, max_tokens, logprobs, salt, model)
        latency = time.perf_counter() - started
        return parse_chat(self._json(status, raw, f"{self.endpoint.base}/chat/completions"),
                          latency)

    def metrics_text(self) -> str | None:
        """The server's Prometheus ``/metrics`` at its root, or None where it has none."""
        try:
            status, raw = self._request("GET", "/metrics", base="")
        except RequestFailed:
            return None
        return raw.decode("utf-8", "replace") if status == 200 else None


def _expire(conn: http.client.HTTPConnection, expired: threading.Event) -> None:
    """The deadline passed: shut the socket so the blocked read returns now."""
    expired.set()
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
