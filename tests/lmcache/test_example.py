"""examples/lmcache/run.py runs as a user would run it, and shows the damage it injects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lmcache

REPO = Path(__file__).resolve().parents[2]


def test_example_names_a_zeroed_disk_chunk_by_tier() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"}
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "lmcache" / "run.py"),
         "--fault", "zero-disk-chunk", "--requests", "40", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO, check=True)
    report = json.loads(out.stdout)
    assert report["metrics_url"].startswith("http://127.0.0.1:")
    assert report["anomalies_by_tier_and_kind"].get("disk/zeros", 0) >= 1
    assert report["hit_rate"] > 0.9  # LMCache's own view: nearly everything hit
    assert any('tier="disk"' in line and 'kind="zeros"' in line
               for line in report["exposition_lines"]), "served on /metrics"
