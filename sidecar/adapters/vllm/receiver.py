"""The sidecar's end of the probe pipe: a ZMQ PULL socket drained by a daemon thread.

It turns probe messages into calls: ``lookups`` and sampled ``capture`` messages into
``on_lookup``-style callbacks (the caller forwards them to the Monitor), reference captures
into the result of the engine-side recompute that asked for them (:meth:`expect`), and the
``hello`` into a check that the engine is the one the sidecar was configured for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from sidecar import signals as S
from sidecar.adapters.vllm.wire import Capture, decode_capture, unpack
from sidecar.metrics import Metrics
from sidecar.signals import DropReason

log = logging.getLogger(__name__)


class ProbeReceiver:
    """Binds ``endpoint`` and dispatches probe messages (see the module docstring)."""

    def __init__(self, endpoint: str, metrics: Metrics,
                 on_lookups: Callable[[list[tuple[int, int]]], None],
                 on_capture: Callable[[Capture], None],
                 on_hello: Callable[[dict[str, Any]], None] | None = None,
                 context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.on_lookups = on_lookups
        self.on_capture = on_capture
        self.on_hello = on_hello
        self.hello: dict[str, Any] | None = None
        self.messages = 0
        self.bad_messages = 0
        self.last_message_at = time.monotonic()
        self._ctx = context or zmq.Context.instance()
        self._dropped: dict[str, int] = {}
        self._waiting: dict[str, Future[Capture]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> ProbeReceiver:
        self._thread = threading.Thread(target=self._run, name="kvsidecar-vllm-probe",
                                        daemon=True)
        self._thread.start()
        self._bound.wait(5.0)
        if self._error is not None:
            raise RuntimeError(f"cannot bind the probe socket {self.endpoint}: {self._error}")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def expect(self, salt: str) -> Future[Capture]:
        """A future for the reference capture the probe will send for ``salt``."""
        fut: Future[Capture] = Future()
        with self._lock:
            self._waiting[salt] = fut
        return fut

    def forget(self, salt: str) -> None:
        with self._lock:
            self._waiting.pop(salt, None)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            sock.close(0)
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self.handle(sock.recv())
        finally:
            sock.close(0)

    def handle(self, data: bytes) -> None:
        """Dispatch one message; a bad one is counted and logged, never raised."""
        self.last_message_at = time.monotonic()
        try:
            msg = unpack(data)
            self._account_drops(msg)
            kind = msg["kind"]
            if kind == "lookups":
                self.on_lookups([(int(q), int(h)) for q, h in msg.get("items", [])])
            elif kind == "capture":
                self._capture(decode_capture(msg))
            elif kind == "hello":
                self.hello = msg
                if self.on_hello is not None:
                    self.on_hello(msg)
            else:
                raise ValueError(f"unknown message kind {kind!r}")
            self.messages += 1
        except Exception as exc:
            self.bad_messages += 1
            self.metrics.inc(S.HOOK_ERRORS, hook="vllm_probe_message")
            log.warning("bad kv-sidecar probe message skipped: %s: %s",
                        type(exc).__name__, exc)

    def _capture(self, cap: Capture) -> None:
        if cap.role == "reference":
            with self._lock:
                fut = self._waiting.pop(cap.salt or "", None)
            if fut is not None and not fut.done():
                fut.set_result(cap)
            return
        self.on_capture(cap)

    def _account_drops(self, msg: dict[str, Any]) -> None:
        src, dropped = str(msg.get("src", "")), int(msg.get("dropped", 0))
        before = self._dropped.get(src, 0)
        if dropped > before:
            self.metrics.inc(S.SAMPLES_DROPPED, dropped - before,
                             reason=DropReason.QUEUE_FULL.value)
        self._dropped[src] = max(before, dropped)
