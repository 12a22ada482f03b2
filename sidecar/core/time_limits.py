"""Time limits on adapter calls: a hung engine call must never hang the sidecar.

Python cannot kill a thread, so each guarded call runs on a daemon thread of its own and the
caller waits at most ``timeout_s``. A call that overstays is abandoned (it finishes or not
on its own); while ``max_stuck`` abandoned calls *of the same operation* are still running,
further calls of that operation are refused at once instead of piling up threads behind a
wedged engine. Each operation has its own budget: a hung ``allocator()`` must not get
``read()`` refused.

Whatever the adapter raises comes back to the caller as an ``Exception``: a ``SystemExit``
or ``KeyboardInterrupt`` raised inside an adapter call is wrapped in :class:`AdapterExit`,
so it can never unwind (and kill) the verifier or poller thread that made the call.
"""

from __future__ import annotations

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


class Guard:
    """Runs adapter calls under a time limit; see the module docstring."""

    def __init__(self, timeout_s: float, max_stuck: int = 4) -> None:
        self.timeout_s = timeout_s
        self.max_stuck = max_stuck
        self._stuck: dict[str, int] = {}
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
        box: dict[str, object] = {}
        done = threading.Event()
        state = {"abandoned": False}

        def run() -> None:
            try:
                box["result"] = fn(*args)
            except Exception as exc:  # handed to the caller, never lost
                box["error"] = exc
            except BaseException as exc:  # SystemExit & co: must not unwind the caller
                err = AdapterExit(f"{op} raised {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                box["error"] = err
            finally:
                # Under the lock, so the caller's timeout decision and this exit agree.
                with self._lock:
                    if state["abandoned"]:
                        self._stuck[op] -= 1
                    done.set()

        t = threading.Thread(target=run, name=f"kvsidecar-{op}", daemon=True)
        t.start()
        if not done.wait(self.timeout_s):
            with self._lock:
                if not done.is_set():
                    state["abandoned"] = True
                    self._stuck[op] = self._stuck.get(op, 0) + 1
                    raise AdapterTimeout(f"{op} ran past {self.timeout_s:g}s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]
