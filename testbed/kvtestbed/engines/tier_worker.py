"""The offload tier's copy worker: one thread running copies in submission order, bounded.

Copies between the pool and the tier run off the engine thread, as a real engine's DMA
stream or offload connector does; the engine decides when it must wait for one. One thread
keeps copies in submission order (a load submitted after an entry's copy-out runs after
it), and a bounded queue applies backpressure: a submit with ``depth`` copies already
queued blocks until the worker takes one (counted), so a burst of loads cannot grow memory
without bound. The thread starts on the first submit and exits after ``idle_exit_s``
without work, so an engine that is dropped leaves no thread behind for long.
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol


class CopyJob(Protocol):
    """One copy: ``run`` does it and records its own outcome; it must not raise."""

    def run(self) -> None: ...


class CopyWorker:
    """A bounded FIFO of :class:`CopyJob` run by one daemon thread (see the module
    docstring)."""

    def __init__(self, depth: int = 4, idle_exit_s: float = 2.0) -> None:
        if depth < 1:
            raise ValueError(f"copy queue depth must be >= 1, got {depth}")
        self.depth = depth
        self.idle_exit_s = idle_exit_s
        self._queue: queue.Queue[CopyJob] = queue.Queue(maxsize=depth)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.submitted = 0
        self.backpressure_waits = 0  # submits that found the queue full and waited
        self.job_errors = 0  # jobs that raised despite their contract (counted, not fatal)

    def submit(self, job: CopyJob) -> None:
        """Queue ``job``; blocks while ``depth`` jobs are already queued. The put happens
        under the lock the idle thread exits under, so a job never lands on a queue whose
        thread has just decided to stop (the worker takes jobs without that lock)."""
        with self._lock:
            self.submitted += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kv-tier-copy",
                                                daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self.backpressure_waits += 1
                self._queue.put(job)

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:
                    # A submit may have queued a job after the timeout: keep serving it.
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                job.run()
            except Exception:
                self.job_errors += 1

    @property
    def alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()
