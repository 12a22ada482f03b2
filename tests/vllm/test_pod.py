"""The Kubernetes pod of deploy/kubernetes/base, minus Kubernetes: its three containers' command
lines and environment, read from ``kubectl kustomize``, run against a real vLLM OpenAI server
in the pod's start order (install-probe, then kv-sidecar until its startup probe passes, then
vLLM with the probe on PYTHONPATH), with the sidecar verifying sampled hits.

Rewritten for this CPU box, and only this: cluster paths to temporary directories, the
listen address to 127.0.0.1 and the ports to free ones, the block size to 32 (the CPU
backend's minimum), 1 hit in 2 sampled instead of 100, and ``--enforce-eager
--max-model-len 1024`` for vLLM (as examples/vllm/beside.sh). Everything else, flags and
environment, is the manifest's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import kustomize, pod_spec

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], seconds: float) -> None:
    """Until ``url`` answers 200 (a startup probe), or the process dies, or ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited with {proc.returncode} before {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {seconds}s")


class _Pod:
    def __init__(self, tmp: Path, model: str) -> None:
        self.tmp, self.model = tmp, model
        self.engine_port, self.sidecar_port = _free_port(), _free_port()
        self.paths = {"/run/kv-sidecar": tmp / "run", "/opt/kv-sidecar/python": tmp / "python",
                      "/models/model": Path(model), "/cache": tmp / "cache", "/tmp": tmp / "t"}
        for p in self.paths.values():
            p.mkdir(parents=True, exist_ok=True)

    def rewrite(self, arg: str) -> str:
        paths = "|".join(re.escape(p) for p in sorted(self.paths, key=len, reverse=True))
        arg = re.sub(rf"(?<![\w.])({paths})(?![\w])", lambda m: str(self.paths[m[1]]), arg)
        return (arg.replace("--host=0.0.0.0", "--host=127.0.0.1")
                .replace("127.0.0.1:8000", f"127.0.0.1:{self.engine_port}")
                .replace("--port=8000", f"--port={self.engine_port}")
                .replace("--port=9400", f"--port={self.sidecar_port}")
                .replace("--block-size=16", "--block-size=32")
                .replace('"sample_every": 100', '"sample_every": 2'))

    def env(self, container: dict[str, Any], pythonpath: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update({e["name"]: self.rewrite(e["value"]) for e in container.get("env", [])})
        env.setdefault("PYTHONPATH", pythonpath)
        return env


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes the test starts, stopped after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.terminate()
    for p in started:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def test_the_pods_command_lines_run_with_real_vllm(tiny_model: str, sockdir: Path,
                                                    procs: list[subprocess.Popen[bytes]]) -> None:
    spec = pod_spec(kustomize("base"))
    install, sidecar = spec["initContainers"]
    engine = spec["containers"][0]
    pod = _Pod(sockdir, tiny_model)
    bindir = Path(sys.executable).parent

    # 1. install-probe: the kv-sidecar image's python copies the probe into the volume.
    cmd = [pod.rewrite(a) for a in install["command"]]
    assert subprocess.run([sys.executable, *cmd[1:]], timeout=120,
                          env=pod.env(install, str(ROOT))).returncode == 0
    target = pod.paths["/opt/kv-sidecar/python"]
    probe_env = pod.env(engine, str(ROOT))
    assert probe_env["PYTHONPATH"] == str(target)
    where = subprocess.run([sys.executable, "-c", "import sidecar.adapters.vllm.probe as p; "
                            "print(p.__file__)"], env=probe_env, cwd=sockdir,
                           capture_output=True, text=True, timeout=300)
    assert where.stdout.strip().startswith(str(target)), where.stderr[-2000:]

    # 2. kv-sidecar starts alone, and its startup probe passes with no engine yet: the
    #    kubelet would otherwise never start vLLM.
    files = contextlib.ExitStack()
    logs = {name: files.enter_context((sockdir / f"{name}.log").open("wb"))
            for name in ("sidecar", "vllm")}
    try:
        argv = [str(bindir / sidecar["command"][0]), *sidecar["command"][1:],
                *map(pod.rewrite, sidecar["args"])]
        procs.append(subprocess.Popen(argv, env=pod.env(sidecar, str(ROOT)), cwd=sockdir,
                                      stdout=logs["sidecar"], stderr=subprocess.STDOUT))
        sidecar_url = f"http://127.0.0.1:{pod.sidecar_port}"
        _wait(f"{sidecar_url}/healthz", procs[0], 120)

        # 3. vLLM, from its own command line, with the probe from the volume.
        argv = [sys.executable, *engine["command"][1:], *map(pod.rewrite, engine["args"]),
                "--enforce-eager", "--max-model-len", "1024"]
        procs.append(subprocess.Popen(argv, env=probe_env, cwd=sockdir, stdout=logs["vllm"],
                                      stderr=subprocess.STDOUT))
        engine_url = f"http://127.0.0.1:{pod.engine_port}"
        try:
            _wait(f"{engine_url}/health", procs[1], 420)
        except AssertionError as exc:
            logs["vllm"].flush()
            log = (sockdir / "vllm.log").read_text()[-4000:]
            raise AssertionError(f"{exc}\n{log}") from None
        load = subprocess.run([sys.executable, str(ROOT / "examples/vllm/load.py"), "--url",
                               engine_url, "--model", "model", "--requests", "24"],
                              capture_output=True, text=True, timeout=300)
        assert load.returncode == 0, load.stderr[-2000:]
        status: dict[str, Any] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the sampled hits are verified
            with urllib.request.urlopen(f"{sidecar_url}/status", timeout=10) as r:
                status = json.loads(r.read())
            if status["sampled"] > 0 and status["verified"] >= 2 * status["sampled"]:
                break
            time.sleep(1)
    finally:
        files.close()
    tail = "".join((sockdir / f"{n}.log").read_text()[-3000:] for n in logs)
    assert status.get("sampled", 0) > 0, tail
    assert status["verified"] == 2 * status["sampled"] and status["anomalies"] == {}, tail
    assert status["probe_messages"] > 0 and status["engine_mismatches"] == [], tail
    assert status["events"]["hashes_verified"] > 0, tail
    with urllib.request.urlopen(f"{sidecar_url}/metrics", timeout=10) as r:
        assert b"kvsidecar_verified_total" in r.read()
    shutil.rmtree(pod.paths["/cache"], ignore_errors=True)
