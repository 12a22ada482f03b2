"""Time limits on adapter calls: a hung engine call must never hang the sidecar.

Python cannot kill a thread, so each guarded call runs on a daemon thread of its own and the
caller waits at most ``timeout_s``. A call that overstays is abandoned (it finishes or not
on its own); while ``max_stuck`` abandoned calls are still running, further calls are
refused at once instead of piling up threads behind a wedged engine.
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


class Guard:
    """Runs adapter calls under a time limit; see the module docstring."""

    def __init__(self, timeout_s: float, max_stuck: int = 4) -> None:
        self.timeout_s = timeout_s
        self.max_stuck = max_stuck
        self._stuck = 0
        self._lock = threading.Lock()

    @property
    def stuck(self) -> int:
        with self._lock:
            return self._stuck

    def call(self, op: str, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            if self._stuck >= self.max_stuck:
                raise AdapterRefused(f"{op}: {self._stuck} earlier adapter calls still stuck")
        box: dict[str, object] = {}
        done = threading.Event()
        state = {"abandoned": False}

        def run() -> None:
            try:
                box["result"] = fn(*args)
            except BaseException as exc:  # handed to the caller, never lost
                box["error"] = exc
            finally:
                # Under the lock, so the caller's timeout decision and this exit agree.
                with self._lock:
                    if state["abandoned"]:
                        self._stuck -= 1
                    done.set()

        t = threading.Thread(target=run, name=f"kvsidecar-{op}", daemon=True)
        t.start()
        if not done.wait(self.timeout_s):
            with self._lock:
                if not done.is_set():
                    state["abandoned"] = True
                    self._stuck += 1
                    raise AdapterTimeout(f"{op} ran past {self.timeout_s:g}s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]
