"""The recompute budget: how many tokens the sidecar may recompute, per unit of time.

One mechanism for both places that recompute: the hit path's verifier
(``SidecarConfig.recompute_tokens_per_s``) and the background scrub
(``SidecarConfig.scrub_tokens_per_minute``), each with its own instance and rate. Apart from
the checks so the accounting that "within budget" rests on can be read (and tested on a fake
clock) on its own.

The budget is a bucket refilled continuously at ``tokens_per_s``, holding at most
``capacity``. A cost larger than the bucket holds may run when the bucket is full and leaves
it in debt, so over any ``T`` seconds at most ``rate * T`` plus one bucket and one unit of
work are spent: the measured rate converges to the budget from below, never drifts above it.
A rate ``<= 0`` is unlimited (every cost allowed, still counted).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class RecomputeBudget:
    """Recomputed tokens per second as a token bucket (see the module docstring).

    ``full``: whether the bucket starts full (the hit path: the first samples after a start
    run at once) or empty (the scrub: a start is not a free burst). ``capacity`` defaults to
    one second's worth. :meth:`take` checks and spends in one step under a lock (several
    threads verify); :meth:`allows` and :meth:`spend` apart let a caller spend only once it
    knows the work runs (the scrub asks before it fetches a block, spends once it has it)."""

    def __init__(self, tokens_per_s: float, capacity: float | None = None, *,
                 full: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = tokens_per_s
        self.capacity = max(capacity if capacity is not None else tokens_per_s, 1.0)
        self._full = full
        self._clock = clock
        self._lock = threading.Lock()
        self._spent: deque[tuple[float, int]] = deque()  # (time, tokens) over the last minute
        self.restart()

    @classmethod
    def per_minute(cls, tokens_per_minute: float, capacity: float | None = None, *,
                   full: bool = False,
                   clock: Callable[[], float] = time.monotonic) -> RecomputeBudget:
        """A budget configured in tokens per minute (the scrub's unit)."""
        return cls(tokens_per_minute / 60.0, capacity, full=full, clock=clock)

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0

    def restart(self) -> None:
        """Full or empty as configured, with the measurement starting now."""
        with self._lock:
            self._tokens = self.capacity if self._full else 0.0
            self._at = self.started = self._clock()
            self._spent.clear()
            self.spent_total = 0

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return now

    def _allows(self, cost: int) -> bool:
        self._refill()
        return self.unlimited or self._tokens >= min(cost, self.capacity)

    def _spend(self, cost: int) -> None:
        now = self._refill()
        if not self.unlimited:
            self._tokens -= cost
        self.spent_total += cost
        spent = self._spent
        spent.append((now, cost))
        while spent[0][0] < now - 60.0:  # only the last minute is kept: bounded
            spent.popleft()

    def allows(self, cost: int) -> bool:
        """Whether ``cost`` tokens may be recomputed now (nothing spent)."""
        with self._lock:
            return self._allows(cost)

    def spend(self, cost: int) -> None:
        """Count ``cost`` tokens recomputed (the bucket may go into debt)."""
        with self._lock:
            self._spend(cost)

    def take(self, cost: int) -> bool:
        """Spend ``cost`` if the budget allows it now; whether it did."""
        with self._lock:
            if not self._allows(cost):
                return False
            self._spend(cost)
            return True

    def last_minute(self) -> int:
        """Tokens spent over the last 60 s (the exported measured rate)."""
        with self._lock:
            spent, cutoff = self._spent, self._clock() - 60.0
            while spent and spent[0][0] < cutoff:
                spent.popleft()
            return sum(c for _, c in spent)

    def measured_per_minute(self) -> float:
        """Tokens spent per minute since the budget was (re)started (for benchmarks)."""
        elapsed = self._clock() - self.started
        return self.spent_total * 60.0 / elapsed if elapsed > 0 else 0.0
