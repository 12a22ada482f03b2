"""Allocator polling: the engine's allocator state and invariants, on a schedule and on events.

The Monitor starts it itself (no separate ``Jobs`` to remember). One runner, APScheduler
(the project's scheduler), runs both kinds of poll, each :meth:`AllocatorPoller.poll`,
serialised:

* **scheduled**: an interval job every ``every_s``, the floor;
* **nudged**: the schedule polls every second or so, and a bug that frees a block on
  request N and lets it be reused on request N+1 needs a check in between. So the hooks that
  mark a moment where allocator bugs strike (a sequence releasing its blocks, a request
  finishing, an anomaly) call :meth:`AllocatorPoller.nudge`, which adds a one-shot job due
  ``min_interval_s`` after the last nudged poll began (so a busy engine costs at most one
  check per interval). While that job is due, a nudge is one attribute read; nudges that
  arrive while it runs ask for one more poll, never a backlog.

The poller has its own time-limit guard: a hung ``allocator()`` or ``block_tables()`` can
only wedge polling, never the verifier's reads and recomputes (and the reverse).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sidecar import signals as S
from sidecar.allocator import AllocatorHealth
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
        if min_interval_s == min_interval_s and min_interval_s >= 0:  # NaN: no nudged polls
            self.min_interval_s: float | None = min_interval_s
        else:
            self.min_interval_s = None
        self._scheduler: Any = None
        # True while a nudged poll is due (or nudges do nothing: not started, or none asked
        # for): the hot path's one read. Cleared by the nudged poll as it begins.
        self._nudge_due = True
        self._last_nudged = -float("inf")  # monotonic start of the last nudged poll
        self.nudged_polls = 0
        self.polls = 0
        self.last_poll: float | None = None

    def nudge(self) -> None:
        """Ask for a poll soon (hot path: one attribute read while a poll is already due;
        else one one-shot job added; never raises into the engine's hook)."""
        if self._nudge_due:
            return
        self._nudge_due = True
        wait = self._last_nudged + (self.min_interval_s or 0.0) - time.monotonic()
        run_date = datetime.now(UTC) + timedelta(seconds=wait) if wait > 0 else None
        try:
            # A job of its own each time (no fixed id): the scheduler removes a one-shot job
            # by id once it ran, so a fixed, replaced id had it remove the *next* nudge's job
            # (lost: nudges "due" for good) or raise JobLookupError in its thread. At most
            # one is queued anyway ("due" collapses nudges). misfire_grace_time=None: a late
            # scheduler still runs it, or nudges would stay "due" for good.
            self._scheduler.add_job(self._nudged, "date", run_date=run_date,
                                    misfire_grace_time=None)
        except Exception:  # the scheduler stopped under us: nothing to nudge
            log.debug("allocator poll nudge not scheduled", exc_info=True)

    def _nudged(self) -> None:
        """The nudged poll: the interval counts from its start; a nudge from now on asks
        for the next one. "Due" is cleared only once the poll lock is held: a nudge while
        this one waits behind another poll collapses into it (its poll starts after that
        nudge), so at most one more is ever queued and none is refused by the scheduler's
        instance limit (a refused one would leave nudges "due" for good)."""
        with self._lock:
            self._last_nudged = time.monotonic()
            self._nudge_due = False
            try:
                self._poll_locked()
                self.nudged_polls += 1
            except Exception:
                log.exception("event-driven allocator poll failed (next nudge retries)")

    def poll(self) -> AllocatorState | None:
        """Ask the adapter for allocator state and, where it offers them, its block tables
        (each call time-limited); publish the state, check the allocator's invariants and
        the leak trend (:mod:`sidecar.allocator`). Polls are serialised."""
        with self._lock:
            return self._poll_locked()

    def _poll_locked(self) -> AllocatorState | None:
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
        nudged = self.min_interval_s is not None and self._introspection is not None
        if self._scheduler is not None or not (self.every_s > 0 or nudged):
            return
        # coalesce + max_instances=1: a slow adapter never stacks up overlapping polls.
        self._scheduler = _scheduler()
        if self.every_s > 0:
            self._scheduler.add_job(self._scheduled, "interval", seconds=self.every_s,
                                    id="allocator")
            self.poll()  # publish real values before the first scrape
        self._scheduler.start()
        self._nudge_due = not nudged

    @property
    def alive(self) -> bool:
        """Whether scheduled polling runs (True where none was asked for)."""
        return self.every_s <= 0 or (self._scheduler is not None and self._scheduler.running)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop both kinds of poll; a poll under way gets up to ``timeout_s`` to finish (each
        of its adapter calls is time limited)."""
        self._nudge_due = True  # nudges do nothing from here on
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        self._scheduler = None
        if self._lock.acquire(timeout=max(timeout_s, 0.0)):
            self._lock.release()


def _scheduler() -> Any:
    """APScheduler's background scheduler, minus one shutdown race: a one-shot (nudge) job
    that runs while :meth:`AllocatorPoller.stop` shuts the scheduler down is removed by the
    scheduler's thread after the job stores were emptied, and APScheduler 3 raises
    ``JobLookupError`` in that thread (seen beside two CPU hogs). Stopping, the job is gone
    with its store: nothing to report."""
    from apscheduler.jobstores.base import JobLookupError
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.schedulers.base import STATE_RUNNING

    class Scheduler(BackgroundScheduler):
        def remove_job(self, job_id: str, jobstore: str | None = None) -> None:
            try:
                super().remove_job(job_id, jobstore)
            except JobLookupError:
                if self.state == STATE_RUNNING:
                    raise

    return Scheduler(daemon=True, job_defaults={"coalesce": True, "max_instances": 1})
