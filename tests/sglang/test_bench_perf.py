"""``kv-sidecar bench perf --engine sglang --quick``, run as a user would: two real SGLang
servers (SGLang's own radix cache, and the kv-sidecar backend with the tap at 1 in 100 and
``kv-sidecar sglang serve`` beside it) and an A/A control (a second off server), two
interleaved pairs. The ``--kv-canary`` server is
left out here to keep the stage short (the recorded full run has it, docs/bench/perf.md). The
machine is loaded, so the test holds the JSON's structure, that every ratio is finite and
positive and that the tap saw the timed traffic, not the issue's threshold (the full run's)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_bench_rows import split_thread_rows
from tests.sglang.conftest import MEASUREMENTS

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 40


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "testbed")])}
    cli = "import sys; from sidecar.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", cli, "bench", "perf", "--engine", "sglang",
                           *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(1000)
def test_quick_json_structure() -> None:
    proc = _run("--quick", "--json", "--sglang-no-canary", "--sglang-control",
                "--sglang-requests", str(REQUESTS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    assert out["settings"]["engine"] == "sglang" and out["settings"]["pairs"] == 2
    assert out["settings"]["sample_every"] == [100] and out["settings"]["canary"] is False
    # The A/A control (a second off server) first: how far two identical servers differ.
    control = [r for r in out["rows"] if "off again (A/A control" in r["figure"]]
    assert control == out["rows"][:len(control)] and control
    assert [r["figure"].rsplit(": ", 1)[1] for r in split_thread_rows(control, "SGLang")] == [
        "tokens/s by wall time", "request P50 latency", "request P99 latency",
        "CPU seconds of SGLang's processes per run, vs SGLang's off"]
    for r in control:
        assert r["target"] == "-" and r["met"] is None and r["sidecar"] > 0, r
    rows = split_thread_rows(out["rows"][len(control):], "SGLang")
    assert [r["figure"].rsplit(": ", 1)[1] for r in rows] == [
        "tokens/s by wall time", "request P50 latency", "request P99 latency",
        "CPU seconds of SGLang's processes per run, vs SGLang's off",
        "CPU seconds of the sidecar's process per run, vs SGLang's off",
        "the tap's own time in SGLang's process per request, vs SGLang's CPU per request (off)"]
    tap_row = rows.pop()
    # The tap timed itself on SGLang's thread: some time per request, well under SGLang's
    # whole CPU per request.
    assert tap_row["sidecar"] > 0 and 0 < tap_row["ratio"] < 1, tap_row
    for r in rows:
        # The sidecar's CPU over a 40-request run can be under /proc's 10 ms tick: 0 then.
        least = 0.0 if "sidecar's process" in r["figure"] else math.ulp(0.0)
        for key in ("sidecar", "baseline", "ratio"):
            assert math.isfinite(r[key]) and r[key] >= least, r
        lo, hi = (float(x) for x in r["spread"].split(" ")[0].split(".."))
        # The spread is printed to 3 significant digits: compare the ratio rounded alike
        # (rounding keeps order; the median of 2 pairs, 1.0394, sat under "1.04..": failed).
        assert least <= lo <= float(f"{r['ratio']:.3g}") <= hi, r
    assert rows[0]["target"] == "-"  # the target is set at 1 in 1000, not 100
    raw = out["raw"]["sglang"]
    assert len(raw["rounds"]) == 2
    for rd in raw["rounds"]:
        assert sorted(rd["order"]) == ["off", "off again", "tap N=100"]
        for run in rd["runs"].values():
            assert run["requests"] == REQUESTS and run["completion_tokens"] == REQUESTS * 8
            assert run["wall_s"] > 0 and run["p99_s"] >= run["p50_s"] > 0
            assert run["cpu_s"]["sglang"] > 0
            # every live thread of the engine's process group, by process/thread name: most
            # of the group's CPU (a thread that ended during the run counts in the group's
            # total only), never more (/proc's ticks: 10 ms each)
            cpu = run["cpu_s"]["sglang"]
            assert 0.5 * cpu - 0.1 <= sum(run["threads_cpu_s"].values()) <= 1.05 * cpu + 0.1
    assert rd["order"] != raw["rounds"][0]["order"]  # rotated: interleaved
    # The tap was on: the sidecar counted every timed request's lookup (batched in the
    # engine, flushed when the last request of a round is released), and was quiet.
    st = raw["sidecar_status"]["tap N=100"]
    assert st["end"]["lookups"] - st["after_warmup"]["lookups"] >= 2 * REQUESTS
    assert st["end"]["anomalies"] == {}
    MEASUREMENTS["bench perf --engine sglang --quick: tokens/s A/A control/off"] = (
        f"{control[0]['ratio']:.3g} ({control[0]['spread']})")
    MEASUREMENTS["bench perf --engine sglang --quick: tokens/s tap/off at N=100"] = (
        f"{rows[0]['ratio']:.3g} ({rows[0]['spread']}), {out['settings']['seconds']} s")


def test_missing_sglang_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = _run("--sglang-python", str(tmp_path / "nothing" / "python"), timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "no SGLang environment" in lines[0], proc.stderr
