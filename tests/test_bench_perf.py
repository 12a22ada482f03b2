"""`kv-sidecar bench perf --quick --json` works and reports every figure of the issue, each
row with a baseline measured in the same run and a ratio (no timing is asserted: the
numbers of a quick run on a shared machine mean nothing; the command is what is tested)."""

from __future__ import annotations

import json
import math
import subprocess
import sys


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
