"""The rendered operator objects, read back the way Prometheus and Alertmanager get them:
the PrometheusRule's rules pass ``promtool check rules`` and every ``alerts/tests/*.yml``
unit test; the AlertmanagerConfig, merged as prometheus-operator merges it, passes
``amtool check-config`` and routes pages and tickets as ``alerts/alertmanager.yml`` does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.monitoring import receiver_keys
from tests.deploy.tools import REPO, kustomize, one, operator_alertmanager_yaml
from tests.promtools import require

pytestmark = pytest.mark.deploy
NAMESPACE = "kv-sidecar"


def _run(argv: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def monitoring() -> list[dict[str, Any]]:
    return kustomize("monitoring")


def _rules_from_prometheus_rule(objects: list[dict[str, Any]], tmp: Path) -> Path:
    """The rule file Prometheus gets from the PrometheusRule, beside a copy of the promtool
    tests (they name ``../kv-sidecar.rules.yml``)."""
    rules = tmp / "kv-sidecar.rules.yml"
    rules.write_text(yaml.safe_dump({"groups": one(objects, "PrometheusRule")["spec"]["groups"]},
                                    sort_keys=False))
    shutil.copytree(REPO / "alerts" / "tests", tmp / "tests")
    return rules


def test_promtool_checks_the_rendered_rules(monitoring: list[dict[str, Any]],
                                           tmp_path: Path) -> None:
    promtool = require("promtool")
    rules = _rules_from_prometheus_rule(monitoring, tmp_path)
    result = _run([promtool, "check", "rules", str(rules)])
    assert result.returncode == 0, result.stdout + result.stderr
    count = sum(len(g["rules"]) for g in one(monitoring, "PrometheusRule")["spec"]["groups"])
    assert f"SUCCESS: {count} rules found" in result.stdout


def test_the_rendered_rules_pass_every_alert_unit_test(monitoring: list[dict[str, Any]],
                                                       tmp_path: Path) -> None:
    promtool = require("promtool")
    _rules_from_prometheus_rule(monitoring, tmp_path)
    tests = sorted((tmp_path / "tests").glob("*.yml"))
    assert len(tests) == len(list((REPO / "alerts" / "tests").glob("*.yml"))) > 0
    result = _run([promtool, "test", "rules", *map(str, tests)], cwd=tmp_path / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests)


def _merged(monitoring: list[dict[str, Any]], tmp: Path) -> Path:
    secret = {k: f"http://receiver.invalid/{k}" for k in receiver_keys()}
    merged = operator_alertmanager_yaml(one(monitoring, "AlertmanagerConfig"), NAMESPACE, secret)
    path = tmp / "alertmanager.yml"
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    return path


def test_amtool_checks_the_merged_alertmanager_config(monitoring: list[dict[str, Any]],
                                                      tmp_path: Path) -> None:
    amtool = require("amtool")
    result = _run([amtool, "check-config", str(_merged(monitoring, tmp_path))])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert f" - {len(receiver_keys()) + 1} receivers" in result.stdout
    assert " - 3 inhibit rules" in result.stdout


def _route(amtool: str, config: Path, labels: list[str]) -> str:
    result = _run([amtool, "config", "routes", "test", "--config.file", str(config), *labels])
    return result.stdout.strip()


@pytest.mark.parametrize("labels", [
    ["severity=page", "alertname=KVCacheContentAnomaly"],
    ["severity=warning", "alertname=KVCacheUsageHigh"],
    ["severity=info", "alertname=Other"],
])
def test_pages_and_tickets_route_as_in_the_example(labels: list[str],
                                                   monitoring: list[dict[str, Any]],
                                                   tmp_path: Path) -> None:
    amtool = require("amtool")
    merged = _merged(monitoring, tmp_path)
    want = _route(amtool, REPO / "alerts" / "alertmanager.yml", labels)
    assert want in {"pager", "tickets"}
    got = _route(amtool, merged, [f"namespace={NAMESPACE}", *labels])
    assert got == f"{NAMESPACE}/kv-sidecar/{want}"


def test_an_alert_without_the_namespace_label_reaches_no_receiver_of_ours(
        monitoring: list[dict[str, Any]], tmp_path: Path) -> None:
    """The operator's default matcher strategy: an AlertmanagerConfig only sees alerts with
    its namespace label. kv-sidecar's alerts aggregate it away, hence the Kubernetes guide's
    ``enforcedNamespaceLabel`` (or matcher strategy None)."""
    amtool = require("amtool")
    assert _route(amtool, _merged(monitoring, tmp_path),
                  ["severity=page", "alertname=KVCacheContentAnomaly"]) == "null"


@pytest.mark.parametrize(("labels", "want"), [
    (["severity=page", "alertname=KVCacheContentAnomaly"],
     f"{NAMESPACE}/kv-sidecar/pager,{NAMESPACE}/kv-sidecar-guard/guard"),
    (["severity=warning", "alertname=KVCacheUsageHigh"], f"{NAMESPACE}/kv-sidecar/tickets"),
])
def test_pages_reach_the_guard_as_well_as_the_pager(labels: list[str], want: str,
                                                    monitoring: list[dict[str, Any]],
                                                    tmp_path: Path) -> None:
    """Both AlertmanagerConfigs merged as the operator merges them (each a first-level
    route with continue): a page goes to the pager and to the guard's webhook; a warning
    only to tickets."""
    amtool = require("amtool")
    secret = {k: f"http://receiver.invalid/{k}" for k in receiver_keys()}
    ours = operator_alertmanager_yaml(one(monitoring, "AlertmanagerConfig"), NAMESPACE, secret)
    guard = operator_alertmanager_yaml(
        one(kustomize("overlays/guard"), "AlertmanagerConfig"), NAMESPACE,
        {"alertmanager-url": f"http://guard.{NAMESPACE}.svc:8000/guard/alertmanager"})
    ours["route"]["routes"] += guard["route"]["routes"]
    ours["receivers"] += guard["receivers"][1:]  # one "null" root receiver
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(ours, sort_keys=False))
    assert _run([amtool, "check-config", str(path)]).returncode == 0
    result = _run([amtool, "config", "routes", "test", "--config.file", str(path),
                   f"namespace={NAMESPACE}", *labels])
    assert result.stdout.strip() == want
