"""``kv-sidecar bench perf --engine vllm --quick``, run as a user would: two real vLLM OpenAI
servers (probe and events off, and on at 1 in 100 with ``kv-sidecar vllm serve`` beside it),
two interleaved pairs. The machine is loaded, so the test holds the JSON's structure and
that every ratio is finite and positive, not the issue's thresholds (the full run's)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvtestbed.bench.perf_pair_rows import STEADY_OFF, off_variation

from tests.engine_bench_rows import split_thread_rows
from tests.vllm.conftest import MEASUREMENTS

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 540) -> subprocess.CompletedProcess[str]:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "testbed")])}
    cli = "import sys; from sidecar.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", cli, "bench", "perf", "--engine", "vllm",
                           *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _steps_row(rows: list[dict[str, Any]], pairs: int) -> list[dict[str, Any]]:
    """The rows but vLLM's engine steps per request, after checking that one (its spread
    counts the runs in small batches, not a min..max)."""
    [steps] = [r for r in rows if r["figure"].endswith("vLLM engine steps per request")]
    assert math.isfinite(steps["ratio"]) and steps["sidecar"] > 1 and steps["baseline"] > 1
    name = "off again" if "off again" in steps["figure"] else "on N=100"
    assert f" of {pairs} {name}, " in steps["spread"] and steps["spread"].endswith(
        f" of {pairs} off"), steps
    return [r for r in rows if r is not steps]


def test_quick_json_structure() -> None:
    proc = _run("--quick", "--vllm-control", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    assert out["settings"]["engine"] == "vllm" and out["settings"]["pairs"] == 2
    assert out["settings"]["sample_every"] == [100] and out["settings"]["control"] is True
    # The A/A control (a second off server) first: how far two identical servers differ.
    control = [r for r in out["rows"] if r["figure"].startswith("vLLM off again")]
    assert control and all(r["target"] == "-" and r["met"] is None for r in control)
    assert not any("sidecar's process" in r["figure"] for r in control)
    rows = _steps_row(split_thread_rows([r for r in out["rows"] if r not in control],
                                        "vLLM"), 2)
    assert [r["figure"].rsplit(": ", 1)[1] for r in rows] == [
        "tokens/s by wall time", "request P50 latency", "request P99 latency",
        "CPU seconds of vLLM's processes per run, vs vLLM's off",
        "CPU seconds of the sidecar's process per run, vs vLLM's off"]
    for r in rows + _steps_row(split_thread_rows(control, "vLLM"), 2):
        # The sidecar's process, probing 1 in 100 of 200 requests, can use less than one of
        # /proc's 10 ms ticks in a run: its CPU figure (and the spread's minimum) may read 0.
        floor = 0.0 if "sidecar's process" in r["figure"] else 1e-12
        assert math.isfinite(r["baseline"]) and r["baseline"] > 0, r
        for key in ("sidecar", "ratio"):
            assert math.isfinite(r[key]) and r[key] >= floor, r
        lo, hi = (float(x) for x in r["spread"].split(" ")[0].split(".."))
        # The spread is printed to 3 significant digits: compare the ratio rounded alike
        # (rounding keeps order; a median of 2 pairs can sit under its rounded-up minimum).
        assert floor <= lo <= float(f"{r['ratio']:.3g}") <= hi, r
    raw = out["raw"]["vllm"]
    # judged only where the off runs held steady (kvtestbed.bench.perf_pair_rows.STEADY_OFF)
    steady = off_variation(raw["rounds"]) <= STEADY_OFF
    assert rows[0]["target"] == ">= 0.97"
    assert isinstance(rows[0]["met"], bool) if steady else (
        rows[0]["met"] is None and "not judged" in rows[0]["spread"])
    assert len(raw["rounds"]) == 2
    for rd in raw["rounds"]:
        assert sorted(rd["order"]) == ["off", "off again", "on N=100"]
        for run in rd["runs"].values():
            assert run["requests"] == 200 and run["completion_tokens"] == 200 * 8
            assert run["wall_s"] > 0 and run["p99_s"] >= run["p50_s"] > 0
            assert run["cpu_s"]["vllm"] > 0
            # vLLM's own account of the run: its steps (each run's prompts are new)
            counted = run["engine_counters"]
            assert counted["iteration_tokens_total_count"] >= 200
            # (read as the last answer arrives: vLLM may record its last step's just after)
            assert abs(counted["prompt_tokens_total"] - run["prompt_tokens"]) \
                <= 0.1 * run["prompt_tokens"]
            # every live thread of the engine's process group, by process/thread name: most
            # of the group's CPU (a thread that ended during the run counts in the group's
            # total only), never more (/proc's ticks: 10 ms each)
            cpu = run["cpu_s"]["vllm"]
            assert 0.5 * cpu - 0.1 <= sum(run["threads_cpu_s"].values()) <= 1.05 * cpu + 0.1
    assert rd["order"] != raw["rounds"][0]["order"]  # rotated: interleaved
    ratios = raw["ratios"]["100"]
    for key in ("tokens_per_s", "p50", "p99", "vllm_cpu", "sidecar_cpu"):
        assert len(ratios[key]["pairs"]) == 2
        floor = 0.0 if key == "sidecar_cpu" else 1e-12  # under a tick: above
        assert all(math.isfinite(x) and x >= floor for x in ratios[key]["pairs"])
    # The probe was on: the sidecar saw the timed rounds' lookups and verified samples.
    st = raw["sidecar_status"]["on N=100"]
    assert st["end"]["lookups"] - st["after_warmup"]["lookups"] == 400
    assert st["end"]["sampled"] > st["after_warmup"]["sampled"]
    assert st["end"]["anomalies"] == {}
    MEASUREMENTS["bench perf --engine vllm --quick: tokens/s on/off at N=100"] = (
        f"{rows[0]['ratio']:.3g} ({rows[0]['spread']}), {out['settings']['seconds']} s")


def test_missing_vllm_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = _run("--vllm-python", str(tmp_path / "nothing" / "python"), timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "no vLLM environment" in lines[0], proc.stderr
