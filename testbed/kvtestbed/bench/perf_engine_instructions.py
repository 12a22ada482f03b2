"""The engine figure's profile in instructions: what the in-process sidecar adds to the
reference engine's own work, counted under callgrind, so it is the same on a loaded machine.

The wall-time ratio of the engine figure moves by +-3% per pair on a busy 2-core host, and
its target (>= 0.98 at N=1000) sits inside that noise; an instruction count does not move.
One child process under ``valgrind --tool=callgrind`` drives the same seeded requests through
a detached engine and through one with a Monitor attached, and callgrind dumps its counters
at each ``os.getppid()`` (``--dump-before=os_getppid``), so each phase is counted apart:

* the drive, detached (no hook arguments built, no fingerprint);
* the drive with the Monitor attached, not started (the engine thread's share: the hooks,
  the arguments the engine builds for them, the write-time fingerprint);
* applying the journal those requests left (the journal thread's share);
* one allocator poll (the poller's share, per poll).

What instructions cannot show is reported by the wall and CPU rows beside them: cache misses,
thread wake-ups and GIL hand-overs on a host whose two cores are both busy.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from kvtestbed.bench.perf_row import Row

_CHILD = "kvtestbed.bench.perf_engine_instructions"
PHASES = ("detached", "attached", "journal_apply", "poll")


def _child_main(requests: int) -> None:
    """Run under callgrind: a marker (``os.getppid``) before and after each phase."""
    import gc

    import torch

    from kvtestbed.adapters.paged_adapter import ReferenceAdapter
    from kvtestbed.bench import perf_engine as E
    from kvtestbed.workload import drive
    from sidecar.core.monitor import Monitor, SidecarConfig

    torch.set_num_threads(1)  # as bench perf
    warm = E._engine(1, kv_digest=True)
    drive(warm, E._workload(warm, 1, 8), max_requests=8)  # first-call costs are no one's
    for attached in (False, True):
        engine = E._engine(0, kv_digest=attached)
        monitor = None
        if attached:  # not started: its threads would run on callgrind's clock, not ours
            monitor = Monitor(ReferenceAdapter(engine),
                              SidecarConfig(sample_every=1000, seed=0, burst_hits=0))
            engine.sink = monitor
        workload = E._workload(engine, 0, requests)
        gc.collect()
        os.getppid()  # dump: set-up
        drive(engine, workload, max_requests=requests)
        os.getppid()  # dump: the drive
        if monitor is not None:
            monitor.journal.drain()
            os.getppid()  # dump: the journal apply
            monitor.poller.poll()  # warms the poll's first-call paths
            os.getppid()  # dump: (first poll, not counted)
            monitor.poller.poll()
            os.getppid()  # dump: one poll


def instruction_profile(requests: int = 40, timeout_s: float = 900.0) -> dict[str, Any]:
    """Instructions of each phase (module docstring) for ``requests`` requests, or why they
    are missing."""
    from kvtestbed.bench.perf_hooks import callgrind_phases

    totals = callgrind_phases(_CHILD, ["--child", str(requests)], timeout_s)
    if isinstance(totals, str):
        return {"error": totals}
    # set-up, detached drive, set-up, attached drive, journal apply, first poll, poll
    if len(totals) < 7:
        return {"error": f"expected 7 callgrind dumps, got {len(totals)}"}
    return {"requests": requests, "detached": totals[1], "attached": totals[3],
            "journal_apply": totals[4], "poll": totals[6]}


def instruction_rows(quick: bool, raw: dict[str, Any]) -> list[Row]:
    """The profile's rows: instructions per request of the engine with the sidecar in its
    process against detached, adding each share in turn; the polls priced at the default
    rate (a nudged one at most every ``allocator_check_min_interval_s`` while requests end,
    a scheduled one every ``allocator_every_s``) over the detached engine's seconds per
    request from the engine figure of the same run."""
    from sidecar.config.settings import SidecarConfig

    prof = instruction_profile(8 if quick else 40)
    raw["engine_instructions"] = prof
    if "error" in prof:
        return [Row(f"engine instructions: skipped ({prof['error'][:80]})", float("nan"),
                    float("nan"), "instr", float("nan"), "-", None)]
    n = prof["requests"]
    base = prof["detached"] / n
    thread = prof["attached"] / n
    applied = thread + prof["journal_apply"] / n
    name = "engine instructions per request, sidecar N=1000 in-process"
    rows = [Row(f"{name}: the engine's thread (hooks, their arguments, the fingerprint)",
                thread, base, "instr", thread / base, "-", None),
            Row(f"{name}: + journal apply", applied, base, "instr", applied / base, "-", None),
            Row("one allocator poll (the reference adapter's state and block tables), "
                "vs one detached request", prof["poll"], base, "instr", prof["poll"] / base,
                "-", None)]
    det = raw.get("engine", {}).get("detached")
    if det and det.get("requests"):
        cfg = SidecarConfig()
        per_s = 1 / cfg.allocator_every_s + 1 / cfg.allocator_check_min_interval_s
        polls = per_s * det["wall_s"] / det["requests"]  # per request, at the default rate
        total = applied + polls * prof["poll"]
        rows.append(Row(f"{name}: + allocator polls ({per_s:g}/s at the detached engine's "
                        "requests/s)", total, base, "instr", total / base, "-", None))
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child_main(int(sys.argv[2]))
