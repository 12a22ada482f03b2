"""A warning that repeats on a schedule (a scrape of an engine that is down, every poll) is
logged at most once per interval, saying how many were held back: the counter that goes
with it (e.g. ``kvsidecar_engine_scrape_errors_total``) still counts every one. At the
shortest poll period (0.05 s) an unreachable engine otherwise wrote 20 lines a second."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

INTERVAL_S = 60.0


class LimitedWarning:
    """``warn(msg, *args)``: logs the first at once, then at most one per ``interval_s``,
    the held-back count appended to the next one logged."""

    def __init__(self, log: logging.Logger, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self._next = float("-inf")
        self._held = 0
        self._lock = threading.Lock()

    def warn(self, msg: str, *args: object) -> None:
        with self._lock:
            now = self.clock()
            if now < self._next:
                self._held += 1
                return
            held, self._held, self._next = self._held, 0, now + self.interval_s
        if held:
            msg += f" ({held} more like it in the last {self.interval_s:g} s not logged)"
        self.log.warning(msg, *args)
