"""The two documented ways to run kv-sidecar with vLLM, run exactly as a user would from
examples/vllm: beside the OpenAI server (two processes, engine-side recompute over HTTP,
/metrics scraped) and in-process with ``vllm.LLM``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import signals as S
from tests.vllm.conftest import MEASUREMENTS

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "vllm"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user runs it
    return env


def _sample(metrics: str, name: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_beside_the_openai_server(tiny_model: str, sockdir: Path) -> None:
    env = _env(MODEL=tiny_model, DTYPE="float32", PY=sys.executable, RUN=str(sockdir),
               VLLM_PORT=str(_free_port()), SIDECAR_PORT=str(_free_port()),
               SAMPLE_EVERY="2", REQUESTS="48", POLL_EVERY="1",
               PROFILE_OUT=str(sockdir / "profile.json"),
               PROFILE_MIN_BLOCKS="16")
    proc = subprocess.run(["bash", str(EXAMPLES / "beside.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=420)
    logs = "".join((sockdir / f).read_text()[-3000:] for f in ("vllm.log", "sidecar.log")
                   if (sockdir / f).exists())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    load = json.loads((sockdir / "load.json").read_text())
    status = json.loads((sockdir / "status.json").read_text())
    metrics = (sockdir / "sidecar-metrics.txt").read_text()
    assert load["vllm_prefix_cache_hits"] > 0  # vLLM's own counters
    assert status["lookups"] == 48 and status["hits"] == 44
    assert status["sampled"] in (22, 23)  # 1 in 2, from the probe's seeded phase
    assert status["verified"] == 2 * status["sampled"] and status["anomalies"] == {}
    assert status["engine_mismatches"] == [] and status["adapter_errors"] == 0
    ev = status["events"]
    assert ev["hashes_verified"] == ev["events_stored"] > 0
    assert ev["hash_mismatches"] == ev["decode_errors"] == ev["unknown_removals"] == 0
    # vLLM's series under the sidecar's names (the bridge), next to the verification ones.
    assert _sample(metrics, S.HIT_TOKENS.name) > 0
    assert _sample(metrics, S.ALLOCATIONS.name) > 0
    assert _sample(metrics, S.BLOCKS.name) > 0
    assert _sample(metrics, S.REQUEST_LATENCY.name + "_count") >= 48
    MEASUREMENTS["beside: sampled hits verified (engine reference)"] = status["sampled"]
    # PROFILE_OUT: the run was a calibration of a trusted vLLM; the sidecar wrote what it
    # measured when the script stopped it, in the file --calibration-profile loads.
    from sidecar.checks.calibration_profile import load_profile

    profile = load_profile(sockdir / "profile.json")
    by_path = {e.write_path: e for e in profile.entries}
    assert {e.reference for e in profile.entries} == {"engine"}
    assert {e.dtype for e in profile.entries} == {"float32"}
    assert "all" in by_path and by_path["all"].blocks == status["verified"]
    assert "prefill" in by_path  # the probe reports each block's write path
    for e in profile.entries:
        assert 0 <= e.floor <= e.tolerance and e.blocks >= 16, e
    assert "wrote " in (sockdir / "sidecar.log").read_text()
    MEASUREMENTS["beside: calibration profile written (path: floor over blocks)"] = {
        p: (e.floor, e.blocks) for p, e in by_path.items()}


def test_in_process_with_vllm_llm(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "inprocess.py"), "--model", tiny_model, "--dtype",
         "bfloat16", "--requests", "40", "--sample-every", "2", "--reference", "hf",
         "--summary-json", str(out)],
        env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), cwd=ROOT, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["lookups"] == 40 and s["hits"] == 36 and s["sampled"] == 18
    assert s["verified"] == 36 and s["anomalies"] == {} and s["reference"] == "hf"
    assert 0 < s["max_recompute_error"] <= s["tolerance"]  # bf16 HF noise, under tolerance
    assert s["events"]["hash_mismatches"] == 0 and s["events"]["hashes_verified"] > 0
