"""The canary's logic against a tiny stdlib OpenAI-compatible server on loopback (the real
server is tests/vllm/test_canary.py): bad input and unusable servers exit 2 with a clear
message, the comparison, tolerance, audit and rate limit behave as documented, and the
replay proxy forwards bytes unchanged."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient
from sidecar.canary.endpoint import CanaryError, parse_endpoint
from sidecar.canary.load import RateLimit
from sidecar.canary.probes import boundary_lengths, expected_cached
from sidecar.canary.runner import CanaryConfig, make_canary
from sidecar.cli.main import main
from tests.canary_fake import BLOCK, FakeServer, _fast, _free_port


# ---------------------------------------------------------------- bad input: exit code 2
@pytest.mark.parametrize("url, message", [
    ("http://192.0.2.1:8000/v1", "not a loopback address"),
    ("ftp://127.0.0.1:8000/v1", "expected http://HOST:PORT/v1"),
    ("127.0.0.1:8000", "expected http://HOST:PORT/v1"),
    ("http://127.0.0.1:99999/v1", "bad endpoint"),
])
def test_bad_or_remote_endpoint_exits_2_without_sending(url: str, message: str) -> None:
    rc, out = _fast(url, "--pairs", "1")
    assert rc == 2 and message in out, out


def test_remote_endpoint_needs_the_explicit_flag() -> None:
    with pytest.raises(CanaryError, match="--allow-remote"):
        parse_endpoint("http://192.0.2.1:8000/v1")
    assert parse_endpoint("http://192.0.2.1:8000/v1", allow_remote=True).root == \
        "http://192.0.2.1:8000"
    assert parse_endpoint("http://127.0.0.1:8000").base == "http://127.0.0.1:8000/v1"


def test_refused_connection_exits_2_with_the_message_on_stderr() -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["canary", "--endpoint", f"http://127.0.0.1:{_free_port()}/v1"])
    assert rc == 2 and out.getvalue() == ""
    assert err.getvalue().startswith("kv-sidecar canary: error: connection refused by ")


def test_server_without_logprobs_exits_2() -> None:
    with FakeServer(logprobs=False) as fake:
        rc, out = _fast(fake.endpoint, "--pairs", "1")
    assert rc == 2 and "no logprobs" in out, out


def test_not_an_openai_server_exits_2() -> None:
    with FakeServer() as fake:  # /nope/models answers 404
        rc, out = _fast(f"http://127.0.0.1:{fake.port}/nope", "--pairs", "1")
    assert rc == 2 and "HTTP 404" in out, out


def test_bad_token_range_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:  # the flag's type refuses it, as config check does
        main(["canary", "--endpoint", "http://127.0.0.1:1/v1", "--token-range", "9:3"])
    assert exc.value.code == 2 and "--token-range" in capsys.readouterr().err


# ---------------------------------------------------------------- runs against the fake
def test_clean_fake_is_quiet_in_salt_mode() -> None:
    with FakeServer() as fake:
        rc, out = _fast(fake.endpoint, "--pairs", "6", "--json")
    r = json.loads(out)
    assert rc == 0 and r["mode"] == "salt" and r["anomalies"] == 0 and r["audit"] == {}
    assert r["requests"] == 18 and r["max_divergence"] == 0.0 and r["calibrated"]
    salted = [b for b in fake.bodies if "cache_salt" in b]
    assert len({b["cache_salt"] for b in salted}) == len(salted) == 7  # 6 + the detection


def test_corrupted_hits_are_anomalies_and_exit_1() -> None:
    with FakeServer(corrupt=True) as fake:
        rc, out = _fast(fake.endpoint, "--pairs", "6", "--json")
    r = json.loads(out)
    hitting = sum(1 for n in boundary_lengths(BLOCK)[:6] if expected_cached(n, BLOCK))
    assert rc == 1 and r["anomalies"] == hitting == 4 and r["audit"] == {}


def test_server_ignoring_cache_salt_falls_back_to_pairs() -> None:
    with FakeServer(salt=False) as fake:
        rc, out = _fast(fake.endpoint, "--pairs", "4", "--json")
    r = json.loads(out)
    assert rc == 0 and r["mode"] == "pair" and r["requests"] == 8 and r["audit"] == {}


def test_doctored_usage_is_a_phantom_hit_signal() -> None:
    with FakeServer(doctor=True) as fake:
        client = OpenAIClient(parse_endpoint(fake.endpoint))
        canary = make_canary(client, CanaryConfig(
            dtype="float32", block_size=BLOCK, pairs=4,
            rate=RateLimit(min_rate=1000, max_rate=1000)))
        report = canary.run()
    assert canary.mode == "pair" and report.audit == {"phantom_hit": 4}
    m = canary.exporter.metrics
    assert m.value(S.HIT_AUDIT_MISMATCHES.name, kind="phantom_hit") == 4
    assert m.value(S.LOOKUPS.name) == 8 and m.value(S.SAMPLED.name) == 4
    assert m.value(S.VERIFIED.name, group="0") == 4
    assert m.value(S.CANARY_PROBE_LATENCY.name + "_count", role="hit") == 4


def test_stuck_metrics_counter_is_flagged() -> None:
    with FakeServer() as fake:
        client = OpenAIClient(parse_endpoint(fake.endpoint))
        canary = make_canary(client, CanaryConfig(
            dtype="float32", block_size=BLOCK, pairs=4, metrics_every=1,
            rate=RateLimit(min_rate=1000, max_rate=1000)))
        fake.stuck_hits = fake.hits  # from here on the counter stays where it is
        report = canary.run()
    assert report.audit.get("metrics_under_reported", 0) >= 1
    assert "under_reported" not in report.audit  # usage itself was honest


def test_honest_metrics_counter_is_not_flagged() -> None:
    with FakeServer() as fake:
        client = OpenAIClient(parse_endpoint(fake.endpoint))
        canary = make_canary(client, CanaryConfig(
            dtype="float32", block_size=BLOCK, pairs=6, metrics_every=1,
            rate=RateLimit(min_rate=1000, max_rate=1000)))
        report = canary.run()
    assert report.audit == {} and canary.metrics_audit.proven > 0


@pytest.mark.parametrize("flag, value", [("--port", "70000"), ("--pairs", "-1"),
                                         ("--dtype", "int3")])
def test_bad_flags_exit_2(flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        main(["canary", "--endpoint", "http://127.0.0.1:1/v1", flag, value])
    assert exc.value.code == 2


def test_long_running_canary_with_replay_proxy_stops_on_sigterm() -> None:
    """As deployed: no --pairs, /metrics on loopback with engine="canary", the replay proxy
    in front of the server, SIGTERM prints the report (replays included) and exits 0."""
    port, replay_port = _free_port(), _free_port()
    with FakeServer() as fake:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "canary", "--endpoint", fake.endpoint,
             "--block-size", str(BLOCK), "--dtype", "float32", "--port", str(port),
             "--min-rate", "50", "--max-rate", "50", "--json",
             "--replay-port", str(replay_port), "--replay-every", "1"],
            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        try:
            deadline, body = time.monotonic() + 30, ""
            want = f'{S.VERIFIED.name}{{engine="canary",group="0",model="fake"}}'
            while time.monotonic() < deadline and want not in body:
                time.sleep(0.2)
                with contextlib.suppress(OSError):
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                  timeout=5).read().decode()
            assert want in body, body[-2000:]
            for i in range(2):  # user traffic through the replay proxy
                req = urllib.request.Request(
                    f"http://127.0.0.1:{replay_port}/v1/completions",
                    json.dumps({"model": "fake", "prompt": list(range(i, i + 9)),
                                "max_tokens": 2, "logprobs": 1}).encode(),
                    {"Content-Type": "application/json"})
                assert json.loads(urllib.request.urlopen(req, timeout=10).read())["choices"]
            assert f'{S.CANARY_PROBE_LATENCY.name}_count{{engine="canary",model="fake",' \
                   f'role="hit"}}' in body
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["pairs"] >= 1 and report["anomalies"] == 0 and report["audit"] == {}
    assert report["replay"]["forwarded"] == 2 and report["replay"]["replayed"] == 2
    assert report["replay"]["anomalies"] == 0


def test_server_that_dies_after_preflight_exits_2() -> None:
    fake = FakeServer()
    with fake:
        client = OpenAIClient(parse_endpoint(fake.endpoint))
        canary = make_canary(client, CanaryConfig(
            dtype="float32", block_size=BLOCK, pairs=2,
            rate=RateLimit(min_rate=1000, max_rate=1000)))
    report = canary.run()  # the server is gone: every pair fails, counted by reason
    assert report.divergences == [] and report.errors == {"connect": 2}
    assert canary.exporter.metrics.value(S.CANARY_ERRORS.name, reason="connect") == 2


def test_cli_run_in_which_no_pair_completes_exits_2() -> None:
    with FakeServer() as fake:
        fake.fail_after = 2  # the preflight probe and the cache_salt check succeed
        rc, out = _fast(fake.endpoint, "--pairs", "2")
    assert rc == 2 and "no paired probe completed" in out and "http" in out, out
