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

The forwarding itself is :class:`sidecar.protect.forward.ForwardServer` (bounded
connections and threads, a whole-request deadline, a body cap answering 413, timeouts to
the server, streaming pass-through); :class:`ReplayVerifier` is the replay half alone, which
the cache-bypass guard (:mod:`sidecar.protect.bypass_guard`) reuses for its verdicts.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient, RequestFailed
from sidecar.canary.compare import Tolerance, divergence
from sidecar.canary.exporter import CanaryExporter
from sidecar.protect.forward import ForwardApp, ForwardLimits, ForwardServer, Request
from sidecar.signals import DropReason

log = logging.getLogger(__name__)


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


class ReplayVerifier:
    """Replays jobs on one worker thread: the prompt with the cache and with a unique
    ``cache_salt``, compared with the canary's tolerance. ``on_verdict(anomalous)`` is told
    of every completed comparison (on the worker thread; it must not raise)."""

    def __init__(self, client: OpenAIClient, exporter: CanaryExporter, tolerance: Tolerance,
                 max_tokens: int = 4, logprobs: int = 5, queue_size: int = 8,
                 on_verdict: Callable[[bool], None] | None = None) -> None:
        self.client = client
        self.exporter = exporter
        self.tolerance = tolerance
        self.max_tokens = max_tokens
        self.logprobs = logprobs
        self.on_verdict = on_verdict
        self.on_error: Callable[[], None] | None = None  # a replay that got no verdict
        self._queue: queue.Queue[Job | None] = queue.Queue(queue_size)
        self.stats: dict[str, float] = {"forwarded": 0, "replayed": 0, "anomalies": 0,
                                         "dropped": 0, "errors": 0, "max_divergence": 0.0}
        self._stats_lock = threading.Lock()  # forwarding threads and the replay worker
        self._thread: threading.Thread | None = None

    def start(self) -> ReplayVerifier:
        self._thread = threading.Thread(target=self._replay_loop, name="canary-replay",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until every queued replay has been compared (for tests and shutdown)."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()
        threading.Thread(target=wait, daemon=True).start()
        done.wait(timeout_s)

    def _failed(self) -> None:
        if self.on_error is not None:
            try:
                self.on_error()
            except Exception:  # told, never taken down by the listener
                log.exception("canary replay: on_error failed")

    def _count(self, key: str, amount: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += amount

    def submit(self, path: str, body: bytes) -> bool:
        """Queue a replay of the request (False: not replayable, or dropped and counted)."""
        try:
            job = replayable(path, json.loads(body))
        except ValueError:
            return False
        if job is None:
            return False
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._count("dropped")
            self.exporter.metrics.inc(S.SAMPLES_DROPPED, reason=DropReason.QUEUE_FULL.value)
            return False
        return True

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
                self._failed()
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
            self._failed()
            return
        self.exporter.request("replay", hit)
        self.exporter.request("reference", ref)
        d = divergence(ref, hit).value
        tol = self.tolerance.value
        anomalous = d > tol
        if self.on_verdict is not None:  # first: whoever reads the stats sees its effect
            self.on_verdict(anomalous)
        self.exporter.verdict(d, tol, anomalous, hit.latency_s + ref.latency_s)
        self._count("replayed")
        self._count("anomalies", int(anomalous))
        with self._stats_lock:
            self.stats["max_divergence"] = max(self.stats["max_divergence"], d)
        if anomalous:
            log.warning("canary replay: cached answer diverges by %.3g (tolerance %.3g)",
                        d, tol)


class _ReplayApp(ForwardApp):
    def __init__(self, proxy: ReplayProxy) -> None:
        self.proxy = proxy

    def answered(self, request: Request, forwarded: bytes, status: int) -> None:
        self.proxy.verifier._count("forwarded")
        if request.method == "POST" and status == 200:
            self.proxy.maybe_sample(request.path, forwarded)


class ReplayProxy:
    """Forwards everything to the server unchanged and replays 1 in ``every`` completions
    requests through a :class:`ReplayVerifier`."""

    def __init__(self, client: OpenAIClient, exporter: CanaryExporter, tolerance: Tolerance,
                 every: int, max_tokens: int = 4, logprobs: int = 5, port: int = 0,
                 queue_size: int = 8, limits: ForwardLimits | None = None) -> None:
        self.every = every
        self._seen = itertools.count(1)
        self.verifier = ReplayVerifier(client, exporter, tolerance, max_tokens, logprobs,
                                       queue_size)
        ep = client.endpoint
        self.server = ForwardServer((ep.host, ep.port), ("127.0.0.1", port), limits,
                                    _ReplayApp(self), name="canary-proxy")

    @property
    def stats(self) -> dict[str, float]:
        return self.verifier.stats

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> ReplayProxy:
        self.verifier.start()
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.verifier.stop()

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until every forwarded request is finished (a sample is queued after its
        answer went out, which a client can read before that) and every replay compared."""
        deadline = time.monotonic() + timeout_s
        idle = threading.Event()
        while self.server.held() and time.monotonic() < deadline:
            idle.wait(0.01)
        self.verifier.drain(max(0.0, deadline - time.monotonic()))

    def maybe_sample(self, path: str, body: bytes) -> None:
        if not path.split("?", 1)[0].endswith("/completions"):
            return
        if next(self._seen) % self.every:
            return
        self.verifier.submit(path, body)
