"""The CLI as a user meets it: errors, listings, the demo's JSON and its live /metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from kvtestbed.demo import DemoOptions, run_demo
from kvtestbed.engines.faults import FAULTS

from sidecar import signals as S
from sidecar.cli.main import main

REQUIRED_KEYS = {"lookups", "hits", "hit_rate", "token_hit_rate", "verified", "anomalies",
                 "anomaly_rate", "allocation_failures", "fragmentation_ratio",
                 "p99_latency_seconds", "dropped"}


@pytest.mark.parametrize("argv", [
    ["demo", "--fault", "no-such-fault"],
    ["demo", "--sample-every", "0"],
    ["demo", "--dtype", "float64"],
    ["demo", "--requests", "many"],
    ["demo", "--port", "99999"],
    ["nonsense"],
])
def test_bad_usage_exits_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and len(err.strip()) > 10


def test_faults_lists_every_fault_with_a_description(capsys):
    assert main(["faults"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(FAULTS)
    assert all(len(ln.split(maxsplit=1)[1]) > 15 for ln in lines)


def test_signals_markdown_is_the_signals_table(capsys):
    assert main(["signals", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == S.markdown_table().strip()


def test_demo_clean_run_summary():
    s = run_demo(DemoOptions(fault="none", requests=120, port=0, progress=False))
    assert set(s) >= REQUIRED_KEYS
    assert s["hit_rate"] >= 0.7 and s["verified"] >= 50
    assert s["anomalies"] == {} and s["anomaly_rate"] == 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return r.read().decode()


def test_demo_serves_every_signal_while_it_runs():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "demo", "--fault", "zero-block", "--requests",
         "80", "--port", str(port), "--hold", "30", "--json", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        body = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = _scrape(port)
            except OSError:
                time.sleep(0.2)
                continue
            if "kvsidecar_lookups_total{" in body and not body.count(
                    'kvsidecar_lookups_total{engine="reference",model="tiny-llama"} 0.0'):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "demo exited before it could be scraped"
        for sig in S.core_signals():
            assert f"# HELP {sig.name} " in body, f"{sig.name} missing from live /metrics"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
