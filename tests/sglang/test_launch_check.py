"""A refused tap setting stops a real SGLang 0.5.23 launch with one line, before anything
starts (``sidecar.adapters.sglang.backend.check_launch``, hooked on SGLang's flag
resolution through its plugin hook registry). Checked only where the tree is built, the
same setting came as a scheduler's traceback and SGLang killing its processes (exit 137).

No model is loaded: the check runs before SGLang resolves ``--model-path``, and a launch
whose settings pass goes on to SGLang's own error for the missing model. The shims on
``PYTHONPATH`` (tests/sglang/shims: a placeholder ``torchvision``, vLLM's rotary op in
torch) are there only for SGLang's imports on this CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang.harness import ROOT, SHIMS

pytestmark = pytest.mark.sglang


def _launch(tmp_path: Path, settings: dict[str, object]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIMS), str(ROOT), env.get("PYTHONPATH", "")])
    env["KVSIDECAR_SGLANG_TAP"] = json.dumps(settings)
    cmd = [sys.executable, "-m", "sglang.launch_server",
           "--model-path", str(tmp_path / "no-model-here"), "--device", "cpu",
           "--radix-cache-backend", "kv-sidecar", "--page-size", "1",
           "--host", "127.0.0.1", "--port", "1"]
    return subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600)


def test_a_refused_tap_setting_stops_the_launch_with_one_line(tmp_path: Path) -> None:
    out = _launch(tmp_path, {"endpoint": f"ipc://{tmp_path}/p.sock", "sample_every": 0,
                             "census_sahre": 0.1})
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kv-sidecar (--radix-cache-backend kv-sidecar): KVSIDECAR_SGLANG_TAP")
    assert "'census_sahre'" in last and "sample_every" in last  # each problem named
    assert "Traceback" not in out.stderr


def test_settings_that_pass_leave_the_launch_to_sglang(tmp_path: Path) -> None:
    out = _launch(tmp_path, {"endpoint": f"ipc://{tmp_path}/p.sock"})
    assert out.returncode != 0  # no model there: SGLang's own error, not the check's
    assert "kv-sidecar (--radix-cache-backend" not in out.stderr
    assert "no-model-here" in out.stderr
