"""The cache-bypass guard (sidecar/protect/) against the canary tests' honest little
OpenAI server: the breaker's states, what opens it (a local verdict, a sidecar's /status,
an Alertmanager webhook, an operator), what it does to requests, and its signals."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient
from sidecar.canary.endpoint import parse_endpoint
from sidecar.canary.replay import ReplayVerifier
from sidecar.canary.runner import CanaryConfig, make_canary
from sidecar.cli.main import main
from sidecar.protect.breaker import BreakerSettings, BypassBreaker, Route, Source, State
from sidecar.protect.bypass_guard import SALT_PREFIX, BypassGuard, GuardConfig, pages_for
from tests.canary_fake import BLOCK, FakeServer

TOKEN = "s3cret-token"


# ---------------------------------------------------------------- the breaker alone
def test_breaker_opens_on_one_anomaly_probes_after_the_hold_and_closes_after_m() -> None:
    now = [0.0]
    b = BypassBreaker(BreakerSettings(hold_s=10, probes=3, probe_every=2), clock=lambda: now[0])
    assert b.route() is Route.FORWARDED
    b.clean(Source.LOCAL, 5)  # clean verdicts while closed change nothing
    b.anomaly(Source.LOCAL)
    assert b.state is State.OPEN and {b.route() for _ in range(6)} == {Route.BYPASSED}
    now[0] = 9.9
    assert b.current() is State.OPEN
    now[0] = 10.0
    routes = [b.route() for _ in range(6)]
    assert b.state is State.HALF_OPEN
    assert routes.count(Route.PROBE) == 3 and routes.count(Route.BYPASSED) == 3
    b.clean(Source.LOCAL, 2)
    b.anomaly(Source.SIDECAR)  # an anomaly among the probes: open again, count restarts
    assert b.state is State.OPEN and b.clean_probes == 0
    now[0] = 20.0
    b.clean(Source.LOCAL, 2)
    assert b.state is State.HALF_OPEN and b.clean_probes == 2
    b.clean(Source.LOCAL)
    assert b.state is State.CLOSED
    assert [(a.value, t.value, s.value) for a, t, s in b.transitions] == [
        ("closed", "open", "local"), ("open", "half_open", "timer"),
        ("half_open", "open", "sidecar"), ("open", "half_open", "timer"),
        ("half_open", "closed", "probes")]



def test_breaker_reopens_after_k_probes_without_a_verdict() -> None:
    now = [0.0]
    b = BypassBreaker(BreakerSettings(hold_s=1, probes=2, probe_every=1, probe_errors=3),
                      clock=lambda: now[0])
    b.probe_failed()  # closed: nothing to reopen
    b.anomaly(Source.OPERATOR)
    now[0] = 1.0
    assert b.current() is State.HALF_OPEN
    b.probe_failed()
    b.clean(Source.LOCAL)
    b.probe_failed()
    assert b.state is State.HALF_OPEN
    b.probe_failed()
    assert b.state is State.OPEN and b.transitions[-1][2] is Source.PROBE_ERRORS
    assert b.current() is State.OPEN  # a fresh hold
    now[0] = 2.0
    assert b.current() is State.HALF_OPEN


@pytest.mark.parametrize("upstream", ["http_500", "no_logprobs"])
def test_probes_the_upstream_fails_reopen_it_instead_of_half_open_for_ever(
        upstream: str) -> None:
    with FakeServer() as fake, guarded(fake, verify_every=0, breaker=BreakerSettings(
            hold_s=3600, probes=2, probe_every=1, probe_errors=2)) as guard:
        guard.breaker.force(State.HALF_OPEN)
        if upstream == "http_500":
            fake.fail_after = fake.requests
        else:
            fake.logprobs = False
        for i in range(2):
            with contextlib.suppress(urllib.error.HTTPError):
                _complete(guard, _prompt(i))
        assert guard.verifier is not None
        guard.verifier.drain()
        # A probe's error is counted after its answer reached the client: wait for it.
        deadline = time.monotonic() + 60
        while guard.breaker.state is not State.OPEN and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.breaker.state is State.OPEN
        assert _metric(guard, S.GUARD_TRANSITIONS, to="open", source="probe_errors") == 1


@pytest.mark.parametrize("bad", [dict(hold_s=float("nan")), dict(hold_s=float("inf")),
                                 dict(hold_s=0), dict(probes=0), dict(probe_every=10**6)])
def test_breaker_settings_are_finite_and_bounded(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BreakerSettings(**bad)


def test_alertmanager_pages_match_this_instance_or_the_fleet_of_its_model() -> None:
    def alert(name: str, status: str = "firing", **labels: str) -> dict[str, Any]:
        return {"status": status, "labels": {"alertname": name, **labels}}

    payload = {"alerts": [alert("KVCacheContentAnomaly", instance="other:9400"),
                          alert("KVCacheContentAnomaly", "resolved", instance="me:9400"),
                          alert("KVCacheHitRateLow", instance="me:9400")]}
    assert pages_for(payload, "me:9400", "tiny") == []
    payload["alerts"].append(alert("KVCacheContentAnomaly", instance="me:9400"))
    assert pages_for(payload, "me:9400", "tiny") == ["KVCacheContentAnomaly"]
    fleet = {"alerts": [alert("KVCacheAnomalyFleetWide", model="tiny")]}
    assert pages_for(fleet, "me:9400", "tiny") == ["KVCacheAnomalyFleetWide"]
    assert pages_for(fleet, "me:9400", "other-model") == []
    for bad in ([], {"alerts": "x"}, "x", None):
        with pytest.raises(ValueError):
            pages_for(bad, "me:9400", "tiny")



def test_a_localised_page_for_this_instance_opens_it() -> None:
    # The shipped Alertmanager inhibits the per-replica pages under Localised: it is the
    # only page a lone faulty replica sends, so it must open that replica's guard.
    page = {"alerts": [{"status": "firing", "labels": {
        "alertname": S.ALERT_ANOMALY_LOCALISED, "instance": "me:9400"}}]}
    assert pages_for(page, "me:9400", "tiny") == [S.ALERT_ANOMALY_LOCALISED]
    assert pages_for(page, "other:9400", "tiny") == []
    from alerts.fleet import LOCALISED, PER_REPLICA_PAGES
    assert LOCALISED == S.ALERT_ANOMALY_LOCALISED
    assert S.ALERT_CONTENT_ANOMALY in PER_REPLICA_PAGES


@pytest.mark.parametrize("labels", [{"alertname": ["KVCacheContentAnomaly"]},
                                    {"alertname": "KVCacheContentAnomaly", "instance": 1},
                                    {"alertname": {"a": 1}, "instance": "me:9400"}])
def test_non_string_label_values_are_a_malformed_payload(labels: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="labels"):
        pages_for({"alerts": [{"status": "firing", "labels": labels}]}, "me:9400", "tiny")


# ---------------------------------------------------------------- the guard in front
@contextlib.contextmanager
def guarded(fake: FakeServer, **cfg: Any) -> Iterator[BypassGuard]:
    client = OpenAIClient(parse_endpoint(fake.endpoint))
    canary = make_canary(client, CanaryConfig(dtype="float32", block_size=BLOCK))

    def verifier(on_verdict: Any) -> ReplayVerifier:
        return ReplayVerifier(client, canary.exporter, canary.tolerance, on_verdict=on_verdict)

    cfg.setdefault("breaker", BreakerSettings(hold_s=3600, probes=3, probe_every=1))
    guard = BypassGuard(GuardConfig(upstream=("127.0.0.1", fake.port), model="fake", **cfg),
                        verifier, bypass_supported=fake.salt).start()
    try:
        yield guard
    finally:
        guard.stop()


def _complete(guard: BypassGuard, prompt: list[int]) -> dict[str, Any]:
    body = json.dumps({"model": "fake", "prompt": prompt, "max_tokens": 2,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(guard.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    return dict(json.loads(urllib.request.urlopen(req, timeout=30).read()))


def _guard_post(guard: BypassGuard, path: str, body: Any = None,
                token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(guard.url + path, data, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def _metric(guard: BypassGuard, sig: S.Signal, **labels: str) -> float:
    return float(guard.metrics.value(sig.name, **labels))


def _replayed(guard: BypassGuard, n: int) -> None:
    """Wait until ``n`` replays completed (a replay is queued after the user's answer)."""
    v = guard.verifier
    assert v is not None
    ev = threading.Event()
    for _ in range(600):
        if v.stats["replayed"] >= n:
            return
        ev.wait(0.05)
    raise AssertionError(f"{n} replays never completed: {v.stats}")


def _prompt(i: int) -> list[int]:
    return [7] * (2 * BLOCK) + [i, i + 1, i + 2]  # a shared 2-block prefix, a fresh tail


def test_closed_forwards_unchanged_and_one_sampled_anomaly_opens_it() -> None:
    with FakeServer() as fake, guarded(fake, verify_every=2) as guard:
        for i in range(4):
            _complete(guard, _prompt(i))
        _replayed(guard, 2)
        users = [b for b in fake.bodies if b.get("max_tokens") == 2 and "top_logprobs" not in b
                 and "cache_salt" not in b]
        assert len(users) == 4  # every user request went as sent
        assert guard.breaker.state is State.CLOSED
        assert guard.verifier.stats["replayed"] == 2  # type: ignore[union-attr]
        fake.corrupt = True  # the server's cache now serves wrong answers
        _complete(guard, _prompt(10))
        _complete(guard, _prompt(11))  # the 6th request: sampled
        _replayed(guard, 3)
        assert guard.verifier.stats["anomalies"] == 1  # type: ignore[union-attr]
        assert guard.breaker.state is State.OPEN  # within 1 sampled anomaly
        hits_before, n = fake.hits, len(fake.bodies)
        for i in range(20, 25):
            _complete(guard, _prompt(i))
        salted = fake.bodies[n:n + 5]
        assert all(b["cache_salt"].startswith(SALT_PREFIX) for b in salted)
        assert len({b["cache_salt"] for b in salted}) == 5  # a fresh salt every request
        assert fake.hits == hits_before  # no request was served from the cache
        assert _metric(guard, S.GUARD_REQUESTS, route="bypassed") == 5
        assert _metric(guard, S.GUARD_REQUESTS, route="forwarded") == 6
        assert _metric(guard, S.GUARD_STATE, state="open") == 1
        assert _metric(guard, S.GUARD_STATE, state="closed") == 0
        assert _metric(guard, S.GUARD_TRANSITIONS, to="open", source="local") == 1


def test_half_open_probes_close_it_after_m_clean_verdicts() -> None:
    with FakeServer() as fake, guarded(fake, verify_every=0, token=TOKEN) as guard:
        assert _guard_post(guard, "/guard/open")[0] == 200
        assert guard.breaker.state is State.OPEN
        status, body = _guard_post(guard, "/guard/half-open")
        assert status == 200 and body["state"] == "half_open"
        for i in range(3):  # probe_every=1: every request is a probe, each one verified
            _complete(guard, _prompt(30 + i))
            _replayed(guard, i + 1)
        assert guard.breaker.state is State.CLOSED
        assert _metric(guard, S.GUARD_REQUESTS, route="probe") == 3
        assert _metric(guard, S.GUARD_TRANSITIONS, to="closed", source="probes") == 1
        assert _metric(guard, S.GUARD_TRANSITIONS, to="open", source="operator") == 1


def test_operator_and_webhook_need_the_token_and_a_page_for_this_instance_opens_it() -> None:
    page = {"alerts": [{"status": "firing", "labels": {"alertname": "KVCacheContentAnomaly",
                                                       "instance": "me:9400"}}]}
    with FakeServer() as fake, guarded(fake, verify_every=0, token=TOKEN,
                                       instance="me:9400") as guard:
        assert _guard_post(guard, "/guard/open", token=None)[0] == 401
        assert _guard_post(guard, "/guard/open", token="wrong")[0] == 401
        assert _guard_post(guard, "/guard/alertmanager", page, token=None)[0] == 401
        assert guard.breaker.state is State.CLOSED
        other = {"alerts": [{**page["alerts"][0], "labels": {
            "alertname": "KVCacheContentAnomaly", "instance": "else:9400"}}]}
        assert _guard_post(guard, "/guard/alertmanager", other) == (
            200, {"opened": False, "alerts": []})
        assert _guard_post(guard, "/guard/alertmanager", "not a payload")[0] == 400
        listed = {"alerts": [{"status": "firing",
                              "labels": {"alertname": ["KVCacheContentAnomaly"]}}]}
        assert _guard_post(guard, "/guard/alertmanager", listed)[0] == 400
        localised = {"alerts": [{"status": "firing", "labels": {
            "alertname": S.ALERT_ANOMALY_LOCALISED, "instance": "me:9400"}}]}
        assert _guard_post(guard, "/guard/alertmanager", localised)[1]["opened"] is True
        assert _guard_post(guard, "/guard/close")[1]["state"] == "closed"
        assert _guard_post(guard, "/guard/alertmanager", page)[0] == 200
        assert guard.breaker.state is State.OPEN
        assert _metric(guard, S.GUARD_TRANSITIONS, to="open", source="webhook") == 2
        assert _guard_post(guard, "/guard/close")[1]["state"] == "closed"
        with urllib.request.urlopen(urllib.request.Request(
                guard.url + "/guard/status", headers={"Authorization": f"Bearer {TOKEN}"}),
                timeout=30) as r:
            status = json.loads(r.read())
        assert status["state"] == "closed" and status["bypass_supported"] is True
        _complete(guard, _prompt(1))  # the guard's own paths never reach the server
        assert all("alerts" not in b for b in fake.bodies)


class StatusServer:
    """A kv-sidecar /status stand-in whose counters the test moves."""

    def __init__(self) -> None:
        self.counts = {"anomalies": 0, "verified": 0}
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(outer.counts).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/status"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_sidecars_status_opens_it_and_its_clean_verdicts_close_it() -> None:
    st = StatusServer()
    try:
        st.counts.update(anomalies=4, verified=100)  # before the guard: not its business
        with FakeServer() as fake, guarded(fake, verify_every=0, sidecar_status=st.url,
                                           poll_every_s=3600) as guard:
            guard.poll_status()
            assert guard.breaker.state is State.CLOSED
            st.counts.update(anomalies=5, verified=101)
            guard.poll_status()
            assert guard.breaker.state is State.OPEN
            guard.breaker.force(State.HALF_OPEN)
            st.counts.update(verified=103)
            guard.poll_status()
            assert guard.breaker.state is State.HALF_OPEN and guard.breaker.clean_probes == 2
            st.counts.update(verified=104)
            guard.poll_status()
            assert guard.breaker.state is State.CLOSED
            assert _metric(guard, S.GUARD_TRANSITIONS, to="open", source="sidecar") == 1
    finally:
        st.close()


def test_a_server_that_ignores_cache_salt_is_only_alerted_on() -> None:
    with FakeServer(salt=False) as fake, guarded(fake, verify_every=0) as guard:
        guard.breaker.force(State.OPEN)
        _complete(guard, _prompt(1))
        assert "cache_salt" not in fake.bodies[-1]
        assert _metric(guard, S.GUARD_REQUESTS, route="unprotected") == 1
        assert _metric(guard, S.GUARD_BYPASS_SUPPORTED) == 0


def test_cli_says_at_start_when_the_server_ignores_cache_salt() -> None:
    err, out = io.StringIO(), io.StringIO()
    with FakeServer(salt=False) as fake, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(out):
        rc = main(["guard", "--upstream", f"http://127.0.0.1:{fake.port}", "--listen",
                   "127.0.0.1:0", "--metrics-port", "0", "--dtype", "float32",
                   "--block-size", str(BLOCK), "--calibration", "2", "--duration", "0.01"])
    assert rc == 0, err.getvalue()
    assert "ignores cache_salt" in err.getvalue() and "only alert" in err.getvalue()
    assert json.loads(out.getvalue())["bypass_supported"] is False


@pytest.mark.parametrize("flags", [["--hold", "nan"], ["--hold", "inf"], ["--probes", "0"],
                                   ["--listen", "nohost"], ["--max-body-bytes", "-1"]])
def test_cli_refuses_bad_values(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["guard", "--upstream", "http://127.0.0.1:1", *flags])
    assert exc.value.code == 2


def test_cli_refuses_a_public_listen_address_without_a_token(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVSIDECAR_TOKEN", raising=False)
    rc = main(["guard", "--upstream", "http://127.0.0.1:1", "--listen", "0.0.0.0:0"])
    assert rc == 2 and "token" in capsys.readouterr().err


def test_bench_perf_guard_measures_both_paths_side_by_side() -> None:
    """`bench perf --guard --quick`: the figures exist and are measured, not asserted."""
    from kvtestbed.bench.perf_guard import guard_rows

    raw: dict[str, Any] = {}
    rows = guard_rows(quick=True, repeats=1, raw=raw)
    assert [r.figure.split(":")[0] for r in rows] == ["guard closed"] * 3
    assert all(r.sidecar > 0 and r.baseline > 0 for r in rows)
    assert len(raw["guard"]["pair_ratios"]) == 2 and rows[0].met is not None


def test_config_check_knows_the_guard_section(tmp_path: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('[guard]\nupstream = "http://127.0.0.1:8000"\nhold = 30.0\nprobes = 3\n')
    bad.write_text('[guard]\nhold = inf\nworkers = 0\n')
    assert main(["config", "check", str(good)]) == 0
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "guard.hold" in err and "guard.workers" in err


@pytest.mark.parametrize("token", ["t\u00f6k\u00e9n\u2713", "x" * 100_000])
def test_cli_refuses_a_token_no_client_could_send(
        token: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSIDECAR_TOKEN", token)
    assert main(["guard", "--upstream", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-sidecar guard: error: $KVSIDECAR_TOKEN") and err.count("\n") == 1


def test_cli_names_the_guard_when_the_upstream_is_remote(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVSIDECAR_TOKEN", raising=False)
    assert main(["guard", "--upstream", "http://192.0.2.1:8000"]) == 2
    err = capsys.readouterr().err
    assert "the guard forwards" in err and "canary" not in err and "--allow-remote" in err
