"""End to end, a fleet: four kv-sidecar demo replicas (one with a fault) behind one real
Prometheus (the shipped rules) and one real Alertmanager (the shipped config), started by
examples/fleet/fleet.py's functions, the pager a webhook on loopback.

Checks: exactly one page, naming the faulty replica (instance, replica and gpu target
labels, engine, model, cache group, kind) and saying it is one replica of four; its
per-replica pages are inhibited (they fire in Prometheus, and Alertmanager suppresses them);
the clean replicas page nobody; every fleet-row panel query returns data, and the data
says what the fleet looks like (one of four replicas with anomalies, the faulty one first).

Intervals are 1s and the pages have ``for: 1m``: the module takes about 80-100 s.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from alerts.fleet import FLEET_REPLICAS, FLEET_WIDE, LOCALISED, PER_REPLICA_PAGES
from alerts.rules import PAGE, MixinConfig, alert_rules
from sidecar import signals as S
from tests.e2e import live
from tests.promtools import require

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
FAULT = "zero-block"
REPLICAS = 4
FAULTY = 1
PAGE_TIMEOUT_S = 150.0


def _load_fleet() -> ModuleType:
    path = REPO / "examples" / "fleet" / "fleet.py"
    spec = importlib.util.spec_from_file_location("kvsidecar_example_fleet", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


fleet_mod = _load_fleet()
stack_mod = fleet_mod.stack


@dataclass
class Fleet:
    prometheus: str
    alertmanager: str
    webhook: Any
    replicas: list[Any]
    started: float

    @property
    def faulty(self) -> Any:
        return self.replicas[FAULTY]

    @property
    def clean(self) -> list[Any]:
        return [r for r in self.replicas if r.fault == "none"]

    def query(self, expr: str, **params: str) -> list[dict[str, Any]]:
        return live.query(self.prometheus, expr, **params)

    def pages(self) -> list[dict[str, Any]]:
        """Every alert of every notification the pager received, with its group key."""
        return [{**a, "groupKey": n.get("groupKey")} for p, n in self.webhook.notifications
                if p == "/page" for a in n.get("alerts", [])]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prom_bin = require("prometheus")
    am_bin = require("prometheus-alertmanager", "alertmanager")
    workdir = tmp_path_factory.mktemp("fleet")
    webhook = stack_mod.WebhookReceiver()
    am_port, prom_port = stack_mod.free_port(), stack_mod.free_port()
    replicas = fleet_mod.plan(REPLICAS, FAULT, FAULTY,
                              [stack_mod.free_port() for _ in range(REPLICAS)])
    am = f"{stack_mod.HOST}:{am_port}"
    procs: list[Any] = []
    started = time.time()
    try:
        with stack_mod.stopping(procs):
            procs.append(stack_mod.alertmanager_process(
                workdir, am_bin, am_port,
                stack_mod.alertmanager_config(webhook.url, "1s", "2s")).start())
            stack_mod.wait_http(f"http://{am}/-/ready", 60, procs[0])
            # Light replicas: 2 cores run four of them next to Prometheus.
            fleet_mod.start_replicas(workdir, replicas, procs, hold_s=240, pace_s=0.2,
                                     requests=300)
            prom = stack_mod.prometheus_process(
                workdir, prom_bin, prom_port, fleet_mod.prometheus_config(replicas, am, "1s"))
            procs.append(prom.start())
            stack_mod.wait_http(f"http://{stack_mod.HOST}:{prom_port}/-/ready", 60, prom)
            yield Fleet(f"http://{stack_mod.HOST}:{prom_port}", f"http://{am}", webhook,
                        replicas, started)
            for proc in procs[1:1 + REPLICAS]:
                assert proc.running(), f"{proc.name} died:\n{proc.log_tail()}"
    finally:
        webhook.stop()


def test_one_bad_replica_pages_once_naming_it(fleet: Fleet) -> None:
    faulty = fleet.faulty

    def localised() -> list[dict[str, Any]]:
        return [a for a in fleet.pages() if a["status"] == "firing"
                and a["labels"]["alertname"] == LOCALISED]

    live.wait_for("the fleet page at the pager webhook", PAGE_TIMEOUT_S, localised)
    print(f"\nfleet page delivered {time.time() - fleet.started:.1f}s after the fleet started")

    # The per-replica pages fire in Prometheus for the same replica...
    def per_replica_firing() -> list[dict[str, Any]]:
        return [a["metric"] for a in fleet.query(
            f'ALERTS{{alertstate="firing", instance="{faulty.target}"}}')
            if a["metric"]["alertname"] in PER_REPLICA_PAGES]

    live.wait_for("the per-replica pages firing in Prometheus", 30, per_replica_firing)
    # ... and Alertmanager holds them, suppressed by the fleet page.
    held = [a for a in live.get(f"{fleet.alertmanager}/api/v2/alerts")
            if a["labels"]["alertname"] in PER_REPLICA_PAGES]
    assert held and all(a["status"]["state"] == "suppressed" and a["status"]["inhibitedBy"]
                        for a in held), held
    time.sleep(5)  # let any late notification arrive (group_interval is 2s)

    pages = fleet.pages()
    assert len({a["groupKey"] for a in pages}) == 1, pages
    assert {(a["labels"]["alertname"], a["labels"]["instance"]) for a in pages} \
        == {(LOCALISED, faulty.target)}, pages
    for alert in pages:
        labels, notes = alert["labels"], alert["annotations"]
        assert labels["severity"] == PAGE and labels["job"] == "kv-sidecar"
        assert (labels["replica"], labels["gpu"]) == (faulty.name, faulty.gpu)
        assert labels["engine"] == "reference" and labels["model"] and labels["group"]
        assert labels["kind"] in {k.value for k in S.AnomalyKind}
        assert f"on {faulty.target} (reference, " in notes["description"]
        assert f"gpu {faulty.gpu}" in notes["description"]
        assert "holds 100% of the fleet's anomaly rate" in notes["description"]
        assert f"1 of {REPLICAS} replicas" in notes["description"]
        assert "One replica, not a rollout" in notes["description"]
        assert notes["runbook_url"].endswith(f"/alerts/runbooks/{LOCALISED}.md")
    assert not fleet.query(f'ALERTS{{alertname="{FLEET_WIDE}"}}')


def test_clean_replicas_page_nobody(fleet: Fleet) -> None:
    watch_s = max(_seconds(a.for_) for a in alert_rules(MixinConfig())
                  if a.severity == PAGE) + 15
    live.wait_for(f"{watch_s:g}s of watching the clean replicas", watch_s + 30,
                  lambda: time.time() - fleet.started > watch_s)
    clean = "|".join(r.target for r in fleet.clean)
    where = f'instance=~"{clean}"'
    verified = fleet.query(f"sum by (instance) ({S.VERIFIED.name}{{{where}}}) > 0")
    assert len(verified) == len(fleet.clean), f"a clean replica verified nothing: {verified}"
    anomalies = fleet.query(f"sum({S.ANOMALIES.name}{{{where}}})")
    assert float(anomalies[0]["value"][1]) == 0
    alerts = fleet.query(f"ALERTS{{{where}}}")
    firing = [a["metric"] for a in alerts if a["metric"]["alertstate"] == "firing"]
    paging = [a["metric"] for a in alerts if a["metric"].get("severity") == PAGE]
    assert not firing, firing
    assert not paging, paging
    targets = {r.target for r in fleet.clean}
    notified = [a for _, n in fleet.webhook.notifications for a in n.get("alerts", [])
                if a["labels"].get("instance") in targets]
    assert not notified, notified


def test_fleet_rules_evaluate_and_count_the_fleet(fleet: Fleet) -> None:
    groups = live.get(f"{fleet.prometheus}/api/v1/rules")["data"]["groups"]
    for g in groups:
        for rule in g["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    replicas = live.wait_for("the fleet's replica count", 30,
                             lambda: fleet.query(FLEET_REPLICAS))
    assert [float(r["value"][1]) for r in replicas] == [REPLICAS]


def test_every_fleet_panel_returns_data_from_the_fleet(fleet: Fleet) -> None:
    board = live.dashboard()
    panels = live.row_panels(board, "Fleet")
    values = live.variable_values(fleet.prometheus, board)
    assert values["instance"].count("|") == REPLICAS - 1, values
    checked, empty = live.panels_without_data(fleet.prometheus, panels, fleet.started,
                                              values)
    assert checked >= 7
    assert not empty, "fleet panels without data:\n" + "\n".join(empty)

    def run(title: str, ref: str) -> list[dict[str, Any]]:
        panel = next(p for p in panels if p["title"] == title)
        target = next(t for t in panel["targets"] if t["refId"] == ref)
        expr = target["expr"]
        for name, value in values.items():
            expr = expr.replace(f"${name}", value)
        rng = f"{max(60, int(time.time() - fleet.started))}s"
        return fleet.query(expr.replace("$__range", rng).replace("$__rate_interval", "5s"))

    # What the panels say: one of four replicas has anomalies, and it is the faulty one.
    stat = "Replicas with anomalies"
    assert [float(r["value"][1]) for r in run(stat, "A")] == [1]
    assert [float(r["value"][1]) for r in run(stat, "B")] == [REPLICAS]
    table = "Fleet: anomalies and hit rate per instance"
    anomalies = {r["metric"]["instance"]: float(r["value"][1]) for r in run(table, "A")}
    assert set(anomalies) == {r.target for r in fleet.replicas}
    assert anomalies[fleet.faulty.target] > 0
    assert all(anomalies[r.target] == 0 for r in fleet.clean), anomalies
    hit_rates = {r["metric"]["instance"] for r in run(table, "C")}
    assert hit_rates == set(anomalies)
    share = run("Share of the fleet's anomaly rate", "A")
    assert [r["metric"]["instance"] for r in share] == [fleet.faulty.target]


def _seconds(duration: str) -> float:
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]
