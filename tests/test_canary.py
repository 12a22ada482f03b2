"""The canary's logic against a tiny stdlib OpenAI-compatible server on loopback (the real
server is tests/vllm/test_canary.py): bad input and unusable servers exit 2 with a clear
message, the comparison, tolerance, audit and rate limit behave as documented, and the
replay proxy forwards bytes unchanged."""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sidecar import signals as S
from sidecar.canary.audit import MetricsAudit, audit_pair, counter_sum
from sidecar.canary.client import Completion, OpenAIClient
from sidecar.canary.compare import Tolerance, divergence
from sidecar.canary.endpoint import CanaryError, parse_endpoint
from sidecar.canary.load import RateLimit
from sidecar.canary.probes import PairResult, boundary_lengths, expected_cached
from sidecar.canary.replay import ReplayProxy
from sidecar.canary.runner import CanaryConfig, make_canary
from sidecar.cli.main import main

BLOCK = 4


class FakeServer:
    """An honest little prefix cache behind /v1/completions: cached tokens are the longest
    stored run of whole blocks (never the last prompt token), keyed by ``cache_salt``.
    Logprobs are a function of the prompt, so a hit and a miss answer alike unless
    ``corrupt`` shifts the answers that were served from the cache."""

    def __init__(self, logprobs: bool = True, salt: bool = True, corrupt: bool = False,
                 doctor: bool = False, metrics: bool = True) -> None:
        self.logprobs, self.salt, self.corrupt = logprobs, salt, corrupt
        self.doctor, self.metrics = doctor, metrics
        self.cache: set[tuple[Any, ...]] = set()
        self.hits = 0
        self.stuck_hits: int | None = None  # /metrics reports this hit count, if set
        self.fail_after: int | None = None  # completions answer HTTP 500 after this many
        self.requests = 0
        self.bodies: list[dict[str, Any]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """Chat on the same cache: the messages' characters are the prompt's tokens."""
        text = "".join(str(m.get("content", "")) for m in body["messages"])
        answer = self.complete({**body, "prompt": [ord(c) for c in text],
                                "logprobs": body.get("top_logprobs", 1)})
        choice = answer["choices"][0]
        lp = choice.pop("logprobs", None)
        choice["message"] = {"role": "assistant", "content": choice.pop("text")}
        if lp is not None and body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": tok, "logprob": top[tok],
                 "top_logprobs": [{"token": k, "logprob": v} for k, v in top.items()]}
                for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)]}
        return answer

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        prompt = list(body["prompt"])
        salt = body.get("cache_salt") if self.salt else None
        cached = 0
        for n in range(BLOCK, len(prompt), BLOCK):
            if (salt, *prompt[:n]) in self.cache:
                cached = n
        for n in range(BLOCK, len(prompt) + 1, BLOCK):
            self.cache.add((salt, *prompt[:n]))
        self.hits += cached
        self.requests += 1
        shift = 0.5 if self.corrupt and cached else 0.0
        tops = [{f"token_id:{(sum(prompt) + i + j) % 50}": -1.0 - j - 0.01 * i + shift
                 for j in range(body["logprobs"])} for i in range(body["max_tokens"])]
        reported = len(prompt) - 1 if self.doctor else cached
        choice: dict[str, Any] = {"text": "x" * body["max_tokens"], "index": 0}
        if self.logprobs:
            choice["logprobs"] = {"tokens": [next(iter(t)) for t in tops],
                                  "top_logprobs": tops}
        return {"choices": [choice], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": reported}}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall per answer

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, b'{"data": [{"id": "fake"}]}')
                elif self.path == "/metrics" and fake.metrics:
                    hits = fake.hits if fake.stuck_hits is None else fake.stuck_hits
                    text = (f'vllm:prefix_cache_hits_total{{model_name="fake"}} {hits}\n'
                            f'vllm:request_success_total{{model_name="fake"}} '
                            f'{fake.requests}\n')
                    self._send(200, text.encode(), "text/plain")
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if fake.fail_after is not None and fake.requests >= fake.fail_after:
                    self._send(500, b'{"error": "engine dead"}')
                    return
                answer = fake.chat(body) if self.path.endswith("/chat/completions") \
                    else fake.complete(body)
                self._send(200, json.dumps(answer).encode())

            def log_message(self, fmt: str, *args: Any) -> None:
                return None

        return Handler

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _cli(*args: str) -> tuple[int, str]:
    """Exit code and stdout; errors (stderr) are appended so messages can be asserted."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["canary", *args])
    if rc == 2:
        return rc, err.getvalue() + out.getvalue()
    return rc, out.getvalue()


def _fast(endpoint: str, *extra: str) -> tuple[int, str]:
    return _cli("--endpoint", endpoint, "--block-size", str(BLOCK), "--dtype", "float32",
                "--min-rate", "1000", "--max-rate", "1000", "--calibration", "3", *extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def test_bad_token_range_exits_2() -> None:
    rc, out = _fast("http://127.0.0.1:1/v1", "--token-range", "9:3")
    assert rc == 2 and "--token-range" in out


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


# ---------------------------------------------------------------- pieces
def _c(tops: list[dict[str, float]], cached: int | None = 0) -> Completion:
    return Completion([max(t, key=t.__getitem__) for t in tops], tops, 9, cached, 0.01)


def test_divergence_bounds_missing_tokens_and_stops_at_a_different_token() -> None:
    a = _c([{"x": -1.0, "y": -2.0}, {"p": -0.5, "q": -3.0}, {"z": -0.1}])
    b = _c([{"x": -1.0, "w": -2.5}, {"q": -0.4, "p": -3.0}, {"z": -9.0}])
    d = divergence(a, b)
    # pos 0: y missing in b -> at least -2.0 - (-2.5) = 0.5; pos 1: tokens differ, |q| 2.6;
    # pos 2 is never compared (a different text follows).
    assert d.value == pytest.approx(2.6) and d.position == 1
    assert d.token_diverged_at == 1 and d.compared == 2


def test_tolerance_floor_ceiling_and_calibration() -> None:
    t = Tolerance("float32", calibration=2)
    assert t.value == t.ceiling  # pair mode: nothing trusted yet
    t.learn(1.0)  # above the ceiling: an anomaly, never noise
    assert t.noise == []
    t.learn(1e-6)
    t.learn(2e-5)
    assert t.calibrated and t.value == pytest.approx(2e-4)  # 10 x noise
    t.learn(5e-3)  # calibrated: ignored
    assert t.value == pytest.approx(2e-4)
    s = Tolerance("bfloat16", calibration=8, trusted=True)
    s.learn(0.0)
    assert s.value == s.floor == S.CANARY_THRESHOLDS.floor_for("bfloat16")


def test_pair_audit_kinds() -> None:
    hit = _c([{"a": -1.0}], cached=8)  # 9 tokens, block 4: the repeat hits 8
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), hit), 4).mismatches == ()
    assert audit_pair(PairResult(9, _c([{"a": -1.0}], 4), hit), 4).mismatches == (
        S.AuditKind.PHANTOM_HIT,)
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), _c([{"a": -1.0}], 9)), 4
                      ).mismatches == (S.AuditKind.OVER_REPORTED,)
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), _c([{"a": -1.0}], 0)), 4
                      ).mismatches == (S.AuditKind.UNDER_REPORTED,)
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), _c([{"a": -1.0}], None)), 4
                      ).mismatches == ()


def test_metrics_audit_compares_one_tick_late() -> None:
    a = MetricsAudit()
    assert not a.tick(100.0)
    a.add_proven(32)
    assert not a.tick(100.0)  # the counter may trail the answers by one tick
    assert a.tick(100.0)  # still short one tick later: a mismatch
    assert not a.tick(140.0)
    assert not a.tick(None)
    assert counter_sum('# HELP x\nvllm:prefix_cache_hits_total{a="1"} 3\n'
                       'vllm:prefix_cache_hits_total{a="2"} 4.0\n') == 7.0
    assert counter_sum("other 1\n") is None


def test_rate_limit_is_a_fraction_of_the_server_load_minus_its_own() -> None:
    now = [0.0]
    r = RateLimit(fraction=0.1, min_rate=0.5, max_rate=5.0, clock=lambda: now[0])
    assert r.allowed_rate == 5.0  # no server metrics yet: the fixed maximum
    r.observe_server("vllm:request_success_total 100\n")
    now[0] = 10.0
    r.sent(20)
    r.observe_server("vllm:request_success_total 420\n")  # 300 others in 10 s
    assert r.server_rate == pytest.approx(30.0) and r.allowed_rate == pytest.approx(3.0)
    assert r.pause_for(3) == pytest.approx(1.0)
    now[0] = 20.0
    r.observe_server("vllm:request_success_total 421\n")
    assert r.allowed_rate == 0.5  # idle server: the floor
    r.observe_server(None)
    assert r.allowed_rate == 5.0


# ---------------------------------------------------------------- replay proxy
@pytest.fixture
def proxied() -> Iterator[tuple[FakeServer, ReplayProxy]]:
    with FakeServer() as fake:
        client = OpenAIClient(parse_endpoint(fake.endpoint))
        canary = make_canary(client, CanaryConfig(dtype="float32", block_size=BLOCK))
        proxy = ReplayProxy(client, canary.exporter, canary.tolerance, every=2).start()
        try:
            yield fake, proxy
        finally:
            proxy.stop()


def test_replay_proxy_forwards_unchanged_and_replays_one_in_n(
        proxied: tuple[FakeServer, ReplayProxy]) -> None:
    fake, proxy = proxied
    for i in range(4):
        body = json.dumps({"model": "fake", "prompt": list(range(i, i + 9)),
                           "max_tokens": 2, "logprobs": 1}).encode()
        req = urllib.request.Request(proxy.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        via = urllib.request.urlopen(req, timeout=10).read()
        assert json.loads(via)["usage"]["prompt_tokens"] == 9
    models = urllib.request.urlopen(proxy.url + "/v1/models", timeout=10).read()
    assert models == b'{"data": [{"id": "fake"}]}'
    proxy.drain()
    assert proxy.stats["forwarded"] == 5 and proxy.stats["replayed"] == 2
    assert proxy.stats["anomalies"] == 0
    replays = [b for b in fake.bodies if b.get("cache_salt", "").startswith("kvsidecar-replay")]
    assert len(replays) == 2 and all(b["temperature"] == 0.0 for b in replays)


def test_replay_proxy_replays_chat_and_catches_a_corrupted_cache(
        proxied: tuple[FakeServer, ReplayProxy]) -> None:
    fake, proxy = proxied

    def chat(text: str) -> dict[str, Any]:
        body = json.dumps({"model": "fake", "max_tokens": 2, "temperature": 0.7,
                           "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": text}]}).encode()
        req = urllib.request.Request(proxy.url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=10).read())

    for text in ("hello there", "general kenobi"):
        assert chat(text)["choices"][0]["message"]["role"] == "assistant"
    proxy.drain()
    assert proxy.stats["replayed"] == 1 and proxy.stats["anomalies"] == 0
    fake.corrupt = True
    for text in ("what is a kv cache", "and a prefix hit"):
        chat(text)
    proxy.drain()
    assert proxy.stats["replayed"] == 2 and proxy.stats["anomalies"] == 1
    replays = [b for b in fake.bodies if b.get("cache_salt", "").startswith("kvsidecar-replay")]
    assert all(b["temperature"] == 0.0 and b["top_logprobs"] == 5 for b in replays)


def test_replay_proxy_refused_where_cache_salt_is_ignored() -> None:
    with FakeServer(salt=False) as fake:
        rc, out = _fast(fake.endpoint, "--pairs", "1", "--replay-port", "0")
    assert rc == 2 and "cache_salt" in out, out


def test_a_restarted_canary_sends_fresh_prompts() -> None:
    with FakeServer() as fake:
        runs = [json.loads(_fast(fake.endpoint, "--pairs", "3", "--json")[1])
                for _ in range(2)]
        seeded = [json.loads(_fast(fake.endpoint, "--pairs", "3", "--json", "--seed", "5")[1])
                  for _ in range(2)]
    assert runs[0]["audit"] == runs[1]["audit"] == {} == seeded[0]["audit"]
    # The same seed on a server that cached the first run: its "misses" are real hits.
    assert seeded[1]["audit"].get("phantom_hit", 0) >= 1


def test_hit_counter_alert_fires_on_lies_only() -> None:
    rules = (Path(__file__).resolve().parents[1] / "alerts" / "kv-sidecar.rules.yml").read_text()
    alert = rules.split("alert: KVCacheHitCounterMismatch")[1]
    alarm = re.search(r'kind=~"([^"]+)"', alert)
    assert alarm and alarm.group(1).split("|") == [k.value for k in S.AUDIT_ALARM_KINDS]
    assert S.AuditKind.UNDER_REPORTED.value not in alarm.group(1).split("|")  # evictions


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
