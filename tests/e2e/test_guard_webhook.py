"""The guard's webhook mode with a real Alertmanager (short: no Prometheus, the alert is
posted to Alertmanager's API as Prometheus would after the rule's ``for:``).

Alertmanager runs the example config (alerts/alertmanager.yml) with one more webhook on the
pager receiver: the guard's ``/guard/alertmanager``, with the guard's bearer token in its
``http_config``. A page for another instance leaves the guard closed; the page for its own
instance opens it; a fleet-wide page for its model opens a second guard of that model.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sidecar.protect.breaker import BreakerSettings, State
from sidecar.protect.bypass_guard import BypassGuard, GuardConfig
from tests.canary_fake import FakeServer
from tests.e2e.test_fleet import stack_mod
from tests.promtools import require

pytestmark = pytest.mark.e2e
TOKEN = "am-guard-token"


def _guard(fake: FakeServer, instance: str) -> BypassGuard:
    return BypassGuard(GuardConfig(upstream=("127.0.0.1", fake.port), model="fake",
                                   instance=instance, verify_every=0, token=TOKEN,
                                   breaker=BreakerSettings(hold_s=3600))).start()


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[tuple[str, list[BypassGuard]]]:
    am_bin = require("prometheus-alertmanager", "alertmanager")
    with FakeServer() as fake:
        guards = [_guard(fake, "replica-a:9400"), _guard(fake, "replica-b:9400")]
        webhook = stack_mod.WebhookReceiver()
        cfg = stack_mod.alertmanager_config(webhook.url, "1s", "2s")
        pager = next(r for r in cfg["receivers"] if r["name"] == "pager")
        for g in guards:
            pager["webhook_configs"].append({
                "url": g.url + "/guard/alertmanager", "send_resolved": True,
                "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}}})
        port = stack_mod.free_port()
        procs: list[Any] = []
        try:
            with stack_mod.stopping(procs):
                procs.append(stack_mod.alertmanager_process(tmp_path, am_bin, port,
                                                            cfg).start())
                stack_mod.wait_http(f"http://127.0.0.1:{port}/-/ready", 60, procs[0])
                yield f"http://127.0.0.1:{port}", guards
        finally:
            for g in guards:
                g.stop()
            webhook.stop()


def _fire(am: str, alertname: str, **labels: str) -> float:
    alert = [{"labels": {"alertname": alertname, "severity": "page", "job": "kv-sidecar",
                         "engine": "vllm", "model": "fake", **labels},
              "annotations": {"summary": "test"},
              "startsAt": datetime.now(UTC).isoformat()}]
    req = urllib.request.Request(f"{am}/api/v2/alerts", json.dumps(alert).encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()
    return time.monotonic()


def _wait_open(guard: BypassGuard, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while guard.breaker.current() is not State.OPEN:
        assert time.monotonic() < deadline, "the page never opened the guard"
        time.sleep(0.05)


def test_a_page_for_this_instance_opens_its_guard_and_a_fleet_page_opens_all(
        alertmanager: tuple[str, list[BypassGuard]]) -> None:
    am, (a, b) = alertmanager
    _fire(am, "KVCacheContentAnomaly", instance="replica-z:9400")  # someone else's page
    sent = _fire(am, "KVCacheContentAnomaly", instance="replica-a:9400")
    _wait_open(a)
    print(f"guard: Alertmanager page to guard open (group_wait 1s): "
          f"{time.monotonic() - sent:.2f} s")  # shown with -rA
    assert a.metrics.value("kvsidecar_guard_transitions_total", to="open",
                           source="webhook") == 1
    assert b.breaker.current() is State.CLOSED  # another instance's page: not b's
    _fire(am, "KVCacheAnomalyFleetWide", group="0", kind="zeros")
    _wait_open(b)
    assert a.server.rejected.get(401) is None  # Alertmanager sent the bearer token
