"""Where a real engine's extra CPU goes, per thread (issue 24: SGLang's processes used ~420
us more CPU per request with the tap than the tap's hooks measured on its thread). The bench
reads every thread of the engine's process group from /proc, by process and thread name;
the table shows the threads whose CPU per request grew most."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtestbed.bench.perf_pair_rows import THREAD_ROWS, thread_rows
from kvtestbed.bench.proc_cost import group_cpu_s, group_threads_cpu_s

# A process that names one thread and keeps it busy (prctl PR_SET_NAME through /proc).
_BUSY = """
import threading, time
spun = threading.Event()
def spin():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write("kvs-spin")
    while time.thread_time() < 0.4:  # CPU time, whatever else the machine runs
        pass
    spun.set()
    time.sleep(60)
threading.Thread(target=spin, daemon=True).start()
spun.wait()
print("done", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_threads_of_a_process_group_are_counted_by_name() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"done"
        time.sleep(0.05)
        threads = group_threads_cpu_s(proc.pid)
        spin = [v for k, v in threads.items() if k.endswith("/kvs-spin")]
        assert len(spin) == 1 and spin[0] >= 0.3  # the busy thread, by its name
        others = sum(v for k, v in threads.items() if not k.endswith("/kvs-spin"))
        assert others < spin[0]  # the main thread slept
        assert sum(threads.values()) == pytest.approx(group_cpu_s(proc.pid), abs=0.05)
    finally:
        proc.kill()
        proc.wait()


def test_thread_rows_show_the_threads_that_grew_most() -> None:
    def run(requests: int, **cpu: float) -> dict[str, object]:
        return {"requests": requests, "threads_cpu_s": cpu}

    rounds = [{"runs": {"off": run(100, main=1.0, io=0.1, idle=0.0, gc=0.2),
                        "tap": run(100, main=1.05, io=0.1, idle=0.0, gc=0.4)}},
              {"runs": {"off": run(100, main=1.0, io=0.1, idle=0.0, gc=0.2),
                        "tap": run(100, main=1.03, io=0.12, idle=0.0, gc=0.5)}}]
    rows = thread_rows(rounds, "tap", "T", "E")
    assert len(rows) == THREAD_ROWS
    assert ["'gc'" in rows[0].figure, "'main'" in rows[1].figure] == [True, True]
    assert rows[0].sidecar == pytest.approx(4500.0) and rows[0].baseline == pytest.approx(2000.0)
    assert rows[0].spread == "+2500 us/request"
    assert all("'idle'" not in r.figure for r in rows)
    del rounds[1]["runs"]["off"]["threads_cpu_s"]  # recorded before threads were
    assert thread_rows(rounds, "tap", "T", "E") == []


def test_thread_rows_are_never_empty_when_every_busy_thread_shrank() -> None:
    """A short run with the tap on can use less CPU than off on every busy thread (10 ms
    ticks): idle threads at 0 ranked first and the table had no row (the fresh-clone run's
    quick SGLang bench failed on it)."""
    rounds = [{"runs": {"off": {"requests": 40, "threads_cpu_s": {
        "sched": 0.5, "io": 0.02, "idle1": 0.0, "idle2": 0.0, "idle3": 0.0}},
                        "tap": {"requests": 40, "threads_cpu_s": {
        "sched": 0.48, "io": 0.01, "idle1": 0.0, "idle2": 0.0, "idle3": 0.0}}}}]
    rows = thread_rows(rounds, "tap", "T", "E")
    assert [r.figure.split("'")[1] for r in rows] == ["io", "sched"]


def test_a_thread_only_the_configuration_runs_has_no_ratio_and_json_stays_json() -> None:
    """A thread absent from off (the probe's own, a ZMQ I/O thread) had a ``nan`` ratio in
    the table and a bare ``NaN`` in ``--json``, which strict JSON readers refuse (outside
    check, stop 48)."""
    import json
    from dataclasses import asdict

    from kvtestbed.bench.perf_row import format_table

    rounds = [{"runs": {"off": {"requests": 100, "threads_cpu_s": {"main": 1.0}},
                        "on": {"requests": 100, "threads_cpu_s": {"main": 1.0,
                                                                  "zmq": 0.03}}}}]
    [new] = [r for r in thread_rows(rounds, "on", "T", "E") if "'zmq'" in r.figure]
    assert new.ratio is None and new.baseline == 0 and new.spread == "+300 us/request"
    assert "| 300 us | 0 us | - |" in format_table([new])
    assert json.loads(json.dumps(asdict(new), allow_nan=False))["ratio"] is None
