"""A hostile OpenAI-compatible server on 127.0.0.1, for the canary's reliability bench and
tests: it answers what a ``script`` says, byte for byte, and can be malformed, slow,
endless, silent or redirecting on purpose.

The script is called with ``(method, path, body)`` for each request and returns an
:class:`Answer`: a status line, headers and a body, and how to send it (all at once, one
byte every ``trickle_s``, an endless body, nothing at all, or a dropped connection).
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SEND_MODES = ("normal", "trickle", "endless", "silent", "close")


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = field(default_factory=lambda: {
        "Content-Type": "application/json"})
    mode: str = "normal"
    trickle_s: float = 2.0  # trickle: seconds between bytes


Script = Callable[[str, str, Any], Answer]


def completion(tops: list[dict[str, Any]], cached: int = 0, prompt: int = 8) -> dict[str, Any]:
    """A well-formed ``/v1/completions`` answer with these top logprobs."""
    return {"choices": [{"text": "x", "index": 0, "logprobs": {
        "tokens": [next(iter(t)) if t else "x" for t in tops], "top_logprobs": tops}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": len(tops),
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def honest(method: str, path: str, body: Any) -> Answer:
    """A consistent server: the same logprobs for the same prompt, no caching reported."""
    if path.endswith("/models"):
        return Answer(body=b'{"data": [{"id": "hostile"}]}')
    if path == "/metrics":
        return Answer(body=b"", headers={"Content-Type": "text/plain"})
    prompt = body.get("prompt", []) if isinstance(body, dict) else []
    n = int(body.get("max_tokens", 1)) if isinstance(body, dict) else 1
    k = int(body.get("logprobs", 1)) if isinstance(body, dict) else 1
    seed = sum(prompt) if isinstance(prompt, list) else 0
    tops = [{f"token_id:{(seed + i + j) % 50}": -1.0 - j for j in range(k)} for i in range(n)]
    return Answer(body=json.dumps(completion(tops, 0, len(prompt))).encode())


class HostileServer:
    """``with HostileServer(script) as srv:`` serves on ``srv.endpoint`` until the block
    ends; every trickling, endless or silent answer stops then too."""

    def __init__(self, script: Script = honest) -> None:
        self.script = script
        self.stop = threading.Event()
        self.requests = 0
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.tcp = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.tcp.serve_forever, args=(0.05,),
                                        daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.tcp.server_address[1]}/v1"

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.tcp.shutdown()
        self.tcp.server_close()

    # ------------------------------------------------------------------ one connection
    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(5.0)
        try:
            method, path, body = _read_request(sock)
        except (OSError, ValueError):
            return
        self.requests += 1
        answer = self.script(method, path, body)
        with contextlib.suppress(OSError):  # the client gave up (deadline, size cap)
            self._send(sock, answer)

    def _send(self, sock: socket.socket, a: Answer) -> None:
        if a.mode == "close":
            return
        if a.mode == "silent":
            self.stop.wait(60)
            return
        head = f"HTTP/1.1 {a.status} X\r\n" + "".join(f"{k}: {v}\r\n"
                                                      for k, v in a.headers.items())
        if a.mode == "endless":
            sock.sendall((head + "\r\n").encode())  # no length: the body runs to the close
            chunk = b"[" + b"0," * 32767
            while not self.stop.is_set():
                sock.sendall(chunk)
            return
        data = (head + f"Content-Length: {len(a.body)}\r\nConnection: close\r\n\r\n").encode()
        data += a.body
        if a.mode == "trickle":
            for i in range(len(data)):
                sock.sendall(data[i:i + 1])
                if self.stop.wait(a.trickle_s):
                    return
            return
        sock.sendall(data)
        time.sleep(0)


def _read_request(sock: socket.socket) -> tuple[str, str, Any]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("closed before the headers")
        buf += chunk
        if len(buf) > 1 << 20:
            raise ValueError("headers too long")
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            length = int(v.strip())
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    try:
        body = json.loads(rest) if rest else None
    except ValueError:
        body = None
    return method, path, body
