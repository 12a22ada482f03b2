"""`kv-sidecar bench perf --quick --json` works and reports every figure of the issue, each
row with a baseline measured in the same run and a ratio (no timing is asserted: the
numbers of a quick run on a shared machine mean nothing; the command is what is tested)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest


def test_bench_perf_quick_json_has_every_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "bench", "perf", "--quick",
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    figures = [r["figure"] for r in out["rows"]]
    for needle in ("on_lookup (hit, unsampled): ns/call", "on_lookup (hit, sampled)",
                   "on_lookup (miss)", "on_store", "on_free", "on_request_done",
                   "OpenTelemetry push on vs off", "engine throughput, sidecar N=1000",
                   "engine throughput, sidecar N=100", "vs 8B prefill", "content stats",
                   "digest", "recompute compare", "vLLM event ingestion",
                   "resident memory", "sampled hit to verdict P99", "verifier busy vs idle",
                   # dispatch=process: per event in the engine's process, the sidecar
                   # process's CPU apart, the hook tail while it verifies
                   "on_store, dispatch=process: engine process ns/event",
                   "engine throughput, sidecar N=1000, dispatch=process",
                   "sidecar process CPU per request",
                   "dispatch=process: sidecar verifying vs idle"):
        assert any(needle in f for f in figures), (needle, figures)
    for r in out["rows"]:
        assert set(r) >= {"figure", "sidecar", "baseline", "ratio", "target", "met"}
        assert math.isfinite(r["baseline"]) and r["baseline"] > 0, r
    assert set(out["raw"]) >= {"hooks", "engine", "checks", "events", "memory",
                               "verification_latency", "tail", "process_events",
                               "process_tail"}
    # N=1000 is the steady state: a run shorter than the start burst (the first 1,000 hits
    # sampled 1 in 10) measured 1 in 10 under N=1000's name until the burst got a row of
    # its own; each configuration's samples say which rate it really ran at.
    engine = out["raw"]["engine"]
    burst = next(k for k in engine if "after a start" in k)
    assert any("after a start" in f for f in figures)
    for hits, samples in zip(engine["N=1000"]["hits"], engine["N=1000"]["samples"],
                             strict=True):
        assert samples <= hits // 1000 + 1, (hits, samples)
    for hits, samples in zip(engine[burst]["hits"], engine[burst]["samples"], strict=True):
        assert hits >= 10 and samples >= hits // 10, (hits, samples)


def test_bench_perf_rejects_an_unknown_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "bench", "perf",
                           "--figures", "hooks,warp"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "unknown figure" in proc.stderr and "warp" in proc.stderr


def test_engine_instruction_profile_rows(monkeypatch: Any) -> None:
    """The engine figure's instruction profile: its child's phases run (natively here: under
    callgrind each ``os.getppid`` is a dump) and mark each phase, and the rows add each
    share in turn over the detached engine, the polls priced at the default rate over the
    detached engine's seconds per request; no profile, one row saying why."""
    import os

    from kvtestbed.bench import perf_engine_instructions as P

    marks = []
    monkeypatch.setattr(os, "getppid", lambda: marks.append(1) or 1)
    P._child_main(2)
    assert len(marks) == 7  # the 7 dumps instruction_profile reads
    monkeypatch.setattr(P, "instruction_profile", lambda n: {
        "requests": 10, "detached": 1_000_000, "attached": 1_002_000,
        "journal_apply": 3_000, "poll": 20_000})
    raw: dict[str, Any] = {"engine": {"detached": {"wall_s": 1.0, "requests": 100}}}
    rows = {r.figure.split(": ", 1)[-1]: r for r in P.instruction_rows(False, raw)}
    thread = next(r for k, r in rows.items() if k.startswith("the engine's thread"))
    assert (thread.sidecar, thread.baseline) == (100_200, 100_000)
    assert rows["+ journal apply"].sidecar == 100_500
    polls = next(r for k, r in rows.items() if k.startswith("+ allocator polls"))
    # 5 polls a second (1 scheduled + 4 nudged), 0.01 s per detached request
    assert polls.sidecar == pytest.approx(100_500 + 0.05 * 20_000)
    assert polls.ratio == pytest.approx(101_500 / 100_000)
    monkeypatch.setattr(P, "instruction_profile", lambda n: {"error": "valgrind not installed"})
    (skipped,) = P.instruction_rows(False, {})
    assert "skipped (valgrind not installed)" in skipped.figure
