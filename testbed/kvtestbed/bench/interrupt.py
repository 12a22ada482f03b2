"""Stopping a long benchmark on SIGTERM or Ctrl-C: the results so far, a non-zero exit, no
process left behind.

A signal raises ``KeyboardInterrupt`` in the main thread once (the stage running unwinds
through its ``finally`` blocks, closing its servers and children); later signals are only
noted, so a cleanup is not cut short. Code under test may swallow that exception (the
sidecar catches ``BaseException`` around adapter calls and verifications, by design), so a
watchdog started by the signal ends the process after ``grace_s`` whatever the main thread
does: it reports what was measured, kills every descendant process and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

GRACE_S = 20.0


class Interrupted:
    """What stopped the run: ``signum`` (``None`` while nothing did)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


@contextlib.contextmanager
def stoppable(on_deadline: Callable[[Interrupted], None],
              grace_s: float = GRACE_S) -> Iterator[Interrupted]:
    """Within the block, SIGTERM and SIGINT raise ``KeyboardInterrupt`` once and start a
    watchdog that calls ``on_deadline`` (which must end the process) ``grace_s`` later if
    the block has not finished by then."""
    state = Interrupted()
    finished = threading.Event()

    def watchdog() -> None:
        if not finished.wait(grace_s):
            on_deadline(state)

    def handler(signum: int, frame: Any) -> None:
        if state.signum is not None:
            return  # already stopping: let the cleanup finish
        state.signum, state.at = signum, time.monotonic()
        threading.Thread(target=watchdog, name="bench-stop-watchdog", daemon=True).start()
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield state  # signals are the main thread's; nothing to install
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield state
    finally:
        finished.set()
        for s, h in previous.items():
            signal.signal(s, h)


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of ``pid`` (this process by default), read from ``/proc``;
    empty where there is no ``/proc``."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants() -> int:
    """SIGKILL every descendant of this process (children first reaped where they are
    ours); how many there were."""
    pids = descendants()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.waitpid(pid, os.WNOHANG)
    return len(pids)


def note(what: str) -> None:
    print(f"bench reliability: {what}", file=sys.stderr, flush=True)
