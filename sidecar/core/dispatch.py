"""Where a sample goes once the hot path has taken it: one mechanism, three modes (a
fourth, ``process``, moves the whole Monitor to a process of its own:
:mod:`sidecar.adapters.remote`).

* ``queued`` (production): a bounded queue and one worker thread; a full queue drops the
  sample and counts it (``queue_full``), it never blocks the engine;
* ``inline``: verified on the caller's thread before ``submit`` returns (benchmarks and
  tests that must be deterministic, on-demand checks);
* ``deferred``: kept (bounded) until :meth:`Dispatcher.run_pending` is called, for engines
  whose recompute must not run while the engine is busy (an in-process vLLM whose
  engine-side reference is the engine itself).

Whatever the mode, every verdict goes through the same ``verify`` and ``report`` callables,
and nothing a verification raises escapes: it is logged and counted as a dropped sample.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from sidecar.signals import DropReason

if TYPE_CHECKING:  # annotations only: the config (and --help) reads MODES without torch
    from sidecar.checks.verifier import Sample, Verdict

log = logging.getLogger(__name__)

Mode = Literal["queued", "inline", "deferred", "process"]
# "process": the Monitor in a sidecar process of its own (sidecar.adapters.remote), which runs it
# queued; a Dispatcher itself has the other three.
MODES: tuple[Mode, ...] = ("queued", "inline", "deferred", "process")


class Dispatcher:
    """One bounded deque of waiting samples under one condition, whatever the mode: the
    worker takes from it (``queued``), :meth:`run_pending` does (``deferred``). One lock per
    submit: a ``queue.Queue`` beside a pending count took two locks and a notify, ~14k
    instructions of a sampled hit on the engine's thread."""

    def __init__(self, verify: Callable[[Sample], Verdict],
                 report: Callable[[Verdict], None], drop: Callable[[DropReason], None],
                 mode: Mode = "queued", queue_size: int = 64) -> None:
        if mode == "process":
            raise ValueError("dispatch = 'process' runs the Monitor in a sidecar process: "
                             "start it with sidecar.adapters.remote.process.SidecarProcess (the "
                             "demo's --dispatch process), not with Monitor")
        if mode not in MODES:
            raise ValueError(f"dispatch mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._verify = verify
        self._report = report
        self._drop = drop
        self._waiting: deque[Sample] = deque()
        self._limit = queue_size
        self._worker: threading.Thread | None = None
        self._generation = 0  # a worker runs while it is its generation's (stop moves it on)
        self._running = 0  # samples the worker has taken and not finished
        self._cond = threading.Condition()
        self.verified_samples = 0
        self.last_progress = time.monotonic()

    # ------------------------------------------------------------------ engine side
    def submit(self, sample: Sample) -> Verdict | None:
        """Hand a sample over (O(1) unless ``inline``); the verdict in ``inline`` mode."""
        if self.mode == "inline":
            return self.run(sample)
        with self._cond:
            full = len(self._waiting) >= self._limit
            if not full:
                self._waiting.append(sample)
                self._cond.notify_all()  # the worker, or a wait_pending caller
        if full:
            self._drop(DropReason.QUEUE_FULL)
        return None

    # ------------------------------------------------------------------ verification
    def run(self, sample: Sample) -> Verdict | None:
        """Verify and report one sample on this thread; never raises."""
        try:
            verdict = self._verify(sample)
            self._report(verdict)
        except BaseException:
            log.exception("verification failed unexpectedly (sample dropped)")
            self._drop(DropReason.ADAPTER_ERROR)
            return None
        self.verified_samples += 1
        self.last_progress = time.monotonic()
        return verdict

    def take_pending(self) -> list[Sample]:
        """Deferred mode: the samples kept so far, handed over (no longer pending)."""
        with self._cond:
            samples = list(self._waiting)
            self._waiting.clear()
        return samples

    def run_pending(self) -> list[Verdict]:
        """Deferred mode: verify every sample kept so far, on the calling thread."""
        return [v for v in (self.run(s) for s in self.take_pending()) if v is not None]

    def wait_pending(self, n: int, timeout_s: float) -> bool:
        """Deferred mode: wait until at least ``n`` samples are kept."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._waiting) >= n, timeout_s)

    @property
    def queued(self) -> int:
        """Samples waiting (not yet taken by the worker or :meth:`run_pending`)."""
        return len(self._waiting)

    @property
    def pending(self) -> int:
        """Samples waiting or being verified by the worker."""
        return len(self._waiting) + self._running

    # ------------------------------------------------------------------ worker
    def start(self) -> None:
        if self.mode == "queued" and self._worker is None:
            self._worker = threading.Thread(target=self._loop, args=(self._generation,),
                                            name="kvsidecar-verifier", daemon=True)
            self._worker.start()

    @property
    def alive(self) -> bool:
        """Whether verification can progress: the worker runs (queued) or none is needed."""
        return self.mode != "queued" or (self._worker is not None and self._worker.is_alive())

    def _loop(self, generation: int) -> None:
        """Verify what waits until :meth:`stop` moves the generation on: a worker that was
        stuck past a stop's time limit then returns when its call does, even if a new
        worker was started meanwhile (two would verify side by side)."""
        cond = self._cond
        while True:
            with cond:
                while not self._waiting and self._generation == generation:
                    cond.wait()
                if self._generation != generation:
                    return
                sample = self._waiting.popleft()
                self._running += 1
            try:
                self.run(sample)
            finally:
                with cond:
                    self._running -= 1
                    cond.notify_all()

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued sample is verified; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker; samples still waiting are dropped and counted."""
        with self._cond:
            left = len(self._waiting)
            self._waiting.clear()
            self._generation += 1
            self._cond.notify_all()
        for _ in range(left):
            self._drop(DropReason.SHUTDOWN)
        if self._worker is None:
            return
        self._worker.join(timeout_s)
        if self._worker.is_alive():  # wedged in an adapter call: leave it, it is daemon
            log.warning("verifier worker did not stop within %gs", timeout_s)
        self._worker = None
