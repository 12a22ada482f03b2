"""The probe's side of the pipe to the sidecar: a ZMQ PUSH socket that never blocks.

The engine must never wait for the sidecar: messages are sent with ``NOBLOCK`` onto a socket
whose send high-water mark bounds memory; when it is full (sidecar slow or absent) the
message is dropped and counted, and the count rides on every later message so the sidecar
can account for what it missed. Until the sidecar connects, up to ``hwm`` messages wait for
it, so a sidecar started after the engine still gets the probe's hello.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import zmq

from sidecar.adapters.vllm.wire import pack

log = logging.getLogger(__name__)


class Pipe:
    def __init__(self, endpoint: str, hwm: int = 64) -> None:
        self.endpoint = endpoint
        self.dropped = 0
        self.src = uuid.uuid4().hex[:12]
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    def send_message(self, kind: str, **fields: Any) -> bool:
        """Pack and send one message; False (and counted) when it had to be dropped."""
        return self.send(pack(kind, self.src, self.dropped, **fields))

    def send(self, data: bytes) -> bool:
        try:
            self._sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.dropped += 1
            return False
        except zmq.ZMQError as exc:
            self.dropped += 1
            log.warning("kv-sidecar probe: send to %s failed: %s", self.endpoint, exc)
            return False

    def close(self) -> None:
        self._sock.close(0)
