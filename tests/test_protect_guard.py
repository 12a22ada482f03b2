"""The cache-bypass guard (sidecar/protect/) against the canary tests' honest little
OpenAI server: the breaker's states, what opens it (a local verdict, a sidecar's /status,
an Alertmanager webhook, an operator), what it does to requests, and its signals. The
breaker alone: tests/test_protect_breaker.py; the command line: test_protect_guard_cli.py."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar import signals as S
from sidecar.canary.client import OpenAIClient
from sidecar.canary.endpoint import parse_endpoint
from sidecar.canary.replay import ReplayVerifier
from sidecar.canary.runner import CanaryConfig, make_canary
from sidecar.protect.breaker import BreakerSettings, State
from sidecar.protect.bypass_guard import SALT_PREFIX, BypassGuard, GuardConfig
from tests.canary_fake import BLOCK, FakeServer
from tests.stub_http import StubHandler, StubServer

TOKEN = "s3cret-token"


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
                token: str | None = TOKEN, scheme: str = "Bearer") -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"Authorization": f"{scheme} {token}"} if token else {}
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
        # the metrics server's one check (RFC 6750: the scheme is case-insensitive; an outside
        # check found lowercase "bearer" refused here alone)
        assert _guard_post(guard, "/guard/open", token=TOKEN, scheme="Basic")[0] == 401
        assert _guard_post(guard, "/guard/open", token=f"{TOKEN} x")[0] == 401
        assert _guard_post(guard, "/guard/close", token=TOKEN, scheme="bearer")[0] == 200
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


class RealStatus:
    """A real kv-sidecar's ``/status`` (a Monitor's summary served by the sidecar's own
    server), whose counters the test moves through the Monitor's metrics: the shape the
    guard reads is the one sidecars serve (a stand-in with a bare anomaly count once hid
    that the guard could not read a real one)."""

    def __enter__(self) -> RealStatus:
        from kvtestbed.bench.perf_hooks import monitor_for

        from sidecar.export.server import SidecarServer

        self.monitor = monitor_for(1000)
        self.server = SidecarServer(self.monitor.metrics.registry, self.monitor.summary).start()
        self.status_url = self.server.url + "/status"
        return self

    def anomaly(self, kind: str, n: int = 1) -> None:
        self.monitor.metrics.inc(S.ANOMALIES, n, group="0", kind=kind)

    def verified(self, n: int) -> None:
        self.monitor.metrics.inc(S.VERIFIED, n, group="0")

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


class FixedBody(StubServer):
    """Answers every GET with ``body``: a /status that is not a kv-sidecar's."""

    def __init__(self, body: bytes) -> None:
        class H(StubHandler):
            def do_GET(self) -> None:
                self.reply(200, body)

        super().__init__(H)


def test_a_sidecars_status_opens_it_and_its_clean_verdicts_close_it() -> None:
    with RealStatus() as st:
        st.anomaly("zeros", 4)  # before the guard: not its business
        st.verified(100)
        with FakeServer() as fake, guarded(fake, verify_every=0, sidecar_status=st.status_url,
                                           poll_every_s=3600) as guard:
            guard.poll_status()
            assert guard.breaker.state is State.CLOSED
            st.anomaly("recompute_mismatch")  # another kind: the total counts
            st.verified(1)
            guard.poll_status()
            assert guard.breaker.state is State.OPEN
            guard.breaker.force(State.HALF_OPEN)
            st.verified(2)
            guard.poll_status()
            assert guard.breaker.state is State.HALF_OPEN and guard.breaker.clean_probes == 2
            st.verified(1)
            guard.poll_status()
            assert guard.breaker.state is State.CLOSED
            assert _metric(guard, S.GUARD_TRANSITIONS, to="open", source="sidecar") == 1
            assert _metric(guard, S.GUARD_STATUS_FAILURES) == 0


@pytest.mark.parametrize("body", [
    {"anomalies": 3, "verified": 1},  # a bare count: not what a sidecar serves
    {"anomalies": {"zeros": "2"}, "verified": 1},
    {"anomalies": {"zeros": -1}, "verified": 1},
    {"anomalies": {}, "verified": 1.5},
    {"verified": 1},
    [1, 2],
])
def test_a_status_that_is_not_a_sidecars_is_counted_and_changes_nothing(body) -> None:
    with FixedBody(json.dumps(body).encode()) as st, FakeServer() as fake, \
            guarded(fake, verify_every=0, sidecar_status=st.url + "/status",
                    poll_every_s=3600) as guard:
        before = _metric(guard, S.GUARD_STATUS_FAILURES)  # the poller's first read, if done
        guard.poll_status()
        guard.poll_status()
        assert guard.breaker.state is State.CLOSED
        assert _metric(guard, S.GUARD_STATUS_FAILURES) == before + 2


def test_a_server_that_ignores_cache_salt_is_only_alerted_on() -> None:
    with FakeServer(salt=False) as fake, guarded(fake, verify_every=0) as guard:
        guard.breaker.force(State.OPEN)
        _complete(guard, _prompt(1))
        assert "cache_salt" not in fake.bodies[-1]
        assert _metric(guard, S.GUARD_REQUESTS, route="unprotected") == 1
        assert _metric(guard, S.GUARD_BYPASS_SUPPORTED) == 0


