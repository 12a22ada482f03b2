"""Admission control: caps on the sidecar's own expensive work running at once.

The recompute budget (:class:`TokenBucket`) bounds recomputed tokens per
second on average; it does not bound how many recomputes run *at the same time*. Those can
pile up: several threads verifying inline, or recomputes the time limit abandoned
(:mod:`sidecar.core.time_limits`) that still run on the engine's device. Likewise a burst of hits
served from an offload tier right after a mass reload would have the sidecar re-read many
recovered blocks through the tier's load path at once. So each kind of work takes a slot;
with every slot taken, the sample is dropped at once (``samples_dropped_total{reason=
"admission"}``), never queued behind the work it would add to.

A slot is released when the work really ends: a recompute abandoned by the time limit
keeps its slot until the adapter call returns on its own.
"""

from __future__ import annotations

import threading
import time


class Slot:
    """One admitted unit of work; :meth:`release` is idempotent."""

    __slots__ = ("_done", "_gate")

    def __init__(self, gate: Gate) -> None:
        self._gate = gate
        self._done = False

    def release(self) -> None:
        with self._gate._lock:
            if not self._done:
                self._done = True
                self._gate._in_flight -= 1


class Gate:
    """At most ``cap`` slots held at once (``cap <= 0``: unlimited, still counted)."""

    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.cap = cap
        self._in_flight = 0
        self.refused = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def enter(self) -> Slot | None:
        """A slot, or ``None`` when ``cap`` slots are held (counted in ``refused``)."""
        with self._lock:
            if 0 < self.cap <= self._in_flight:
                self.refused += 1
                return None
            self._in_flight += 1
        return Slot(self)


class TokenBucket:
    """The recompute budget: at most ``rate`` recomputed tokens per second on average."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.capacity = burst if burst is not None else max(rate, 1.0)
        self._tokens = self.capacity
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: float) -> bool:
        if self.rate <= 0:
            return True  # unlimited
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if n > self.capacity:  # one oversized sample may run when the bucket is full
                n = self.capacity
            if self._tokens >= n:
                self._tokens -= n
                return True
            return False
