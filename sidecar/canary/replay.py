"""The replay proxy: forwards traffic to the server unchanged, and replays 1 in N real
``/v1/completions`` and ``/v1/chat/completions`` requests with the cache bypassed to check
the cached answers users get.

Real traffic is what a canary's synthetic prompts cannot cover: long shared system prompts,
real tokens, real concurrency. After forwarding a sampled request (the user's answer is
never delayed or altered), a worker sends the same prompt twice more at temperature 0 with
logprobs and only the first ``max_tokens`` tokens: once plainly (a hit on the prefix the
user's request just cached) and once with a unique ``cache_salt`` (a miss whatever the
cache holds), and compares them with the canary's tolerance. So the proxy needs a server
that honours ``cache_salt``; the canary's ``auto`` mode finds out.

Replays go to a bounded queue; when it is full a sample is dropped and counted
(``samples_dropped_total{reason="queue_full"}``), never queued without bound.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import queue
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient, RequestFailed
from sidecar.canary.compare import Tolerance, divergence
from sidecar.canary.exporter import CanaryExporter
from sidecar.signals import DropReason

log = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailers", "transfer-encoding", "upgrade", "host", "content-length"}


Job = tuple[str, Any, str | None]  # (kind: "completions" | "chat", prompt or messages, model)


def replayable(path: str, body: Any) -> Job | None:
    """What to replay of a request: the single prompt of a completions request or the
    messages of a chat request; None for anything else (batches, odd shapes)."""
    if not isinstance(body, dict):
        return None
    route = path.split("?", 1)[0]
    model = body.get("model")
    if route.endswith("/chat/completions"):
        msgs = body.get("messages")
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs):
            return ("chat", msgs, model)
        return None
    if not route.endswith("/completions"):
        return None
    p = body.get("prompt")
    if isinstance(p, str) and p:
        return ("completions", p, model)
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return ("completions", list(p), model)
    return None


class ReplayProxy:
    def __init__(self, client: OpenAIClient, exporter: CanaryExporter, tolerance: Tolerance,
                 every: int, max_tokens: int = 4, logprobs: int = 5, port: int = 0,
                 queue_size: int = 8) -> None:
        self.client = client
        self.exporter = exporter
        self.tolerance = tolerance
        self.every = every
        self.max_tokens = max_tokens
        self.logprobs = logprobs
        self._seen = itertools.count(1)
        self._queue: queue.Queue[Job | None] = queue.Queue(queue_size)
        self.stats: dict[str, float] = {"forwarded": 0, "replayed": 0, "anomalies": 0,
                                         "dropped": 0, "errors": 0, "max_divergence": 0.0}
        self._stats_lock = threading.Lock()  # handler threads and the replay worker
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> ReplayProxy:
        for target, name in ((lambda: self.httpd.serve_forever(0.1), "canary-proxy"),
                             (self._replay_loop, "canary-replay")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._queue.put(None)
        self._threads[-1].join(timeout=60)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until every queued replay has been compared (for tests and shutdown)."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()
        threading.Thread(target=wait, daemon=True).start()
        done.wait(timeout_s)

    def _count(self, key: str, amount: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += amount

    # ------------------------------------------------------------------ forwarding
    def forward(self, method: str, path: str, headers: dict[str, str],
                body: bytes) -> http.client.HTTPResponse:
        ep = self.client.endpoint
        conn = http.client.HTTPConnection(ep.host, ep.port, timeout=self.client.timeout_s)
        conn.request(method, path, body=body or None, headers=headers)
        return conn.getresponse()

    def maybe_sample(self, path: str, body: bytes) -> None:
        if not path.split("?", 1)[0].endswith("/completions"):
            return
        if next(self._seen) % self.every:
            return
        try:
            job = replayable(path, json.loads(body))
        except ValueError:
            return
        if job is None:
            return
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._count("dropped")
            self.exporter.metrics.inc(S.SAMPLES_DROPPED, reason=DropReason.QUEUE_FULL.value)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall per answer

            def _proxy(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in HOP_BY_HOP}
                try:
                    resp = proxy.forward(self.command, self.path, headers, body)
                except OSError as exc:
                    self.send_error(502, f"upstream unreachable: {exc}")
                    return
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                while chunk := resp.read1(65536):  # streams (SSE) pass through as they come
                    self.wfile.write(chunk)
                    self.wfile.flush()
                resp.close()
                proxy._count("forwarded")
                if self.command == "POST" and resp.status == 200:
                    proxy.maybe_sample(self.path, body)

            do_GET = do_POST = do_PUT = do_DELETE = _proxy

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("proxy: " + fmt, *args)

        return Handler

    # ------------------------------------------------------------------ replays
    def _replay_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._replay(*job)
            except Exception:  # a replay must never take the proxy down
                log.exception("canary replay failed")
                self._count("errors")
            finally:
                self._queue.task_done()

    def _replay(self, kind: str, prompt: Any, model: str | None) -> None:
        ask = self.client.chat if kind == "chat" else self.client.complete
        try:
            hit = ask(prompt, self.max_tokens, self.logprobs, model=model)
            ref = ask(prompt, self.max_tokens, self.logprobs, model=model,
                      salt=f"kvsidecar-replay-{uuid.uuid4().hex}")
        except RequestFailed as exc:
            self.exporter.error(exc.reason)
            self._count("errors")
            return
        self.exporter.request("replay", hit)
        self.exporter.request("reference", ref)
        d = divergence(ref, hit).value
        tol = self.tolerance.value
        anomalous = d > tol
        self.exporter.verdict(d, tol, anomalous, hit.latency_s + ref.latency_s)
        self._count("replayed")
        self._count("anomalies", int(anomalous))
        with self._stats_lock:
            self.stats["max_divergence"] = max(self.stats["max_divergence"], d)
        if anomalous:
            log.warning("canary replay: cached answer diverges by %.3g (tolerance %.3g)",
                        d, tol)
