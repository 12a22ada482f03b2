"""End to end with the real programs: two kv-sidecar demos (one with a fault, one clean),
Prometheus scraping both and evaluating the shipped rules, Alertmanager routing with the
shipped config to a webhook "pager" on loopback.

Checks: the fault pages (delivered to the pager webhook, with the right labels and
annotations); the clean instance pages nobody; every rule evaluates without error; every
dashboard panel query returns data from this live Prometheus; Alertmanager inhibits a
warning while a page fires for the same instance.

Everything listens on 127.0.0.1 on free ports and is stopped by PID. Scrape and evaluation
intervals are 1s; the rules themselves are the shipped file, unchanged (the page has
``for: 1m``, so the test takes a little over a minute).
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from alerts.rules import LOOKUP_HIT_RATIO, PAGE, TOKEN_HIT_RATIO, MixinConfig, alert_rules
from sidecar import signals as S
from tests.e2e import live
from tests.promtools import require

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
FAULT = "zero-block"
PAGE_TIMEOUT_S = 150.0


def _load_stack() -> ModuleType:
    path = REPO / "examples" / "stack" / "stack.py"
    spec = importlib.util.spec_from_file_location("kvsidecar_example_stack", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


stack_mod = _load_stack()


@dataclass
class Stack:
    prometheus: str
    alertmanager: str
    webhook: Any
    fault_instance: str
    clean_instance: str
    started: float

    def query(self, expr: str, **params: str) -> list[dict[str, Any]]:
        return live.query(self.prometheus, expr, **params)

    def get(self, url: str) -> Any:
        return live.get(url)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prom_bin = require("prometheus")
    am_bin = require("prometheus-alertmanager", "alertmanager")
    workdir = tmp_path_factory.mktemp("stack")
    webhook = stack_mod.WebhookReceiver()
    am_port, prom_port = stack_mod.free_port(), stack_mod.free_port()
    fault_port, clean_port = stack_mod.free_port(), stack_mod.free_port()
    am = f"{stack_mod.HOST}:{am_port}"
    procs: list[Any] = []
    started = time.time()
    try:
        with stack_mod.stopping(procs):
            procs.append(stack_mod.alertmanager_process(
                workdir, am_bin, am_port,
                stack_mod.alertmanager_config(webhook.url, "1s", "2s")).start())
            for name, port, fault in (("demo-fault", fault_port, FAULT),
                                      ("demo-clean", clean_port, "none")):
                procs.append(stack_mod.demo_process(workdir, name, port, fault, hold_s=240,
                                                    pace_s=0.1).start())
            targets = [f"{stack_mod.HOST}:{p}" for p in (fault_port, clean_port)]
            procs.append(stack_mod.prometheus_process(
                workdir, prom_bin, prom_port,
                stack_mod.prometheus_config(targets, am, "1s")).start())
            for proc, url in zip(procs, [f"http://{am}/-/ready",
                                         f"http://{targets[0]}/healthz",
                                         f"http://{targets[1]}/healthz",
                                         f"http://{stack_mod.HOST}:{prom_port}/-/ready"],
                                 strict=True):
                stack_mod.wait_http(url, 90, proc)
            yield Stack(f"http://{stack_mod.HOST}:{prom_port}", f"http://{am}", webhook,
                        targets[0], targets[1], started)
            for proc in procs[1:3]:
                assert proc.running(), f"{proc.name} died:\n{proc.log_tail()}"
    finally:
        webhook.stop()


_wait = live.wait_for


def test_alertmanager_inhibits_warnings_while_a_page_fires(stack: Stack) -> None:
    """Real Alertmanager, shipped config: a warning for the instance of a firing page is
    suppressed; the same warning for another instance is delivered as a ticket."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    alerts = [
        {"labels": {"alertname": "E2EPage", "severity": "page", "job": "inhibit-check",
                    "instance": "a"}, "startsAt": now},
        {"labels": {"alertname": "E2EWarning", "severity": "warning", "job": "inhibit-check",
                    "instance": "a"}, "startsAt": now},
        {"labels": {"alertname": "E2EWarning", "severity": "warning", "job": "inhibit-check",
                    "instance": "b"}, "startsAt": now},
    ]
    req = urllib.request.Request(f"{stack.alertmanager}/api/v2/alerts",
                                 data=json.dumps(alerts).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200

    def tickets_for_b() -> list[dict[str, Any]]:
        return [a for a in stack.webhook.alerts("/ticket")
                if a["labels"].get("job") == "inhibit-check"]

    delivered = _wait("the uninhibited warning ticket", 30, tickets_for_b)
    assert {a["labels"]["instance"] for a in delivered} == {"b"}
    state = {(a["labels"]["alertname"], a["labels"]["instance"]): a["status"]
             for a in stack.get(f"{stack.alertmanager}/api/v2/alerts")
             if a["labels"].get("job") == "inhibit-check"}
    assert state[("E2EWarning", "a")]["state"] == "suppressed"
    assert state[("E2EWarning", "a")]["inhibitedBy"]
    assert state[("E2EWarning", "b")]["state"] == "active"
    pages = [a for a in stack.webhook.alerts("/page")
             if a["labels"].get("job") == "inhibit-check"]
    assert [a["labels"]["alertname"] for a in pages] == ["E2EPage"]


def test_fault_pages_the_pager(stack: Stack) -> None:
    def page() -> list[dict[str, Any]]:
        return [a for a in stack.webhook.alerts("/page")
                if a["labels"].get("instance") == stack.fault_instance
                and a["status"] == "firing"]

    _wait("the fault's page at the pager webhook", PAGE_TIMEOUT_S, page)
    print(f"\npage delivered {time.time() - stack.started:.1f}s after the stack started")
    # The trap alert (healthy hit rate, wrong KV) pages for the same instance.
    trap = {"KVCacheContentAnomaly", "KVCacheHighHitRateWithAnomalies"}
    pages = _wait("both pages", 30,
                  lambda: page() if trap <= {a["labels"]["alertname"] for a in page()} else [])
    by_name = {a["labels"]["alertname"]: a for a in pages}
    alert = by_name["KVCacheContentAnomaly"]
    labels = alert["labels"]
    assert labels["severity"] == PAGE and labels["job"] == "kv-sidecar"
    assert labels["kind"] in {k.value for k in S.AnomalyKind}
    assert labels["engine"] and labels["model"] and labels["group"]
    notes = alert["annotations"]
    assert notes["runbook_url"].endswith("/alerts/runbooks/KVCacheContentAnomaly.md")
    assert f"the {labels['kind']} check" in notes["description"]
    assert stack.fault_instance in notes["description"]
    assert all(a["labels"]["severity"] == PAGE for a in pages)


def test_clean_run_pages_nobody(stack: Stack) -> None:
    # Watch the clean instance for longer than the longest for: of a page (plus the demo's
    # start-up), so a page would have had time to fire.
    clean = f'instance="{stack.clean_instance}"'
    verified = stack.query(f"sum({S.VERIFIED.name}{{{clean}}})")
    assert verified and float(verified[0]["value"][1]) > 0, "the clean run verified nothing"
    watch_s = max(_seconds(a.for_) for a in alert_rules(MixinConfig()) if a.severity == PAGE)
    watch_s += 15
    _wait(f"{watch_s:g}s of watching the clean run", watch_s + 30,
          lambda: time.time() - stack.started > watch_s)
    anomalies = stack.query(f"sum({S.ANOMALIES.name}{{{clean}}})")
    assert float(anomalies[0]["value"][1]) == 0
    alerts = stack.query(f"ALERTS{{{clean}}}")
    firing = [a["metric"] for a in alerts if a["metric"]["alertstate"] == "firing"]
    paging = [a["metric"] for a in alerts if a["metric"].get("severity") == PAGE]
    assert not firing, firing
    assert not paging, paging
    notified = [a for p, n in stack.webhook.notifications for a in n.get("alerts", [])
                if a["labels"].get("instance") == stack.clean_instance]
    assert not notified, notified
    pending = sorted(a["metric"]["alertname"] for a in alerts)
    print(f"\nclean instance: verified {verified[0]['value'][1]} blocks, pending: {pending}")


def test_every_rule_evaluates_without_error(stack: Stack) -> None:
    groups = stack.get(f"{stack.prometheus}/api/v1/rules")["data"]["groups"]
    assert {g["name"] for g in groups} == {"kv-sidecar.rules", "kv-sidecar.alerts"}
    for g in groups:
        for rule in g["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    both = {stack.fault_instance, stack.clean_instance}
    for record in (LOOKUP_HIT_RATIO, TOKEN_HIT_RATIO):
        assert {r["metric"]["instance"] for r in stack.query(record)} == both, record


def _seconds(duration: str) -> float:
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


# Series of features the stack's sidecars do not run (each off by default): an offload tier
# (recoveries), the background scrub, quarantine and the breaker, OTLP push. A panel is
# excused only when every series it reads is one of these; its data is proven where the
# feature runs (tests/test_scrub.py, tests/test_actions.py, tests/test_hybrid_admission.py,
# tests/test_otlp_failures.py).
FEATURE_OFF_SIGNALS = (S.RECOVERY_DURATION, S.BREAKER_OPEN, S.BREAKER_PROBES, S.QUARANTINED,
                       *S.GUARD_SIGNALS,  # the cache-bypass guard: its own process
                       S.SCRUB_RECOMPUTE_RATE, S.SCRUB_BUDGET, S.SCRUB_PROGRESS,
                       S.SCRUB_COVERAGE,
                       S.OTLP_EXPORTS, S.OTLP_EXPORT_FAILURES,  # OTLP push: --otlp-endpoint
                       # the vLLM probe's write-time fingerprints: a vLLM engine, not this one
                       S.PROBE_BLOCKS_FINGERPRINTED, S.PROBE_FINGERPRINT_CHECKS,
                       S.PROBE_FINGERPRINT_EVICTIONS)


def _feature_off(line: str) -> bool:
    names = set(re.findall(r"kvsidecar_[a-z0-9_]+", line.split(": ", 1)[1]))
    off = {sig.name for sig in FEATURE_OFF_SIGNALS}
    return bool(names) and all(n.removesuffix("_bucket") in off for n in names)


def test_every_dashboard_panel_returns_data(stack: Stack) -> None:
    board = live.dashboard()
    values = live.variable_values(stack.prometheus, board)
    checked, empty = live.panels_without_data(stack.prometheus, board["panels"],
                                              stack.started, values)
    assert checked >= 25
    empty = [line for line in empty if not _feature_off(line)]
    assert not empty, "panels without data:\n" + "\n".join(empty)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((stack_mod.HOST, port)) == 0


def test_stack_script_starts_and_stops_cleanly(tmp_path: Path) -> None:
    """The documented one-command stack: up on our ports, then Ctrl-C stops every process
    it started (by PID) and removes its temporary directory."""
    require("prometheus")
    require("prometheus-alertmanager", "alertmanager")
    ports = {flag: stack_mod.free_port() for flag in ("prometheus", "alertmanager",
                                                        "webhook", "demo")}
    argv = [sys.executable, str(REPO / "examples" / "stack" / "stack.py"), "--fault", "none",
            "--requests", "20", "--hold", "120", "--interval", "1s"]
    argv += [a for flag, port in ports.items() for a in (f"--{flag}-port", str(port))]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)
    lines: list[str] = []
    out = proc.stdout
    assert out is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True)
    reader.start()
    try:
        _wait("the stack's ready message", 90,
              lambda: any("Ctrl-C to stop" in line for line in lines) or proc.poll() is not None)
        assert proc.poll() is None, "".join(lines)
        assert all(_listening(p) for p in ports.values()), ports
        workdir = next(line.split()[-1] for line in lines if line.startswith("logs"))
        assert Path(workdir).is_dir()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 0, "".join(lines)  # bounds a hang: each child gets 10 s
    finally:
        if proc.poll() is None:  # a failed check: let the script stop its children first
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    reader.join(timeout=5)
    assert "stack stopped" in "".join(lines)
    assert not [p for p in ports.values() if _listening(p)], "a child survived the stop"
    assert not Path(workdir).exists()
