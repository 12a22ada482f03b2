"""Background jobs on an APScheduler BackgroundScheduler: allocator polling and heartbeat.

The allocator poll (:meth:`sidecar.monitor.Monitor.poll_allocator`) publishes the allocator's
counts and, where the adapter offers block tables, runs the invariant checks and the leak trend
test (:mod:`sidecar.allocator`). This schedule is the floor; the Monitor also polls on events
(a release, a finished request, an anomaly) through its own trigger thread.

Jobs run on the scheduler's own threads, never the engine's; a job that raises is logged by
the scheduler and tried again at its next run. ``coalesce`` and ``max_instances=1`` keep a slow
adapter from stacking up overlapping polls.
"""

from __future__ import annotations

import logging

from apscheduler.schedulers.background import BackgroundScheduler

from sidecar.monitor import Monitor

log = logging.getLogger(__name__)


class Jobs:
    def __init__(self, monitor: Monitor, allocator_every_s: float = 1.0) -> None:
        self.monitor = monitor
        self.scheduler = BackgroundScheduler(daemon=True,
                                             job_defaults={"coalesce": True,
                                                           "max_instances": 1})
        self.scheduler.add_job(monitor.poll_allocator, "interval",
                               seconds=allocator_every_s, id="allocator")

    def start(self) -> Jobs:
        self.monitor.poll_allocator()  # publish real values before the first scrape
        self.scheduler.start()
        return self

    def stop(self) -> None:
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
