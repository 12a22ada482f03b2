"""The generated operator resources and mixin: fresh, equal to their sources, and stale the
moment a source changes without regenerating."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alerts.rules import MixinConfig, rule_groups
from deploy import generate, mixin
from deploy.monitoring import alertmanager_config, parse_matcher
from tests.deploy.tools import REPO, kustomize, one, require

pytestmark = pytest.mark.deploy


def test_committed_files_match_the_generator() -> None:
    assert generate.main(["--check"]) == 0, "run `python -m deploy.generate`"


def test_a_threshold_moved_in_signals_without_regenerating_is_stale(tmp_path: Path) -> None:
    """The mutation the issue names: edit the thresholds (sidecar/signals/kinds.py) in a copy
    of the repo, do not regenerate, and the check fails naming the PrometheusRule and the
    mixin."""
    for part in ("sidecar", "alerts", "dashboards", "deploy", "mixin"):
        shutil.copytree(REPO / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    signals = tmp_path / "sidecar" / "signals" / "kinds.py"
    text = signals.read_text()
    moved = text.replace("usage_ratio: float = 0.85", "usage_ratio: float = 0.9")
    assert moved != text, "the usage threshold moved in signals.py: update this test"
    signals.write_text(moved)
    run = [sys.executable, "-m", "deploy.generate", "--check"]
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "deploy/kubernetes/monitoring/prometheusrule.yaml is stale" in result.stderr
    assert "mixin/config.libsonnet is stale" in result.stderr
    # ... and regenerating makes it fresh again, with the moved threshold in the rule.
    assert subprocess.run(run[:-1], cwd=tmp_path, env=env, timeout=300).returncode == 0
    assert subprocess.run(run, cwd=tmp_path, env=env, timeout=300).returncode == 0
    rule = (tmp_path / "deploy/kubernetes/monitoring/prometheusrule.yaml").read_text()
    assert "> 0.9" in rule and "> 0.85" not in rule


def test_prometheus_rule_groups_are_exactly_the_rule_file() -> None:
    objects = kustomize("monitoring")
    groups = one(objects, "PrometheusRule")["spec"]["groups"]
    assert groups == yaml.safe_load((REPO / "alerts/kv-sidecar.rules.yml").read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert {"KVCacheAnomalyLocalised", "KVCacheAnomalyFleetWide"} <= alerts  # fleet rules


def test_dashboard_config_map_is_byte_identical_and_labelled_for_grafana() -> None:
    cm = one(kustomize("monitoring"), "ConfigMap", "kv-sidecar-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["kv-sidecar-overview.json"] == (REPO / "dashboards/overview.json").read_text()


def test_alertmanager_config_carries_every_route_and_inhibit_rule() -> None:
    source = yaml.safe_load((REPO / "alerts/alertmanager.yml").read_text())
    spec = one(kustomize("monitoring"), "AlertmanagerConfig")["spec"]
    route = spec["route"]
    assert route["receiver"] == source["route"]["receiver"]
    assert route["groupBy"] == source["route"]["group_by"]
    assert [(r["receiver"], r["matchers"]) for r in route["routes"]] == [
        (r["receiver"], [parse_matcher(m) for m in r["matchers"]])
        for r in source["route"]["routes"]]
    assert len(spec["inhibitRules"]) == len(source["inhibit_rules"])
    for ours, theirs in zip(spec["inhibitRules"], source["inhibit_rules"], strict=True):
        assert ours["sourceMatch"] == [parse_matcher(m) for m in theirs["source_matchers"]]
        assert ours["targetMatch"] == [parse_matcher(m) for m in theirs["target_matchers"]]
        assert ours["equal"] == theirs["equal"]
    assert {r["name"] for r in spec["receivers"]} == {r["name"] for r in source["receivers"]}


def test_matcher_parsing_and_its_errors() -> None:
    assert parse_matcher('alertname=~"A|B"') == {"name": "alertname", "matchType": "=~",
                                                 "value": "A|B"}
    assert parse_matcher('x!="a\\"b"')["value"] == 'a"b'
    with pytest.raises(ValueError, match="cannot read Alertmanager matcher"):
        parse_matcher("severity=page")


def test_an_untranslatable_alertmanager_key_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "am.yml"
    bad.write_text("route: {receiver: x, mute_time_intervals: [night]}\nreceivers: [{name: x}]\n")
    with pytest.raises(ValueError, match="mute_time_intervals"):
        alertmanager_config(bad)


def _jsonnet(expr: str) -> object:
    tool = require("jsonnet")
    result = subprocess.run([tool, "-J", str(REPO / "mixin"), "-e", expr], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_mixin_builds_with_jsonnet_and_equals_the_rules_and_dashboards() -> None:
    built = _jsonnet('local m = import "mixin.libsonnet"; {a: m.prometheusAlerts, '
                     'r: m.prometheusRules, d: m.grafanaDashboards, c: m._config}')
    assert isinstance(built, dict)
    groups = yaml.safe_load((REPO / "alerts/kv-sidecar.rules.yml").read_text())["groups"]
    assert built["r"]["groups"] + built["a"]["groups"] == groups
    assert all("alert" in r for g in built["a"]["groups"] for r in g["rules"])
    overview = json.loads((REPO / "dashboards/overview.json").read_text())
    assert built["d"] == {"kv-sidecar-overview.json": overview}
    assert built["c"]["kvSidecarSelector"] == MixinConfig().selector
    assert built["c"]["thresholds"]["usage_ratio"] == pytest.approx(0.85)


def test_mixin_config_selector_retargets_every_rule_like_the_python_config() -> None:
    selector = 'job="inference", namespace="llm"'
    built = _jsonnet('local m = (import "mixin.libsonnet") + {_config+:: {kvSidecarSelector: '
                     f"{json.dumps(selector)}}}}}; m.prometheusRules.groups + "
                     "m.prometheusAlerts.groups")
    assert built == rule_groups(MixinConfig(selector=selector))["groups"]
    assert 'job="kv-sidecar"' not in json.dumps(built)


def test_mixin_files_name_their_keys() -> None:
    files = mixin.files()
    assert {"mixin.libsonnet", "config.libsonnet", "alerts.libsonnet", "rules.libsonnet",
            "dashboards.libsonnet", "dashboards/kv-sidecar-overview.json"} <= set(files)
    assert files["dashboards/kv-sidecar-overview.json"] == \
        (REPO / "dashboards/overview.json").read_text()
