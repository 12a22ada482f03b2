"""The probe's side of the pipe to the sidecar: a ZMQ PUSH socket that never blocks.

The engine must never wait for the sidecar: messages are sent with ``NOBLOCK`` onto a socket
whose send high-water mark bounds memory; when it is full (sidecar slow or absent) the
message is dropped. Until the sidecar connects, up to ``hwm`` messages wait for it, so a
sidecar started after the engine still gets the probe's hello.

What a drop loses is accounted by what it carried, because the sidecar reports each apart:

* a **capture** is a sampled hit: counted in ``dropped`` (samples not verified), and its
  lookup is kept for the next ``lookups`` message: the hit still counts in the hit rate;
* **lookups** are never dropped while the pipe recovers: a failed send keeps them (up to
  :data:`~sidecar.adapters.vllm.wire.MAX_LOOKUPS`, a bounded carry) and they ride with the
  next message; only what the carry cannot hold is lost, counted in ``lost_lookups``;
* any **other** message (fingerprint counts, SGLang's frees and stores) counts in
  ``lost_messages``; an ``events`` message (SGLang's tap: stores, frees and lookups in the
  order they happened, one message per flush) keeps its lookups like a ``lookups`` one and
  counts one lost message for the rest.

The three counts are cumulative and ride on every message, so the sidecar learns of a loss
from the next message that gets through (:class:`~sidecar.adapters.vllm.receiver.
ProbeReceiver` clamps what a peer may claim). They are kept under a lock: the probe's
shipper thread sends while the engine's thread may account a capture it could not take.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import zmq

from sidecar.adapters.vllm.wire import MAX_LOOKUPS, pack

log = logging.getLogger(__name__)


class Pipe:
    def __init__(self, endpoint: str, hwm: int = 64,
                 carry_limit: int = MAX_LOOKUPS, src: str | None = None) -> None:
        self.endpoint = endpoint
        self.dropped = 0  # captures (sampled hits) that could not be sent
        self.lost_lookups = 0  # lookups the carry could not hold
        self.lost_messages = 0  # other messages that could not be sent
        self.src = src or uuid.uuid4().hex[:12]  # a front's is a secret (sidecar.adapters.remote)
        self._carry: list[list[int]] = []  # lookups waiting for the pipe to drain
        self._carry_limit = carry_limit
        self._lock = threading.Lock()
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    @property
    def loss_counts(self) -> tuple[int, int, int]:
        """What every message tells the receiver of this pipe's losses: captures dropped,
        lookups lost, other messages lost."""
        return self.dropped, self.lost_lookups, self.lost_messages

    @property
    def carried(self) -> int:
        """Lookups held for the next message (the pipe was full when they were sent)."""
        return len(self._carry)

    def send_message(self, kind: str, **fields: Any) -> bool:
        """Pack and send one message; False when it had to be dropped (accounted by kind:
        see the module docstring)."""
        with self._lock:
            if kind == "lookups":
                return self._send_lookups(list(fields.get("items", ())))
            if self._carry:
                self._send_lookups([])  # what waits goes first: the order the engine saw
            if self._send(kind, fields):
                return True
            self._account(kind, fields)
            return False

    def try_send(self, kind: str, **fields: Any) -> bool:
        """Send lookups this pipe carries, then one message, if the socket takes them; a
        message that cannot go is neither carried nor counted: for one that only repeats
        what every later message carries anyway (the loss counts, a tap's stats), retried
        while a quiet engine's sidecar is away."""
        with self._lock:
            if self._carry and not self._send_lookups([]):
                return False
            return self._send(kind, fields)

    def account_unsent(self, kind: str, **fields: Any) -> None:
        """A message that was never offered to the socket (the shipper was full): counted
        as if its send had failed, a capture's lookup carried."""
        with self._lock:
            if kind == "lookups":
                self._hold(list(fields.get("items", ())))
            else:
                self._account(kind, fields)

    def _account(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "capture":
            self.dropped += 1
            q, h = fields.get("query_tokens"), fields.get("hit_tokens")
            # A sampled hit was also a lookup; a reference capture (the sidecar's own
            # recompute, role "reference") never was.
            if fields.get("role", "hit") == "hit" and isinstance(q, int) and isinstance(h, int):
                self._hold([[q, h]])
        elif kind == "events":  # an ordered batch (SGLang's tap): its lookups are kept
            runs = fields.get("runs", ())
            self._hold([item for k, f in runs if k == "lookups" for item in f["items"]])
            if any(k != "lookups" for k, _ in runs):
                self.lost_messages += 1
        else:
            self.lost_messages += 1

    def send(self, data: bytes) -> bool:
        """Send bytes already packed (tests); a failure counts as a lost message."""
        with self._lock:
            if self._raw_send(data):
                return True
            self.lost_messages += 1
            return False

    def _send_lookups(self, items: list[list[int]]) -> bool:
        batch = self._carry + items if self._carry else items
        self._carry = []
        for at in range(0, max(len(batch), 1), MAX_LOOKUPS):  # the receiver's per-message cap
            chunk = batch[at:at + MAX_LOOKUPS]
            if chunk and not self._send("lookups", {"items": chunk}):
                self._hold(batch[at:])
                return False
        return True

    def _hold(self, items: list[list[int]]) -> None:
        room = self._carry_limit - len(self._carry)
        self._carry.extend(items[:max(room, 0)])
        self.lost_lookups += max(len(items) - max(room, 0), 0)

    def _send(self, kind: str, fields: dict[str, Any]) -> bool:
        return self._raw_send(pack(kind, self.src, self.dropped,
                                   lost_lookups=self.lost_lookups,
                                   lost_messages=self.lost_messages, **fields))

    def _raw_send(self, data: bytes) -> bool:
        try:
            self._sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            log.warning("kv-sidecar probe: send to %s failed: %s", self.endpoint, exc)
            return False

    def close(self) -> None:
        self._sock.close(0)
