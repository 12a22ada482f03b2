"""``kv-sidecar bench reliability --quick`` in the suite (~10 s): every fuzzer, flood,
adapter fault and SIGKILL cycle runs, nothing escapes, nothing is lost."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_reliability_quick_json() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "bench", "reliability",
                           "--quick", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    rows = {r["name"]: r for r in out["rows"]}
    assert set(rows) == {"kv_events", "probe_wire", "hook_objects", "http_requests",
                         "adapter_faults", "evidence_sigkill",
                         "replay proxy"}  # sidecar/bench/reliability_proxy.py
    for r in rows.values():
        assert r["cases"] > 0 and r["escaped"] == 0 and r["lost"] == 0, r
        assert r["survived"] == r["cases"], r
    assert out["floods"]["labels"]["series"] < 100
    assert out["floods"]["http"]["idle_closed"] == out["floods"]["http"]["idle"]
    assert out["ok"] is True
    assert out["replay_proxy"]["held_after"] == 0 and out["replay_proxy"]["threads_added"] == 0
