"""The background scrub's recompute budget: tokens per minute, spent and measured.

Apart from :mod:`sidecar.checks.scrub` so the accounting that the "within budget" figure rests on
can be read (and tested on a fake clock) on its own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RecomputeBudget:
    """Tokens per minute as a bucket refilled continuously, holding at most one tick's
    worth, and starting empty (a start is not a free burst). A block costing more than the
    bucket holds may run when the bucket is full and leaves it in debt, so over any run of
    ``T`` seconds the scrub spends at most ``rate * T`` plus one block: the measured rate
    converges to the budget from below, never drifts above it."""

    def __init__(self, tokens_per_minute: float, capacity: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = tokens_per_minute / 60.0
        self.capacity = max(capacity, 1.0)
        self._clock = clock
        self._spent: deque[tuple[float, int]] = deque()  # (time, tokens) over the last minute
        self.restart()

    def restart(self) -> None:
        """Empty, with the measurement starting now (the scrub's start)."""
        self._tokens = 0.0
        self._at = self.started = self._clock()
        self._spent.clear()
        self.spent_total = 0

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return now

    def allows(self, cost: int) -> bool:
        self._refill()
        return self._tokens >= min(cost, self.capacity)

    def spend(self, cost: int) -> None:
        now = self._refill()
        self._tokens -= cost
        self.spent_total += cost
        self._spent.append((now, cost))

    def last_minute(self) -> int:
        """Tokens spent over the last 60 s (the exported measured rate)."""
        cutoff = self._clock() - 60.0
        while self._spent and self._spent[0][0] < cutoff:
            self._spent.popleft()
        return sum(c for _, c in self._spent)

    def measured_per_minute(self) -> float:
        """Tokens spent per minute since the budget was made (for benchmarks)."""
        elapsed = self._clock() - self.started
        return self.spent_total * 60.0 / elapsed if elapsed > 0 else 0.0
