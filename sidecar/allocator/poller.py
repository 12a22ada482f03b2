"""Allocator polling: the engine's allocator state and invariants, on a schedule and on events.

The Monitor starts it itself (no separate ``Jobs`` to remember). Two kinds of poll, each
:meth:`AllocatorPoller.poll`, serialised by one lock:

* **scheduled**: an APScheduler (the project's scheduler) interval job every ``every_s``,
  the floor;
* **nudged**: the schedule polls every second or so, and a bug that frees a block on
  request N and lets it be reused on request N+1 needs a check in between. So the hooks that
  mark a moment where allocator bugs strike (a sequence releasing its blocks, a request
  finishing, an anomaly) call :meth:`AllocatorPoller.nudge`, which wakes the poller's own
  nudge thread; it polls ``min_interval_s`` after the last nudged poll began (so a busy
  engine costs at most one check per interval). While a nudged poll is due, a nudge is one
  attribute read; nudges that arrive while it runs ask for one more poll, never a backlog.
  Not an APScheduler one-shot job: adding one on the engine's thread at each nudge cost the
  reference engine ~2.5% of its requests/s (``bench perf``, interleaved pairs: 0.958 of
  detached with those jobs, 0.98 with none); setting an event costs microseconds.

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
from sidecar.allocator import AllocatorHealth
from sidecar.core import hook_input as HI
from sidecar.core.capabilities import AllocatorIntrospection
from sidecar.core.protocol import Adapter, AllocatorState, BlockTableSnapshot
from sidecar.core.time_limits import AdapterRefused, Guard
from sidecar.export.metrics import Metrics

log = logging.getLogger(__name__)


BLIND_AFTER = 3  # consecutive failed polls of one call before /healthz calls it degraded


def _check_tables(tables: Any) -> HI.InputReject | None:
    """block_tables() output the checks can read: a sequence of snapshots (their contents
    are judged by the checks themselves, sidecar.allocator.invariants)."""
    if not isinstance(tables, Sequence) or isinstance(tables, (str, bytes)) or not all(
            isinstance(t, BlockTableSnapshot) for t in tables):
        return HI.InputReject.TYPE
    return None


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
        self._nudger: threading.Thread | None = None
        self._wake = threading.Event()  # a nudge: the nudge thread has work
        self._stopping = threading.Event()  # this start's stop (a new one per start)
        # True while a nudged poll is due (or nudges do nothing: not started, or none asked
        # for): the hot path's one read. Cleared by the nudged poll as it begins.
        self._nudge_due = True
        self._last_nudged = -float("inf")  # monotonic start of the last nudged poll
        self.nudged_polls = 0
        self.polls = 0
        # Per operation: consecutive failed calls, and the reason of the last (what
        # /healthz says while the allocator checks are blind: see ``degraded``).
        self._failing: dict[str, tuple[int, str]] = {}
        self.last_poll: float | None = None

    def nudge(self) -> None:
        """Ask for a poll soon (hot path: one attribute read while a poll is already due;
        else one event set; never raises into the engine's hook)."""
        if self._nudge_due:
            return
        self._nudge_due = True
        self._wake.set()

    def _nudge_loop(self, wake: threading.Event, stopping: threading.Event) -> None:
        """The nudge thread: per wake-up, one nudged poll, ``min_interval_s`` after the
        last one began. The event is cleared before the poll clears "due", so a nudge that
        comes once "due" is cleared always finds it set again: none is lost."""
        while True:
            wake.wait()
            wake.clear()
            if stopping.is_set():
                return
            wait = self._last_nudged + (self.min_interval_s or 0.0) - time.monotonic()
            if wait > 0 and stopping.wait(wait):
                return
            self._nudged()

    def _nudged(self) -> None:
        """The nudged poll: the interval counts from its start; a nudge from now on asks
        for the next one. "Due" is cleared only once the poll lock is held: a nudge while
        this one waits behind another poll collapses into it (its poll starts after that
        nudge), so at most one more is ever queued."""
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
        # Garbage would be kept and then fail every scrape: refused and counted in _call.
        state = self._call("allocator", self.adapter.allocator, HI.check_allocator_state)
        if state is not None:
            self.metrics.allocator.update(state)
        tables: Sequence[BlockTableSnapshot] | None = None
        started = time.perf_counter()
        if self._introspection is not None:
            tables = self._call("block_tables", self._introspection.block_tables,
                                _check_tables)
        try:
            # requests_done read after the snapshot: the index is never earlier than
            # the state it describes.
            self.health.observe(state, tables, self._requests_done(),
                                time.perf_counter() - started, retake=self._retake)
            self._failing.pop("check", None)
        except Exception:
            log.exception("allocator health check failed (poll skipped)")
            self._failed("check", S.AdapterErrorReason.ERROR)
        self.polls += 1
        self.last_poll = time.time()
        return state

    def _retake(self) -> Sequence[BlockTableSnapshot] | None:
        """A second snapshot, to confirm what the first one showed broken."""
        if self._introspection is None:
            return None
        return self._call("block_tables", self._introspection.block_tables, _check_tables)

    def _scheduled(self) -> None:
        """The schedule's poll: skipped while another poll runs (that one is as fresh), so
        a slow adapter never queues polls behind the lock."""
        if self._lock.locked():
            return
        self.poll()

    def _call(self, op: str, fn: Any,
              check: Callable[[Any], HI.InputReject | None]) -> Any:
        """``fn()`` under the guard; what it returns, or ``None`` when it raised, ran past its
        limit, was refused, or returned what ``check`` refuses (garbage). Each failure is
        counted (``adapter_errors_total{op, reason}``) and one more in a row for
        :attr:`degraded`; an answer ends the row."""
        try:
            result = self.guard.call(op, fn)
        except Exception as exc:
            why = S.AdapterErrorReason
            reason = (why.TIMEOUT if isinstance(exc, TimeoutError) else
                      why.REFUSED if isinstance(exc, AdapterRefused) else why.ERROR)
            self.metrics.inc(S.ADAPTER_ERRORS, op=op, reason=reason.value)
            log.warning("adapter %s() failed: %s", op, exc)
            self._failed(op, reason)
            return None
        if result is None:
            return None
        if HI.reject_adapter_output(self.metrics, op, check(result)):
            self._failed(op, S.AdapterErrorReason.GARBAGE)
            return None
        self._failing.pop(op, None)  # answered
        return result

    def _failed(self, op: str, reason: S.AdapterErrorReason) -> None:
        """One more failed poll of ``op`` in a row (``check``: the checks themselves)."""
        self._failing[op] = (self._failing.get(op, (0, ""))[0] + 1, reason.value)

    def start(self) -> None:
        nudged = self.min_interval_s is not None and self._introspection is not None
        if self._scheduler is not None or self._nudger is not None:
            return
        if self.every_s > 0:
            # coalesce + max_instances=1: a slow adapter never stacks up overlapping polls.
            from apscheduler.schedulers.background import BackgroundScheduler

            self._scheduler = BackgroundScheduler(
                daemon=True, job_defaults={"coalesce": True, "max_instances": 1})
            self._scheduler.add_job(self._scheduled, "interval", seconds=self.every_s,
                                    id="allocator")
            self.poll()  # publish real values before the first scrape
            self._scheduler.start()
        if nudged:
            # This start's own events: a thread of an earlier start sees only its own.
            self._wake, self._stopping = threading.Event(), threading.Event()
            self._nudger = threading.Thread(target=self._nudge_loop,
                                            args=(self._wake, self._stopping),
                                            name="kvsidecar-poll-nudge", daemon=True)
            self._nudger.start()
        self._nudge_due = not nudged

    @property
    def degraded(self) -> list[str]:
        """Why the allocator checks are blind, if they are: ``allocator_calls_stuck`` while
        the guard refuses allocator()/block_tables() behind stuck calls, or the last
        :data:`BLIND_AFTER` polls' calls all ran past their limit;
        ``allocator_calls_failing`` when they all raised or returned garbage;
        ``allocator_checks_failing`` when the checks themselves failed on what came back.
        Empty once a call answers (a check runs)."""
        out: set[str] = set()
        stuck = {S.AdapterErrorReason.TIMEOUT.value, S.AdapterErrorReason.REFUSED.value}
        for op, (fails, reason) in list(self._failing.items()):
            if self.guard.refusing(op):
                out.add("allocator_calls_stuck")
            elif fails >= BLIND_AFTER:
                out.add("allocator_checks_failing" if op == "check" else
                        "allocator_calls_stuck" if reason in stuck else
                        "allocator_calls_failing")
        return sorted(out)

    @property
    def alive(self) -> bool:
        """Whether the polls asked for run (True where none was asked for)."""
        scheduled = self.every_s <= 0 or (self._scheduler is not None
                                          and self._scheduler.running)
        return scheduled and (self._nudger is None or self._nudger.is_alive())

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop both kinds of poll; a poll under way gets up to ``timeout_s`` to finish (each
        of its adapter calls is time limited)."""
        self._nudge_due = True  # nudges do nothing from here on
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        self._scheduler = None
        if self._nudger is not None:
            self._stopping.set()
            self._wake.set()
            self._nudger = None  # daemon: it returns once a poll under way ends
        if self._lock.acquire(timeout=max(timeout_s, 0.0)):
            self._lock.release()
        self.guard.close()
