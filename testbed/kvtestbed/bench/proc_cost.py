"""What the benches that drive a server from client threads share: the fan-out of clients
timed by wall clock, and the CPU seconds processes used, read from ``/proc`` (what a
process costs whatever else the shared machine runs; its wall-clock figures are not)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def run_clients(clients: Sequence[Callable[[], None]]) -> float:
    """Run each client on a thread of its own, all at once; the wall seconds from the
    first start to the last join."""
    threads = [threading.Thread(target=c) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _stat(path: Path) -> list[str] | None:
    """The fields of a ``/proc/<pid>/stat`` after the command name (state ppid pgrp ...
    utime stime at 11 and 12), or None once the process is gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0 when unknown or gone."""
    fields = _stat(Path(f"/proc/{pid}/stat")) if pid is not None else None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes in process group ``pgid`` (a
    server started in a session of its own leads one: vLLM's API server with its engine
    core and worker)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(stat)
        if fields and int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")
