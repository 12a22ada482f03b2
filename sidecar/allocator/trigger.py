"""Event-driven allocator polls: the engine's hooks nudge, a thread of ours polls.

The schedule (APScheduler, :mod:`sidecar.allocator.poller`) polls every second or so; a bug that
frees a
block on request N and lets it be reused on request N+1 needs a check in between. So the
hooks that mark a moment where allocator bugs strike (a sequence releasing its blocks, a
request finishing, an anomaly) call :meth:`PollTrigger.nudge`: one ``Event.set()``, O(1) on
the engine's thread. This thread wakes, waits out ``min_interval_s`` since its last poll (so a
busy engine costs at most one check per interval), and polls. Nudges that arrive while a poll
runs collapse into one more poll, never a backlog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class PollTrigger:
    def __init__(self, poll: Callable[[], object], min_interval_s: float = 0.25,
                 name: str = "kvsidecar-allocator-poll") -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.poll = poll
        self.min_interval_s = min_interval_s
        self.name = name
        self.polls = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = 0.0

    def nudge(self) -> None:
        """Ask for a poll soon (hot path: never blocks, never raises). ``is_set`` is a plain
        read; ``set`` takes the Event's lock, so it is skipped while a poll is already due."""
        if not self._wake.is_set():
            self._wake.set()

    def start(self) -> PollTrigger:
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping.is_set():
                return
            wait = self._last + self.min_interval_s - time.monotonic()
            if wait > 0 and self._stopping.wait(wait):
                return
            self._wake.clear()
            self._last = time.monotonic()
            try:
                self.poll()
                self.polls += 1
            except Exception:
                log.exception("event-driven allocator poll failed (next nudge retries)")
