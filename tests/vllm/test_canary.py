"""The black-box canary against a real vLLM OpenAI server on loopback: one server per dtype
(each start costs 20-35 s on 2 cores), several checks per server.

The server loads a test-only KV connector (tests/vllm/canary_corruptor.py) that zeroes the
blocks a request hits while a flag file exists: the same server is clean, then corrupted.
A test-only proxy (tests/vllm/usage_doctor.py) doctors the ``usage`` it reports.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient
from sidecar.canary.endpoint import parse_endpoint
from sidecar.canary.load import RateLimit
from sidecar.canary.probes import expected_cached
from sidecar.canary.replay import ReplayProxy
from sidecar.canary.runner import Canary, CanaryConfig, make_canary
from sidecar.cli.main import main
from tests.vllm.conftest import MEASUREMENTS
from tests.vllm.usage_doctor import UsageDoctor

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
# Checks the dtype does not change run on the fp32 server only (the same server instance).
FP32_ONLY = pytest.mark.parametrize("server", ["float32"], indirect=True)
FAST = RateLimit(fraction=1.0, min_rate=100.0, max_rate=100.0)  # a test server: no pacing


@dataclass
class Server:
    dtype: str
    port: int
    flag: Path  # exists -> the corruptor zeroes every hit's blocks
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def corrupt(self) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def on() -> Iterator[None]:
            self.flag.touch()
            try:
                yield
            finally:
                self.flag.unlink(missing_ok=True)
        return on()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def server(request: pytest.FixtureRequest, tiny_model: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    dtype = request.param
    run = tmp_path_factory.mktemp(f"canary-{dtype}")
    srv = Server(dtype, _free_port(), run / "corrupt", run / "vllm.log")
    template = run / "chat.jinja"  # the tiny tokenizer has no chat template of its own
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    kv = {"kv_connector": "CanaryCorruptor", "kv_role": "kv_both",
          "kv_connector_module_path": "tests.vllm.canary_corruptor",
          "kv_connector_extra_config": {"flag": str(srv.flag)}}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    started = time.monotonic()
    with srv.log.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
             "--dtype", dtype, "--block-size", str(BLOCK), "--enable-prefix-caching",
             "--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1",
             "--port", str(srv.port), "--enable-prompt-tokens-details", "--seed", "0",
             "--chat-template", str(template), "--kv-transfer-config", json.dumps(kv)],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("vLLM server did not start:\n" + srv.log.read_text()[-4000:])
                time.sleep(0.5)
        MEASUREMENTS[f"canary: vLLM server start ({dtype}), s"] = round(
            time.monotonic() - started, 1)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _canary(endpoint: str, dtype: str, pairs: int, seed: int, mode: str = "auto") -> Canary:
    client = OpenAIClient(parse_endpoint(endpoint), timeout_s=60)
    cfg = CanaryConfig(dtype=dtype, block_size=BLOCK, mode=mode, pairs=pairs, seed=seed,
                       calibration=6, rate=RateLimit(FAST.fraction, FAST.min_rate,
                                                     FAST.max_rate), metrics_every=2)
    return make_canary(client, cfg)


def _hitting_pairs(canary: Canary, pairs: int) -> int:
    """Pairs whose prompt has at least one full block a repeat can hit."""
    return sum(1 for i in range(pairs)
               if expected_cached(canary.lengths[i % len(canary.lengths)], BLOCK) > 0)


def test_clean_server_is_quiet_and_its_counters_agree(server: Server) -> None:
    """Through the CLI, as a user runs it: salt mode detected, tolerance calibrated from
    miss-vs-miss noise, every pair under it, vLLM's cached_tokens and its /metrics hit
    counter exactly what the pairs prove."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["canary", "--endpoint", server.endpoint, "--dtype", server.dtype,
                   "--block-size", str(BLOCK), "--pairs", "12", "--calibration", "6",
                   "--min-rate", "100", "--max-rate", "100", "--json",
                   "--timeout", "120"])  # a request's limit bounds a hang: the first
                                         # answers of a fresh CPU server on a loaded machine
    report = json.loads(out.getvalue())
    assert rc == 0, report
    assert report["mode"] == "salt" and report["calibrated"]
    assert report["pairs"] == 12 and report["requests"] == 36
    assert report["anomalies"] == 0 and report["audit"] == {} and report["errors"] == {}
    assert report["max_divergence"] <= report["tolerance"]
    assert report["server_rate"] is not None  # read from vLLM's /metrics
    MEASUREMENTS[f"canary: clean max divergence ({server.dtype})"] = report["max_divergence"]
    MEASUREMENTS[f"canary: tolerance ({server.dtype})"] = report["tolerance"]


