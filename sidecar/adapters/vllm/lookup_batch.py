"""The probe's scheduler half holds its lookups back and sends them in batches.

vLLM's scheduler calls the probe on every step, and a step that admits requests used to send
their lookups at once: a ZMQ send on the engine's busy loop per step. Profiled in a real
SGLang server (the same pipe), such a send took ~38 us of CPU but ~300 us of wall time on a
busy host (it wakes ZMQ's I/O thread, which can take the sending thread's core). Here a
step's lookups wait, and leave with the first step at least :data:`SEND_EVERY_S` after the
last send (a step of any kind: a long request's decode steps carry them), when a batch reaches
:data:`~sidecar.adapters.vllm.wire.MAX_LOOKUPS` (the receiver's cap per message), or when
the last scheduled request finishes: an engine going quiet keeps nothing back, so the
sidecar's hit counts match vLLM's once traffic stops. Sampled hits are not lookups here
(the worker half's capture counts them), so holding lookups back reorders nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.wire import MAX_LOOKUPS

SEND_EVERY_S = 0.25
MAX_LIVE = 10_000  # scheduled requests not yet finished (bounded: oldest forgotten first)


class LookupBatch:
    """Lookups of scheduled requests, sent in batches (module docstring)."""

    def __init__(self, pipe: Pipe, every_s: float = SEND_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pipe = pipe
        self.every_s = every_s
        self._clock = clock
        self._items: list[list[int]] = []
        self._live: dict[str, None] = {}  # request ids scheduled and not finished
        self._due = 0.0  # the first lookups go at once
        self.sent = 0  # messages sent

    def scheduled(self, req_ids: Iterable[str], lookups: list[list[int]]) -> None:
        """A step's newly scheduled requests, and the lookups among them."""
        live = self._live
        for rid in req_ids:
            if len(live) >= MAX_LIVE:
                live.pop(next(iter(live)))
            live[rid] = None
        if lookups:
            self._items.extend(lookups)
        if self._items and (len(self._items) >= MAX_LOOKUPS or self._clock() >= self._due):
            self.send()  # checked every step: a long request's decode steps carry them out

    def finished(self, req_id: str) -> None:
        """A request finished (or was aborted); the last one out sends what waits."""
        live = self._live
        if req_id in live:
            del live[req_id]
            if not live:
                self.send()

    def send(self) -> None:
        """Send what waits now (the pipe accounts a send it could not make)."""
        self._due = self._clock() + self.every_s
        if self._items:
            items, self._items = self._items, []
            self.pipe.send_message("lookups", items=items)
            self.sent += 1

    @property
    def waiting(self) -> int:
        return len(self._items)
