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


def _named_stat(path: Path) -> tuple[str, list[str]] | None:
    """A ``/proc/<pid>[/task/<tid>]/stat``'s command name and the fields after it (state
    ppid pgrp ... utime stime at 11 and 12), from one read; None once the process is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    head, sep, rest = text.rpartition(")")
    return (head[head.find("(") + 1:], rest.split()) if sep else None


def _stat(path: Path) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (see :func:`_named_stat`)."""
    named = _named_stat(path)
    return named[1] if named else None


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


def group_threads_cpu_s(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of the live processes in process group
    ``pgid``, summed by ``process name/thread name`` (threads of one name pooled: a ZMQ
    I/O thread, a scheduler's main thread): where in a server the CPU went, which the
    process totals of :func:`group_cpu_s` do not say."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        named = _named_stat(stat)
        if not named or int(named[1][2]) != pgid:
            continue
        for task in (stat.parent / "task").glob("[0-9]*/stat"):
            thread = _named_stat(task)
            if thread:
                name, tf = f"{named[0]}/{thread[0]}", thread[1]
                out[name] = out.get(name, 0.0) + (int(tf[11]) + int(tf[12])) / tick
    return out
