"""Time limits on adapter calls: a hung engine call must never hang the sidecar.

Python cannot kill a thread, so each guarded call runs on a daemon worker thread and the
caller waits at most ``timeout_s``. Workers are reused while they finish in time (an idle one
ends after ``IDLE_S``): a thread started and ended per call cost each allocator poll two
thread lifecycles, half its time. A call that overstays is abandoned (it finishes or not
on its own, its worker not reused until then); while ``max_stuck`` abandoned calls *of the
same operation* are still running, further calls of that operation are refused at once
instead of piling up threads behind a wedged engine. Each operation has its own budget: a
hung ``allocator()`` must not get ``read()`` refused.

Whatever the adapter raises comes back to the caller as an ``Exception``: a ``SystemExit``
or ``KeyboardInterrupt`` raised inside an adapter call is wrapped in :class:`AdapterExit`,
so it can never unwind (and kill) the verifier or poller thread that made the call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

IDLE_S = 10.0  # an idle worker ends after this long without a call
MAX_IDLE = 4  # idle workers kept per Guard (more end as they finish)


class AdapterTimeout(TimeoutError):
    """The adapter call ran past its time limit."""


class AdapterRefused(RuntimeError):
    """Too many earlier calls are still stuck; this one was not started."""


class AdapterExit(RuntimeError):
    """The adapter raised a BaseException that is not an Exception (SystemExit,
    KeyboardInterrupt, GeneratorExit): an adapter bug, handled like any other error."""


def adapter_error(op: str, exc: BaseException) -> Exception:
    """What an adapter raised, as an ordinary error: an ``Exception`` as it is; a
    ``SystemExit``, ``KeyboardInterrupt`` or ``GeneratorExit`` wrapped in
    :class:`AdapterExit`, its cause kept, so it never unwinds the thread that called."""
    if isinstance(exc, Exception):
        return exc
    err = AdapterExit(f"{op} raised {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class Guard:
    """Runs adapter calls under a time limit; see the module docstring."""

    def __init__(self, timeout_s: float, max_stuck: int = 4) -> None:
        self.timeout_s = timeout_s
        self.max_stuck = max_stuck
        self._stuck: dict[str, int] = {}
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closes = 0  # close() calls so far: a worker busy at one ends after its call

    @property
    def stuck(self) -> int:
        """Abandoned calls still running, all operations together."""
        with self._lock:
            return sum(self._stuck.values())

    def stuck_in(self, op: str) -> int:
        with self._lock:
            return self._stuck.get(op, 0)

    def refusing(self, op: str) -> bool:
        """Whether calls of ``op`` are refused now (``max_stuck`` earlier ones still stuck):
        whatever needs that call is blind until one returns."""
        return self.stuck_in(op) >= self.max_stuck

    def close(self, timeout_s: float = 1.0) -> None:
        """End the idle workers now, so a stopped owner leaves no thread of its own behind;
        a worker busy with a call (running, or stuck past its limit) ends as that call
        returns. A later call starts a new worker."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._closes += 1
        for worker in idle:
            worker.inbox.put(_stop)
        deadline = time.monotonic() + timeout_s
        for worker in idle:
            worker.thread.join(max(0.0, deadline - time.monotonic()))

    def call(self, op: str, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            stuck = self._stuck.get(op, 0)
            if stuck >= self.max_stuck:
                raise AdapterRefused(f"{op}: {stuck} earlier {op} calls still stuck")
            worker = self._idle.pop() if self._idle else None
            closes = self._closes
        if worker is None:
            worker = _Worker(self)
        box: dict[str, object] = {}
        done = threading.Event()
        state = {"abandoned": False}

        def run() -> bool:
            try:
                box["result"] = fn(*args)
            except BaseException as exc:  # handed to the caller, never lost or unwinding it
                box["error"] = adapter_error(op, exc)
            finally:
                # Under the lock, so the caller's timeout decision and this exit agree.
                with self._lock:
                    if state["abandoned"]:
                        self._stuck[op] -= 1
                    keep = len(self._idle) < MAX_IDLE and closes == self._closes
                    if keep:
                        self._idle.append(worker)
                    done.set()
            return keep

        worker.inbox.put(run)
        if not done.wait(self.timeout_s):
            with self._lock:
                if not done.is_set():
                    state["abandoned"] = True
                    self._stuck[op] = self._stuck.get(op, 0) + 1
                    raise AdapterTimeout(f"{op} ran past {self.timeout_s:g}s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]


def _stop() -> bool:
    """The job :meth:`Guard.close` hands an idle worker: end."""
    return False


class _Worker:
    """A daemon thread running one guarded call at a time, handed over through its inbox; it
    puts itself back in its Guard's idle list after each call, and ends when idle for
    ``IDLE_S``, when the list is full, or when the Guard closes."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.inbox: queue.SimpleQueue[Callable[[], bool]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="kvsidecar-adapter-call",
                                       daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                job = self.inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self.guard._lock:
                    if self in self.guard._idle:  # else a caller took it: its call is coming
                        self.guard._idle.remove(self)
                        return
                continue
            if not job():
                return
