"""The demo's /status honours KVSIDECAR_TOKEN like every other kv-sidecar server (an outside
check found it open with the token set, and an empty token accepted)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from sidecar.cli.main import main


@pytest.mark.parametrize("token", ["", "   ", "bad token"])
def test_an_unusable_token_is_a_usage_error(monkeypatch, capsys, token: str) -> None:
    monkeypatch.setenv("KVSIDECAR_TOKEN", token)
    assert main(["demo", "--requests", "1", "--port", "0", "--quiet"]) == 2
    assert "KVSIDECAR_TOKEN" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(port: int, header: str | None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/status")
    if header is not None:
        req.add_header("Authorization", header)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_status_needs_the_token_while_the_demo_runs() -> None:
    port = _free_port()
    env = {**os.environ, "KVSIDECAR_TOKEN": "s3cret"}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli.main", "demo", "--requests", "2",
                             "--port", str(port), "--hold", "60", "--quiet"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 180  # bounds a hang only: start-up is seconds
        while True:  # up once /healthz answers (it needs no token)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
                break
            except (urllib.error.HTTPError, OSError):
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                assert time.monotonic() < end, "demo server never came up"
                time.sleep(0.2)
        assert _status(port, None) == 401
        assert _status(port, "Bearer wrong") == 401
        assert _status(port, "Bearer s3cret") == 200
    finally:
        proc.kill()
        proc.communicate()