def test_zeroed_cache_blocks_are_caught(server: Server) -> None:
    canary = _canary(server.endpoint, server.dtype, pairs=9, seed=11)
    with server.corrupt():
        report = canary.run()
    hitting = _hitting_pairs(canary, 9)
    assert hitting >= 6
    assert report.anomalies == hitting, report.as_dict()  # every pair with a hit block
    m = canary.exporter.metrics
    assert m.value(S.ANOMALIES.name, group="0",
                   kind=S.AnomalyKind.RECOMPUTE_MISMATCH.value) == hitting
    assert m.value(S.VERIFIED.name, group="0") == 9
    # vLLM's /metrics hit counter was read and kept up with the hits it reported.
    assert canary.metrics_audit.start is not None and canary.metrics_audit.proven > 0
    assert report.audit == {}
    exposition = generate_latest(m.registry).decode()
    assert f'{S.ANOMALIES.name}{{engine="canary",group="0",kind="recompute_mismatch"' in \
        exposition
    caught = sorted(d for d in report.divergences if d > report.tolerance)
    MEASUREMENTS[f"canary: smallest caught divergence ({server.dtype})"] = caught[0]
    assert "zeroed blocks" in server.log.read_text()


@FP32_ONLY
def test_doctored_cached_tokens_are_flagged(server: Server) -> None:
    with UsageDoctor(server.port) as doctor:
        canary = _canary(doctor.url + "/v1", server.dtype, pairs=6, seed=21)
        report = canary.run()
    # The doctored salted repeat claims a hit, so the canary falls back to plain pairs;
    # every first send of a fresh prompt then reports cached tokens that cannot exist.
    assert canary.mode == "pair" and doctor.rewritten >= 12
    assert report.audit.get(S.AuditKind.PHANTOM_HIT.value) == 6, report.as_dict()
    assert report.anomalies == 0  # the KV itself is fine
    m = canary.exporter.metrics
    assert m.value(S.HIT_AUDIT_MISMATCHES.name,
                   kind=S.AuditKind.PHANTOM_HIT.value) == 6


@FP32_ONLY
def test_replay_proxy_forwards_unchanged_and_catches_corruption(server: Server) -> None:
    canary = _canary(server.endpoint, server.dtype, pairs=6, seed=31)
    canary.run()  # calibrates the tolerance the proxy uses
    proxy = ReplayProxy(canary.client, canary.exporter, canary.tolerance, every=2).start()
    try:
        def ask(base: str, prompt: list[int]) -> dict:
            body = json.dumps({"model": canary.model, "prompt": prompt, "max_tokens": 3,
                               "temperature": 0.0}).encode()
            req = urllib.request.Request(base + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=60).read())

        prompts = [canary.prompts.prompt(80) for _ in range(4)]
        for p in prompts:
            via, direct = ask(proxy.url, p), ask(f"http://127.0.0.1:{server.port}", p)
            assert via["choices"][0]["text"] == direct["choices"][0]["text"]
        proxy.drain()
        assert proxy.stats["replayed"] == 2 and proxy.stats["anomalies"] == 0
        with server.corrupt():
            for _ in range(4):
                ask(proxy.url, canary.prompts.prompt(80))
            proxy.drain()
        assert proxy.stats["replayed"] == 4 and proxy.stats["anomalies"] == 2, proxy.stats

        def chat(words: list[int]) -> dict:
            body = json.dumps({"model": canary.model, "max_tokens": 3, "temperature": 0.8,
                               "messages": [{"role": "user",
                                             "content": " ".join(f"w{w}" for w in words)}]})
            req = urllib.request.Request(proxy.url + "/v1/chat/completions", body.encode(),
                                         {"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=60).read())

        for _ in range(2):  # chat traffic, sampled at random temperature: replayed greedy
            assert chat(canary.prompts.prompt(80))["choices"][0]["message"]["content"]
        proxy.drain()
        assert proxy.stats["replayed"] == 5 and proxy.stats["anomalies"] == 2, proxy.stats
        with server.corrupt():
            for _ in range(2):
                chat(canary.prompts.prompt(80))
            proxy.drain()
        assert proxy.stats["replayed"] == 6 and proxy.stats["anomalies"] == 3, proxy.stats
        assert proxy.stats["errors"] == 0
    finally:
        proxy.stop()


@FP32_ONLY
def test_example_script_against_the_running_server(server: Server, tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "ENDPOINT": server.endpoint, "DTYPE": server.dtype, "PAIRS": "6",
           "PY": sys.executable, "RUN": str(tmp_path), "CANARY_PORT": str(port),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "canary" / "canary.sh")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["pairs"] == 6 and report["anomalies"] == 0 and report["audit"] == {}
    assert f"canary /metrics on http://127.0.0.1:{port}/metrics" in proc.stderr
