"""Record a benchmark run for the site: ``python -m kvtestbed.docs bench NAME``.

A benchmark page shows only numbers a recorded run printed: this runs the bench's command,
keeps its JSON as printed, and stores it in ``docs/bench/NAME.json`` with the command line,
the machine, the commit and the date, which the page prints above its tables. The commands
are the ones listed in :data:`BENCHES` (reduced where the full run takes long on a small
machine; the page says so); rerun one after a change that moves its numbers.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = "docs/bench"


@dataclass(frozen=True)
class Bench:
    """A recorded benchmark: its ``kv-sidecar`` arguments and what the run leaves out."""

    args: tuple[str, ...]
    scope: str  # "full", or what a reduced run leaves out, printed on the page
    json: bool = True  # False: the run prints text (a summary), kept as printed


BENCHES: dict[str, Bench] = {
    "demo": Bench(("demo", "--fault", "zero-block", "--port", "0"),
                  "full: `make demo`'s run (400 requests, the zero-block fault)", json=False),
    "detection": Bench(
        ("bench", "detection", "--dtype", "float32", "bfloat16", "--clean-samples", "1000",
         "--policy-seeds", "0", "--json", "--quiet"),
        "reduced: float32 and bfloat16 (no float16), clean runs of at least 1,000 blocks "
        "(the full run: 5,000), no sampling-policy comparison"),
    "detection-hybrid": Bench(
        ("bench", "detection", "--model", "hybrid", "recurrent", "--dtype", "float32", "bfloat16",
         "--clean-samples", "1000", "--clean-storage", "model", "--policy-seeds", "0", "--json",
         "--quiet"),
        "reduced: the hybrid (Gemma2 sliding + full) and recurrent (LFM2 conv state + full) "
        "models in float32 and bfloat16, clean runs of at least 1,000 blocks (the full run: "
        "5,000)"),
    "perf": Bench(("bench", "perf", "--json"),
                  "full: medians of 5 repeats, callgrind instruction counts included"),
    "perf-vllm": Bench(("bench", "perf", "--engine", "vllm", "--vllm-requests", "600",
                        "--vllm-sample-every", "1000", "100", "--vllm-control", "--repeats",
                        "8", "--json"),
                       "reduced: 600 requests per timed run (the full run: 2,000), 8 "
                       "interleaved pairs, N = 1000 and 100 (the targets'), with an A/A "
                       "control (a second off server); needs `.venv-vllm`"),
    "perf-sglang": Bench(("bench", "perf", "--engine", "sglang", "--json"),
                         "full: 1,200 requests per timed run, 5 interleaved pairs, N = 1000 and "
                         "100, SGLang's --kv-canary tried beside them; needs `.venv-sglang`"),
    "reliability": Bench(("bench", "reliability", "--json"),
                         "full: 100k cases per decoder, 10k per file and config surface, "
                         "20 kill cycles (issue 21's acceptance run)"),
}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_at_start": load}


def _commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty",
                               "--abbrev=7"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(name: str, root: Path) -> int:
    """Run bench ``name`` and store its JSON; the bench's own exit code (1: a check failed,
    which the page shows, never hides)."""
    bench = BENCHES[name]
    commit = _commit(root)  # the code the run measures: taken before it starts
    host = machine()  # its load average is the one at the start (taken after, it was the end's)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", *bench.args],
                          capture_output=True, text=True, cwd=root)
    seconds = time.monotonic() - t0
    try:
        result = json.loads(proc.stdout) if bench.json else proc.stdout
    except json.JSONDecodeError:
        print(f"bench {name}: no JSON on stdout (exit {proc.returncode})\n{proc.stderr[-4000:]}",
              file=sys.stderr)
        return 2
    doc = {"bench": name, "command": " ".join(("kv-sidecar", *bench.args)),
           "scope": bench.scope, "exit_code": proc.returncode,
           "date": started.strftime("%Y-%m-%d %H:%M UTC"), "seconds": round(seconds, 1),
           "commit": commit, "machine": host, "result": result}
    path = root / BENCH_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    print(f"bench {name}: {seconds:.0f} s, exit {proc.returncode}, stored {path}")
    return proc.returncode
