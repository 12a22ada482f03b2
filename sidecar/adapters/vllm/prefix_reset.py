"""vLLM mitigation: drop the whole prefix cache when it is found wrong.

A corrupted cached block stays reachable by its hash until it is evicted, which on a server
with spare KV memory can be hours: every later request sharing that prefix decodes over it.
vLLM's ``POST /reset_prefix_cache`` (a dev endpoint: the server needs
``VLLM_SERVER_DEV_MODE=1``) removes every hash at once, but only when no request holds
blocks; it answers ``{"success": false}`` otherwise. So a reset is *requested* (from a
verdict listener, never blocking the caller) and a worker retries it with exponential
backoff until the engine is idle, at most ``attempts`` times; requests closer together than
``min_interval_s`` are rate-limited. Every outcome is counted
(``kvsidecar_prefix_cache_resets_total{result}``) and kept in :attr:`history` for the
summary, so an operator sees what it did.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar import signals as S

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResetSettings:
    min_interval_s: float = 300.0
    attempts: int = 30
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("min_interval_s", "backoff_s", "max_backoff_s", "timeout_s"):
            v = getattr(self, name)
            if not (0 <= v <= 86400):
                raise ValueError(f"{name} must be 0..86400, got {v!r}")
        if not 1 <= self.attempts <= 1000:
            raise ValueError(f"attempts must be 1..1000, got {self.attempts!r}")


class PrefixCacheReset:
    def __init__(self, engine_url: str, settings: ResetSettings | None = None,
                 metrics: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = engine_url.rstrip("/") + "/reset_prefix_cache"
        self.settings = settings or ResetSettings()
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._running = False
        self._stop = threading.Event()
        self.history: list[dict[str, Any]] = []
        if metrics is not None:
            metrics.register((S.PREFIX_CACHE_RESETS,))
            for r in ("reset", "busy", "unsupported", "error", "rate_limited"):
                metrics.inc(S.PREFIX_CACHE_RESETS, 0, result=r)

    def _note(self, result: str, **extra: Any) -> dict[str, Any]:
        entry = {"result": result, "at": time.time(), **extra}
        with self._lock:
            self.history.append(entry)
            del self.history[:-32]
        if self.metrics is not None:
            self.metrics.inc(S.PREFIX_CACHE_RESETS, result=result)
        return entry

    def request(self, reason: str = "anomaly") -> bool:
        """Ask for a reset (returns at once): False when one is running or rate-limited."""
        with self._lock:
            now = self._clock()
            limited = self._last is not None and now - self._last < self.settings.min_interval_s
            if self._running or limited:
                busy = self._running
            else:
                self._running, self._last = True, now
                busy = None
        if busy is not None:
            if not busy:
                self._note("rate_limited", reason=reason)
            return False
        threading.Thread(target=self._run, args=(reason,), daemon=True,
                         name="kvsidecar-prefix-reset").start()
        return True

    def stop(self) -> None:
        self._stop.set()

    def _run(self, reason: str) -> None:
        try:
            self.reset_now(reason)
        finally:
            with self._lock:
                self._running = False

    def reset_now(self, reason: str = "anomaly") -> dict[str, Any]:
        """Retry ``POST /reset_prefix_cache`` until it succeeds; returns what happened."""
        s = self.settings
        started = self._clock()
        delay = s.backoff_s
        for attempt in range(1, s.attempts + 1):
            outcome = self._post()
            if outcome in ("reset", "unsupported"):
                entry = self._note(outcome, reason=reason, attempts=attempt,
                                   seconds=round(self._clock() - started, 3))
                level = logging.WARNING if outcome == "reset" else logging.ERROR
                log.log(level, "reset_prefix_cache (%s): %s after %d attempt(s)%s", reason,
                        outcome, attempt, "" if outcome == "reset" else
                        ": start vLLM with VLLM_SERVER_DEV_MODE=1 to allow it")
                return entry
            if attempt < s.attempts and self._stop.wait(delay):
                break
            delay = min(delay * 2, s.max_backoff_s)
        entry = self._note(outcome, reason=reason, attempts=attempt,
                           seconds=round(self._clock() - started, 3))
        log.error("reset_prefix_cache (%s): gave up after %d attempt(s): %s", reason,
                  attempt, outcome)
        return entry

    def _post(self) -> str:
        req = urllib.request.Request(self.url, b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.settings.timeout_s) as r:
                body = json.loads(r.read(4096))
        except urllib.error.HTTPError as exc:
            return "unsupported" if exc.code in (404, 405) else "error"
        except (OSError, ValueError):
            return "error"
        if isinstance(body, dict) and body.get("success") is True:
            return "reset"
        return "busy"  # requests still hold blocks: retried
