"""A tiny stdlib OpenAI-compatible server on loopback that the canary tests (and the guard's)
run against, with switches for the ways a server lies, and the CLI helpers those tests share."""

from __future__ import annotations

import contextlib
import io
import json
import socket
from http.server import BaseHTTPRequestHandler
from typing import Any

from sidecar.cli.main import main
from tests.stub_http import StubHandler, StubServer

BLOCK = 4


class FakeServer:
    """An honest little prefix cache behind /v1/completions: cached tokens are the longest
    stored run of whole blocks (never the last prompt token), keyed by ``cache_salt``.
    Logprobs are a function of the prompt, so a hit and a miss answer alike unless
    ``corrupt`` shifts the answers that were served from the cache."""

    def __init__(self, logprobs: bool = True, salt: bool = True, corrupt: bool = False,
                 doctor: bool = False, metrics: bool = True) -> None:
        self.logprobs, self.salt, self.corrupt = logprobs, salt, corrupt
        self.doctor, self.metrics = doctor, metrics
        self.cache: set[tuple[Any, ...]] = set()
        self.hits = 0
        self.stuck_hits: int | None = None  # /metrics reports this hit count, if set
        self.fail_after: int | None = None  # completions answer HTTP 500 after this many
        self.requests = 0
        self.bodies: list[dict[str, Any]] = []
        self.stub: StubServer | None = None

    @property
    def port(self) -> int:
        assert self.stub is not None, "a FakeServer serves inside its with block"
        return self.stub.port

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """Chat on the same cache: the messages' characters are the prompt's tokens."""
        text = "".join(str(m.get("content", "")) for m in body["messages"])
        answer = self.complete({**body, "prompt": [ord(c) for c in text],
                                "logprobs": body.get("top_logprobs", 1)})
        choice = answer["choices"][0]
        lp = choice.pop("logprobs", None)
        choice["message"] = {"role": "assistant", "content": choice.pop("text")}
        if lp is not None and body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": tok, "logprob": top[tok],
                 "top_logprobs": [{"token": k, "logprob": v} for k, v in top.items()]}
                for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)]}
        return answer

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        prompt = list(body["prompt"])
        salt = body.get("cache_salt") if self.salt else None
        cached = 0
        for n in range(BLOCK, len(prompt), BLOCK):
            if (salt, *prompt[:n]) in self.cache:
                cached = n
        for n in range(BLOCK, len(prompt) + 1, BLOCK):
            self.cache.add((salt, *prompt[:n]))
        self.hits += cached
        self.requests += 1
        shift = 0.5 if self.corrupt and cached else 0.0
        tops = [{f"token_id:{(sum(prompt) + i + j) % 50}": -1.0 - j - 0.01 * i + shift
                 for j in range(body["logprobs"])} for i in range(body["max_tokens"])]
        reported = len(prompt) - 1 if self.doctor else cached
        choice: dict[str, Any] = {"text": "x" * body["max_tokens"], "index": 0}
        if self.logprobs:
            choice["logprobs"] = {"tokens": [next(iter(t)) for t in tops],
                                  "top_logprobs": tops}
        return {"choices": [choice], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": reported}}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(StubHandler):
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall per answer

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.reply(code, body, ctype)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, b'{"data": [{"id": "fake"}]}')
                elif self.path == "/metrics" and fake.metrics:
                    hits = fake.hits if fake.stuck_hits is None else fake.stuck_hits
                    text = (f'vllm:prefix_cache_hits_total{{model_name="fake"}} {hits}\n'
                            f'vllm:request_success_total{{model_name="fake"}} '
                            f'{fake.requests}\n')
                    self._send(200, text.encode(), "text/plain")
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                body = json.loads(self.body())
                if fake.fail_after is not None and fake.requests >= fake.fail_after:
                    self._send(500, b'{"error": "engine dead"}')
                    return
                answer = fake.chat(body) if self.path.endswith("/chat/completions") \
                    else fake.complete(body)
                self._send(200, json.dumps(answer).encode())

        return Handler

    def __enter__(self) -> FakeServer:
        self.stub = StubServer(self._handler())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stub is not None:
            self.stub.stop()


def _cli(*args: str) -> tuple[int, str]:
    """Exit code and stdout; errors (stderr) are appended so messages can be asserted."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["canary", *args])
    if rc == 2:
        return rc, err.getvalue() + out.getvalue()
    return rc, out.getvalue()


def _fast(endpoint: str, *extra: str) -> tuple[int, str]:
    return _cli("--endpoint", endpoint, "--block-size", str(BLOCK), "--dtype", "float32",
                "--min-rate", "1000", "--max-rate", "1000", "--calibration", "3", *extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
