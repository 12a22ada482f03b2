"""ZMQ subscriber for vLLM's KV event stream: sequence tracking, replay, and the auditor.

vLLM's publisher numbers its batches 0, 1, 2, ... A gap in the numbers means batches were
dropped (PUB high-water mark, a slow or late subscriber); when the engine was started with a
``replay_endpoint`` the subscriber asks its ROUTER socket for the missing batches (request:
the first wanted sequence number, 8 bytes big-endian; replies: ``(topic, seq, payload)``
frames, then an end marker with seq -1) and applies them in order. What replay cannot
recover is counted as lost. On the first message the subscriber also replays from 0 when it
can, so a sidecar started after the engine still sees every block the engine has cached.

Endpoints: vLLM *binds* ``ipc://`` (and ``tcp://*:port``) endpoints and *connects* to other
tcp ones, so the sidecar connects to an ipc endpoint and binds a ``tcp://127.0.0.1:port``
one (``bind=True``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import zmq

from sidecar import signals as S
from sidecar.adapters.vllm.audit import EventAuditor
from sidecar.adapters.vllm.endpoints import bound_file, check_endpoint, remove_bound_file
from sidecar.adapters.vllm.events import EventBatch, EventDecodeError, decode_message

log = logging.getLogger(__name__)

_END = (2**64 - 1).to_bytes(8, "big")  # vLLM's END_SEQ, (-1) as 8 signed bytes


class EventSubscriber:
    """Consumes one publisher (one data-parallel rank) on a daemon thread."""

    def __init__(self, auditor: EventAuditor, endpoint: str,
                 replay_endpoint: str | None = None, topic: str = "", bind: bool = False,
                 replay_timeout_s: float = 2.0, context: zmq.Context | None = None) -> None:
        if bind:  # a bound ingest socket: loopback or an owner-only ipc path (receiver.py)
            check_endpoint(endpoint, what="KV event socket")
        self.auditor = auditor
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.expected: int | None = None  # next sequence number we expect
        self.batches = 0
        self._errors_logged = 0
        self._ready = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EventSubscriber:
        self._thread = threading.Thread(target=self._run, name="kvsidecar-vllm-events",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(5.0)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        socket_file = None
        try:
            if self.bind:
                old = os.umask(0o177)  # an ipc socket file is created 0600
                try:
                    sub.bind(self.endpoint)
                finally:
                    os.umask(old)
                socket_file = bound_file(self.endpoint)
            else:
                sub.connect(self.endpoint)
            self._ready.set()
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                self.handle_safely(sub.recv_multipart())
        except Exception:  # socket errors only: handle_safely() never raises
            log.exception("KV event subscriber stopped unexpectedly")
        finally:
            self._ready.set()
            sub.close(0)
            remove_bound_file(self.endpoint, socket_file)

    @property
    def alive(self) -> bool:
        """The consuming thread is running (``/healthz`` reports it)."""
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ one message
    def handle_safely(self, frames: Sequence[bytes]) -> None:
        """:meth:`handle`, but no peer input can end the loop: whatever escapes the decoder
        or the auditor is counted as a ``handle`` decode error and logged (rate-limited)."""
        try:
            self.handle(frames)
        except Exception as exc:
            self._decode_failed(EventDecodeError("handle", f"{type(exc).__name__}"))

    def handle(self, frames: Sequence[bytes]) -> None:
        """Decode, track sequence numbers (replaying gaps), and apply one message."""
        try:
            batch = decode_message(frames)
        except EventDecodeError as exc:
            self._decode_failed(exc)
            return
        if self.expected is None:
            if batch.seq > 0 and self.replay_endpoint:
                self._replay(0, batch.seq)  # catch up on what was cached before we came
        elif batch.seq < self.expected:
            log.warning("KV event sequence went back from %d to %d: engine restarted; "
                        "index reset", self.expected, batch.seq)
            self.auditor.reset()
            if batch.seq > 0 and self.replay_endpoint:
                self._replay(0, batch.seq)
        elif batch.seq > self.expected:
            missing = batch.seq - self.expected
            self.auditor.metrics.inc(S.KV_EVENT_GAPS)
            recovered = self._replay(self.expected, batch.seq) if self.replay_endpoint else 0
            lost = missing - recovered
            if lost > 0:
                self.auditor.metrics.inc(S.KV_EVENT_BATCHES_LOST, lost)
                log.warning("KV event gap: %d batches before seq %d lost (%d replayed)",
                            lost, batch.seq, recovered)
        self._apply(batch)

    def _apply(self, batch: EventBatch) -> None:
        self.auditor.apply(batch)
        self.expected = batch.seq + 1
        self.batches += 1

    def _decode_failed(self, exc: EventDecodeError) -> None:
        self.auditor.decode_error(exc.reason)
        self._errors_logged += 1
        # The first few, then one in 1000: a hostile stream must not flood the log.
        if self._errors_logged <= 5 or self._errors_logged % 1000 == 0:
            log.warning("malformed KV event message skipped (counted, #%d): %s",
                        self._errors_logged, exc)

    # ------------------------------------------------------------------ replay
    def _replay(self, start: int, stop: int) -> int:
        """Apply replayed batches ``start <= seq < stop`` in order; returns how many."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while time.monotonic() < deadline:
                if not sock.poll(int(1000 * max(0.0, deadline - time.monotonic()))):
                    log.warning("KV event replay from %d timed out", start)
                    break
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) >= 2 and frames[1] == _END:
                    break
                try:
                    batch = decode_message(frames)
                except EventDecodeError as exc:
                    self._decode_failed(exc)
                    continue
                if start <= batch.seq < stop and (self.expected is None
                                                   or batch.seq >= self.expected):
                    self._apply(batch)
                    applied += 1
        except zmq.ZMQError as exc:
            log.warning("KV event replay from %s failed: %s", self.replay_endpoint, exc)
        finally:
            sock.close(0)
        if applied:
            self.auditor.metrics.inc(S.KV_EVENT_BATCHES_REPLAYED, applied)
        return applied
