"""The recompute budget: a token bucket of recomputed tokens per second.

The verifier takes a sample's prefix length from it before a recompute; over the budget the
sample is dropped (``budget``), never queued, so checks cannot take more than the rate.
"""

from __future__ import annotations

import threading
import time


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
