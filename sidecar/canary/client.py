"""A minimal OpenAI-compatible client for ``/v1/completions`` (and, for the replay proxy,
``/v1/chat/completions``), standard library only.

The canary needs exactly one call: a prompt (token ids where the server takes them, so the
prompt length and block boundaries are exact), greedy decoding, the top-k logprobs of every
generated position, and the usage block the server reports. Every failure becomes a
:class:`CanaryError` whose message says what to fix, with a ``reason`` the exporter counts.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.canary.endpoint import CanaryError, Endpoint


class RequestFailed(CanaryError):
    """One request failed; ``reason`` is the ``reason`` label of the errors counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Completion:
    """One answer: generated tokens, the top-k logprobs per position and reported usage."""

    tokens: list[str]
    top_logprobs: list[dict[str, float]]
    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report it
    latency_s: float
    raw_usage: dict[str, Any] = field(default_factory=dict)


def parse_completion(body: dict[str, Any], latency_s: float) -> Completion:
    """Pull tokens, logprobs and usage out of a ``/v1/completions`` response."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise RequestFailed("protocol", "the server's answer has no choices: not an "
                            "OpenAI-compatible /v1/completions response") from None
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    if not isinstance(lp, dict) or not lp.get("top_logprobs"):
        raise RequestFailed("protocol", "the server returned no logprobs: the canary needs "
                            "a server that supports `logprobs` on /v1/completions")
    tokens = [str(t) for t in lp.get("tokens") or []]
    tops: list[dict[str, float]] = []
    for pos in lp["top_logprobs"]:
        if not isinstance(pos, dict):
            raise RequestFailed("protocol", "malformed top_logprobs in the server's answer")
        tops.append({str(k): float(v) for k, v in pos.items()})
    return _with_usage(body, tokens, tops, latency_s)


def parse_chat(body: dict[str, Any], latency_s: float) -> Completion:
    """The same from a ``/v1/chat/completions`` response (``logprobs.content``)."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise RequestFailed("protocol", "the server's answer has no choices: not an "
                            "OpenAI-compatible /v1/chat/completions response") from None
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or not content:
        raise RequestFailed("protocol", "the server returned no logprobs for a chat "
                            "completion: it does not support `logprobs`/`top_logprobs`")
    try:
        tokens = [str(pos["token"]) for pos in content]
        tops = [{str(t["token"]): float(t["logprob"]) for t in pos.get("top_logprobs") or []}
                for pos in content]
    except (KeyError, TypeError, ValueError):
        raise RequestFailed("protocol", "malformed logprobs in the server's chat "
                            "answer") from None
    return _with_usage(body, tokens, tops, latency_s)


def _with_usage(body: dict[str, Any], tokens: list[str], tops: list[dict[str, float]],
                latency_s: float) -> Completion:
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Completion(tokens, tops, int(usage.get("prompt_tokens") or 0),
                      None if cached is None else int(cached), latency_s, dict(usage))


class OpenAIClient:
    """``complete()`` over one keep-alive-free connection per request (simple, and a hung
    server costs one timeout, not a poisoned pool)."""

    def __init__(self, endpoint: Endpoint, model: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
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
        try:
            conn.request(method, url, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except ConnectionRefusedError:
            raise RequestFailed("connect", f"connection refused by {ep.root}: is the "
                                "server running on that port?") from None
        except TimeoutError:
            raise RequestFailed("timeout", f"{ep.root}{url} did not answer within "
                                f"{self.timeout_s:g}s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise RequestFailed("connect", f"cannot talk to {ep.root}: {exc}") from None
        finally:
            conn.close()

    def _json(self, status: int, raw: bytes, what: str) -> Any:
        if status != 200:
            snippet = raw[:300].decode("utf-8", "replace")
            raise RequestFailed("http", f"{what} answered HTTP {status}: {snippet}")
        try:
            return json.loads(raw)
        except ValueError:
            raise RequestFailed("protocol", f"{what} answered with something other than "
                                "JSON: is this an OpenAI-compatible endpoint?") from None

    def resolve_model(self) -> str:
        """The model to probe: the configured one, else the server's first ``/models``."""
        if self.model:
            return self.model
        status, raw = self._request("GET", "/models")
        body = self._json(status, raw, f"{self.endpoint.base}/models")
        try:
            self.model = str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise RequestFailed("protocol", f"{self.endpoint.base}/models lists no model: "
                                "pass --model") from None
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
