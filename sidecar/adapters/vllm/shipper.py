"""The probe's worker half: what runs on the engine's step, and what runs beside it.

vLLM calls ``wait_for_save`` on the worker's thread after every forward, so whatever the
probe does there delays the next step. A sampled hit's blocks must be copied then (the
engine may overwrite them from the next step on), but nothing else must: the copy goes into
a preallocated slot on the device where the KV lives (:class:`sidecar.core.capture_buffer.
CaptureBuffer`, asynchronous on a side stream on CUDA: no host wait, never a device-wide
sync), decoding the backend's layout in the same pass, and everything after it (the copy to
host memory, packing, the send) runs on the :class:`Shipper`'s thread.

Bounded both ways: the queue holds :data:`DEPTH` jobs and each cache group's buffer a fixed
number of block slots; a capture that finds either full is not taken, and is accounted
as the pipe accounts a capture it could not send (a dropped sample whose lookup still
counts, :mod:`.pipe`). The thread owns the pipe's socket after the first message (ZMQ
sockets are not thread-safe); the pipe's counters are shared under its lock.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.adapters.vllm.pipe import Pipe
from sidecar.core.capture_buffer import CaptureBuffer, wait_copied

log = logging.getLogger(__name__)

DEPTH = 8  # messages waiting for the shipper thread


def default_slots(blocks_per_sample: int) -> int:
    """Block slots per cache group: one sample's blocks for each capture the queue holds
    and the one being shipped, so the queue, not the slots, bounds what waits (2 blocks a
    sample: 18 slots, 36 MiB of device memory for an 8B-class bf16 model's 2 MiB blocks)."""
    return (DEPTH + 1) * max(1, blocks_per_sample)


@dataclass
class CaptureOrder:
    """What the scheduler half asks the worker half to copy out after this step."""

    capture_id: str
    role: str  # "hit" or "reference"
    salt: str | None
    tokens: list[int]
    query_tokens: int  # the lookup's prompt length (a sampled hit is also a lookup)
    hit_tokens: int
    blocks: dict[int, list[int]]  # group -> block ids of the hit (or the reference prefix)
    refs: list[tuple[int, int, int]]  # (group, index, block id)


Staged = tuple[int, int, int, torch.Tensor, torch.Tensor]  # (group, index, block id, K, V)


class Shipper:
    """A bounded queue of messages and the one thread that sends them (module docstring)."""

    def __init__(self, pipe: Pipe, slots: int = default_slots(2), depth: int = DEPTH) -> None:
        if slots < 1 or depth < 1:
            raise ValueError(f"kv-sidecar probe: capture_slots ({slots}) and the queue depth "
                             f"({depth}) must be >= 1")
        self.pipe = pipe
        self.slots = slots
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=depth)
        self._buffers: dict[int, CaptureBuffer] = {}
        self._thread: threading.Thread | None = None
        self.shipped = 0  # captures sent
        self.refused = 0  # captures not taken: queue or slots full

    # ------------------------------------------------------------------ engine's thread
    def stage(self, group: int, views: Sequence[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copy one block (per-layer K/V views) into a slot of ``group``'s buffer; None
        when the buffer has no free slot."""
        k0 = views[0][0]
        shape = (len(views), *k0.shape)
        buf = self._buffers.get(group)
        if buf is None or buf.block_shape != shape:
            buf = self._buffers[group] = CaptureBuffer(shape, k0.dtype, k0.device, self.slots)
        got = buf.capture([([k for k, _ in views], [v for _, v in views])])
        return got[0] if got else None

    def post_capture(self, build: Callable[[list[Staged]], dict[str, Any]],
                     kv: list[Staged], lookup: dict[str, Any]) -> bool:
        """Queue a capture; ``build`` turns the staged blocks (host copies) into the
        message's fields on the shipper's thread. False (accounted) when not taken.
        ``lookup``: the capture's ``role``, ``query_tokens`` and ``hit_tokens``."""
        if self._offer(("capture", (build, kv))):
            return True
        self.refuse_capture(lookup)
        return False

    def refuse_capture(self, lookup: dict[str, Any]) -> None:
        """A capture not taken (no free slot, queue full): accounted like one the pipe
        could not send (a dropped sample; a hit's lookup carried)."""
        self.refused += 1
        self.pipe.account_unsent("capture", **lookup)

    def post(self, kind: str, **fields: Any) -> bool:
        """Queue any other message (hello, fingerprint counts)."""
        if self._offer(("message", (kind, fields))):
            return True
        self.pipe.account_unsent(kind, **fields)
        return False

    def _offer(self, item: tuple[str, Any]) -> bool:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvsidecar-probe-ship",
                                            daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    # ------------------------------------------------------------------ shipper's thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._ship(*item)
            except Exception:
                log.exception("kv-sidecar probe: shipping a %s failed (ignored)", item[0])
            item = None  # not held while waiting: a capture's slots are free once shipped

    def _ship(self, what: str, payload: Any) -> None:
        if what == "message":
            kind, fields = payload
            self.pipe.send_message(kind, **fields)
            return
        build, kv = payload
        host = []
        for g, index, block_id, k, v in kv:
            wait_copied(k)
            wait_copied(v)
            host.append((g, index, block_id, k.cpu(), v.cpu()))
        fields = build(host)
        if self.pipe.send_message("capture", **fields):
            self.shipped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (bounded wait), then stop the thread and close the pipe."""
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)
        self.pipe.close()
