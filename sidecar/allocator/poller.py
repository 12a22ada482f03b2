"""Allocator polling: the engine's allocator state and invariants, on a schedule and on events.

The Monitor starts it itself (no separate ``Jobs`` to remember): an APScheduler interval job
every ``every_s`` is the floor, and the hooks that mark a moment where allocator bugs strike
(a release, a finished request, an anomaly) nudge an event-driven poll
(:class:`sidecar.allocator.PollTrigger`). Both call :meth:`AllocatorPoller.poll`, serialised.

The poller has its own time-limit guard: a hung ``allocator()`` or ``block_tables()`` can
only wedge polling, never the verifier's reads and recomputes (and the reverse).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sidecar import signals as S
from sidecar.allocator import AllocatorHealth, PollTrigger
from sidecar.core import hook_input as HI
from sidecar.core.capabilities import AllocatorIntrospection
from sidecar.core.protocol import Adapter, AllocatorState, BlockTableSnapshot
from sidecar.core.time_limits import Guard
from sidecar.export.metrics import Metrics

log = logging.getLogger(__name__)


class AllocatorPoller:
    def __init__(self, adapter: Adapter, metrics: Metrics, health: AllocatorHealth,
                 requests_done: Callable[[], int], timeout_s: float, every_s: float,
                 min_interval_s: float,
                 introspection: AllocatorIntrospection | None = None) -> None:
        self.adapter = adapter
        self.metrics = metrics
        self.health = health
        self.guard = Guard(timeout_s)
        self.every_s = every_s
        self._requests_done = requests_done
        # The adapter's block-level state, as resolved at attach (sidecar.core.attach).
        self._introspection = introspection
        self._lock = threading.Lock()
        self.trigger: PollTrigger | None = None
        if min_interval_s >= 0:
            self.trigger = PollTrigger(self.poll, min_interval_s)
        self._scheduler: Any = None
        self.polls = 0
        self.last_poll: float | None = None

    def nudge(self) -> None:
        """Ask for a poll soon (hot path: one Event.set(), only when not already set)."""
        if self.trigger is not None:
            self.trigger.nudge()

    def poll(self) -> AllocatorState | None:
        """Ask the adapter for allocator state and, where it offers them, its block tables
        (each call time-limited); publish the state, check the allocator's invariants and
        the leak trend (:mod:`sidecar.allocator`). Polls are serialised."""
        with self._lock:
            state = self._call("allocator", self.adapter.allocator)
            # Garbage would be kept and then fail every scrape: refused and counted here.
            if HI.reject_adapter_output(self.metrics, "allocator",
                                        HI.check_allocator_state(state)):
                state = None
            if state is not None:
                self.metrics.allocator.update(state)
            tables: Sequence[BlockTableSnapshot] | None = None
            started = time.perf_counter()
            if self._introspection is not None:
                tables = self._call("block_tables", self._introspection.block_tables)
            try:
                # requests_done read after the snapshot: the index is never earlier than
                # the state it describes.
                self.health.observe(state, tables, self._requests_done(),
                                    time.perf_counter() - started, retake=self._retake)
            except Exception:
                log.exception("allocator health check failed (poll skipped)")
            self.polls += 1
            self.last_poll = time.time()
            return state

    def _retake(self) -> Sequence[BlockTableSnapshot] | None:
        """A second snapshot, to confirm what the first one showed broken."""
        if self._introspection is None:
            return None
        return self._call("block_tables", self._introspection.block_tables)

    def _scheduled(self) -> None:
        """The schedule's poll: skipped while another poll runs (that one is as fresh), so
        a slow adapter never queues polls behind the lock."""
        if self._lock.locked():
            return
        self.poll()

    def _call(self, op: str, fn: Any) -> Any:
        try:
            return self.guard.call(op, fn)
        except Exception as exc:
            reason = "timeout" if isinstance(exc, TimeoutError) else "error"
            self.metrics.inc(S.ADAPTER_ERRORS, op=op, reason=reason)
            log.warning("adapter %s() failed: %s", op, exc)
            return None

    def start(self) -> None:
        if self.trigger is not None and self._introspection is not None:
            self.trigger.start()
        if self.every_s > 0 and self._scheduler is None:
            from apscheduler.schedulers.background import BackgroundScheduler

            # coalesce + max_instances=1: a slow adapter never stacks up overlapping polls.
            self._scheduler = BackgroundScheduler(
                daemon=True, job_defaults={"coalesce": True, "max_instances": 1})
            self._scheduler.add_job(self._scheduled, "interval", seconds=self.every_s,
                                    id="allocator")
            self.poll()  # publish real values before the first scrape
            self._scheduler.start()

    @property
    def alive(self) -> bool:
        """Whether scheduled polling runs (True where none was asked for)."""
        return self.every_s <= 0 or (self._scheduler is not None and self._scheduler.running)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.trigger is not None:
            self.trigger.stop(timeout_s)
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        self._scheduler = None
