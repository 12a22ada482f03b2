"""Rate limit: the canary's own load as a configured fraction of the server's.

The server's request rate is read from its ``/metrics`` (vLLM's
``vllm:request_success_total``), minus the canary's own requests, between two reads. The
canary then allows ``fraction x server rate`` requests per second, between ``min_rate``
(so an idle server is still checked now and then) and ``max_rate`` (the fixed limit used
where the server exports no request counter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.canary.hit_audit import counter_sum

REQUEST_COUNTERS = ("vllm:request_success_total", "sglang:num_requests_total")


@dataclass
class RateLimit:
    fraction: float = 0.01
    min_rate: float = 0.05  # requests/s the canary may always send
    max_rate: float = 2.0  # requests/s it never exceeds (and uses without server metrics)
    clock: Callable[[], float] = time.monotonic
    _last: tuple[float, float] | None = field(default=None, init=False)  # (t, counter)
    _own_since_last: int = field(default=0, init=False)
    server_rate: float | None = field(default=None, init=False)

    def observe_server(self, metrics_text: str | None) -> None:
        """Feed one read of the server's ``/metrics`` (None: the server has none)."""
        total = counter_sum(metrics_text, REQUEST_COUNTERS) if metrics_text else None
        now = self.clock()
        if total is None:
            self.server_rate, self._last = None, None
            return
        if self._last is not None and now > self._last[0] and total >= self._last[1]:
            others = max(0.0, total - self._last[1] - self._own_since_last)
            self.server_rate = others / (now - self._last[0])
        self._last, self._own_since_last = (now, total), 0

    def sent(self, requests: int) -> None:
        self._own_since_last += requests

    @property
    def allowed_rate(self) -> float:
        """Requests per second the canary may send now."""
        if self.server_rate is None:
            return self.max_rate
        return min(self.max_rate, max(self.min_rate, self.fraction * self.server_rate))

    def pause_for(self, requests: int) -> float:
        """Seconds to wait after sending ``requests`` to stay within the allowed rate."""
        return requests / self.allowed_rate
