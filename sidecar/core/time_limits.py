"""Time limits on adapter calls: a hung engine call must never hang the sidecar.

Python cannot kill a thread, so each guarded call runs on a daemon thread other than the
caller's, and the caller waits at most ``timeout_s``. A call that overstays is abandoned (it
finishes or not on its own); while ``max_stuck`` abandoned calls *of the same operation* are
still running, further calls of that operation are refused at once instead of piling up
threads behind a wedged engine. Each operation has its own budget: a hung ``allocator()``
must not get ``read()`` refused.

The threads are kept and reused per operation (a :class:`_Runner` parks on its inbox once its
call returns): a thread started per call was ~0.04% of an attached engine's samples in py-spy
(allocator polls, every verification's reads), and a stuck runner simply is not idle, so the
next call gets another. At most ``max_stuck`` stuck plus one per concurrent caller exist.

Whatever the adapter raises comes back to the caller as an ``Exception``: a ``SystemExit``
or ``KeyboardInterrupt`` raised inside an adapter call is wrapped in :class:`AdapterExit`,
so it can never unwind (and kill) the verifier or poller thread that made the call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class AdapterTimeout(TimeoutError):
    """The adapter call ran past its time limit."""


class AdapterRefused(RuntimeError):
    """Too many earlier calls are still stuck; this one was not started."""


class AdapterExit(RuntimeError):
    """The adapter raised a BaseException that is not an Exception (SystemExit,
    KeyboardInterrupt, GeneratorExit): an adapter bug, handled like any other error."""


class _Call:
    """One guarded call: its function, and what came back."""

    __slots__ = ("abandoned", "args", "done", "error", "fn", "result")

    def __init__(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        self.fn, self.args = fn, args
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.abandoned = False


class _Runner:
    """A daemon thread that runs one operation's calls, one at a time, and parks itself in
    its guard's idle list after each (see the module docstring)."""

    def __init__(self, guard: Guard, op: str) -> None:
        self.guard, self.op = guard, op
        self.inbox: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"kvsidecar-{op}", daemon=True).start()

    def _loop(self) -> None:
        guard, op = self.guard, self.op
        while True:
            call = self.inbox.get()
            try:
                call.result = call.fn(*call.args)
            except Exception as exc:  # handed to the caller, never lost
                call.error = exc
            except BaseException as exc:  # SystemExit & co: must not unwind the caller
                err = AdapterExit(f"{op} raised {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                call.error = err
            finally:
                call.fn = call.args = None  # type: ignore[assignment]  # nothing kept alive
                # Under the lock, so the caller's timeout decision and this exit agree.
                with guard._lock:
                    if call.abandoned:
                        guard._stuck[op] -= 1
                    call.done.set()
                    guard._idle.setdefault(op, []).append(self)


class Guard:
    """Runs adapter calls under a time limit; see the module docstring."""

    def __init__(self, timeout_s: float, max_stuck: int = 4) -> None:
        self.timeout_s = timeout_s
        self.max_stuck = max_stuck
        self._stuck: dict[str, int] = {}
        self._idle: dict[str, list[_Runner]] = {}
        self._lock = threading.Lock()

    @property
    def stuck(self) -> int:
        """Abandoned calls still running, all operations together."""
        with self._lock:
            return sum(self._stuck.values())

    def stuck_in(self, op: str) -> int:
        with self._lock:
            return self._stuck.get(op, 0)

    def call(self, op: str, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            stuck = self._stuck.get(op, 0)
            if stuck >= self.max_stuck:
                raise AdapterRefused(f"{op}: {stuck} earlier {op} calls still stuck")
            idle = self._idle.get(op)
            runner = idle.pop() if idle else None
        call = _Call(fn, args)
        (runner or _Runner(self, op)).inbox.put(call)
        if not call.done.wait(self.timeout_s):
            with self._lock:
                if not call.done.is_set():
                    call.abandoned = True
                    self._stuck[op] = self._stuck.get(op, 0) + 1
                    raise AdapterTimeout(f"{op} ran past {self.timeout_s:g}s")
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]
