"""The shipped alert rules: fresh, valid, unit-tested with promtool, documented by runbooks,
and routed by the example Alertmanager config as the runbooks say."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts import generate
from alerts.rules import PAGE, WARNING, MixinConfig, alert_rules, recording_rules
from sidecar import signals as S
from sidecar.signals import THRESHOLDS
from tests.promtools import require

REPO = Path(__file__).resolve().parent.parent
ALERTS = REPO / "alerts"
RULES = ALERTS / "kv-sidecar.rules.yml"
TESTS = sorted((ALERTS / "tests").glob("*.yml"))
AM_CONFIG = ALERTS / "alertmanager.yml"


def _run(argv: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


def _loaded() -> dict[str, Any]:
    return dict(yaml.safe_load(RULES.read_text()))


def _alerts() -> list[dict[str, Any]]:
    return [r for g in _loaded()["groups"] for r in g["rules"] if "alert" in r]


def _records() -> list[dict[str, Any]]:
    return [r for g in _loaded()["groups"] for r in g["rules"] if "record" in r]


def _promtool_tests() -> list[dict[str, Any]]:
    return [t for f in TESTS for t in yaml.safe_load(f.read_text())["tests"]]


def test_committed_rules_match_the_generator() -> None:
    assert RULES.read_text() == generate.render(), \
        "alerts/kv-sidecar.rules.yml is stale: run `python -m alerts.generate`"
    assert generate.main(["--check"]) == 0


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "rules.yml"
    stale.write_text(generate.render().replace("for: 15m", "for: 16m", 1))
    assert generate.main(["--check", "--output", str(stale)]) == 1
    generate.main(["--output", str(stale)])
    assert generate.main(["--check", "--output", str(stale)]) == 0


def test_promtool_check_rules() -> None:
    promtool = require("promtool")
    result = _run([promtool, "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts()) + len(_records())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    promtool = require("promtool")
    result = _run([promtool, "test", "rules", *map(str, TESTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TESTS)


def test_promtool_unit_tests_catch_a_moved_threshold(tmp_path: Path) -> None:
    """The unit tests pin behaviour: the same tests against rules with the usage threshold
    moved from 85% to 95% must fail."""
    promtool = require("promtool")
    shutil.copytree(ALERTS / "tests", tmp_path / "tests")
    text = RULES.read_text()
    moved = text.replace(f"> {THRESHOLDS.usage_ratio:g}", "> 0.95")
    assert moved != text
    (tmp_path / "kv-sidecar.rules.yml").write_text(moved)
    result = _run([promtool, "test", "rules", str(tmp_path / "tests" / "allocator.yml")])
    assert result.returncode != 0
    assert "KVCacheUsageHigh" in result.stdout + result.stderr


def test_every_alert_has_for_severity_and_annotations() -> None:
    alerts = _alerts()
    assert len({a["alert"] for a in alerts}) == len(alerts)
    for a in alerts:
        name = a["alert"]
        assert re.fullmatch(r"(KVCache|KVSidecar)[A-Z][A-Za-z0-9]+", name), name
        assert re.fullmatch(r"\d+[smh]", a["for"]), name
        assert a["labels"]["severity"] in {PAGE, WARNING}, name
        notes = a["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, name
        assert "{{" in notes["description"], f"{name}: description is not templated"
        assert notes["runbook_url"].endswith(f"/alerts/runbooks/{name}.md"), name


def test_the_issue_alert_list_with_its_severities() -> None:
    severity = {a["alert"]: a["labels"]["severity"] for a in _alerts()}
    assert severity == {
        "KVCacheContentAnomaly": PAGE,
        "KVCacheHighHitRateWithAnomalies": PAGE,
        "KVCacheInvariantViolation": PAGE,
        "KVCacheLeakSuspected": WARNING,
        "KVCacheAllocationFailuresHigh": WARNING,
        "KVCacheUsageHigh": WARNING,
        "KVCacheFragmentationHigh": WARNING,
        "KVCacheHitRateLow": WARNING,
        "KVCacheLatencyP99High": WARNING,
        "KVSidecarVerificationStalled": WARNING,
        "KVSidecarSamplesDropped": WARNING,
        "KVSidecarHookErrors": WARNING,
        "KVSidecarAdapterErrors": WARNING,
        "KVSidecarDown": WARNING,
        "KVSidecarAbsent": WARNING,
        "KVCacheAnomalyLocalised": PAGE,
        "KVCacheAnomalyFleetWide": PAGE,
        "KVCacheRecomputeErrorDrift": WARNING,
        "KVCacheHitCounterMismatch": WARNING,
        "KVSidecarScrubOverdue": WARNING,  # the background scrub (sidecar/checks/scrub.py)
        "KVCacheRecoveryFailures": WARNING,
        "KVCacheRecoveryLatencyHigh": WARNING,
        "KVSidecarOtlpExportFailing": WARNING,  # the OTLP push (sidecar/export/otlp_failures.py)
    }


def test_thresholds_come_from_signals() -> None:
    """Each threshold in signals.THRESHOLDS appears in the alert that uses it."""
    expr = {a["alert"]: a["expr"] for a in _alerts()}
    t = THRESHOLDS
    assert f"> {t.usage_ratio:g}" in expr["KVCacheUsageHigh"]
    assert f"> {t.fragmentation_ratio:g}" in expr["KVCacheFragmentationHigh"]
    assert f"> {t.allocation_failure_rate:g}" in expr["KVCacheAllocationFailuresHigh"]
    assert f"< {t.hit_rate_low:g}" in expr["KVCacheHitRateLow"]
    assert f">= {t.hit_rate_low:g}" in expr["KVCacheHighHitRateWithAnomalies"]
    assert f") > {t.p99_latency_baseline_factor:g}" in expr["KVCacheLatencyP99High"]
    assert f"> {t.samples_dropped_ratio:g}" in expr["KVSidecarSamplesDropped"]
    assert f"< {t.verification_stale_seconds:g})" in expr["KVSidecarVerificationStalled"]
    assert f"> {t.verification_stall_min_hits:g}" in expr["KVSidecarVerificationStalled"]
    assert t.anomaly_rate == 0.0 and "> 0" in expr["KVCacheContentAnomaly"]
    assert f"  ) > {t.fleet_anomaly_share:g}\n" in expr["KVCacheAnomalyLocalised"]
    assert f"\n) > {t.fleet_wide_replicas_ratio:g}\n" in expr["KVCacheAnomalyFleetWide"]
    for name in ("KVCacheAnomalyLocalised", "KVCacheAnomalyFleetWide"):
        assert f"replicas >= {t.fleet_min_replicas:g}" in expr[name], name
    assert f"> {t.recompute_error_drift:g}" in expr["KVCacheRecomputeErrorDrift"]
    assert f"> {t.recovery_failure_ratio:g}" in expr["KVCacheRecoveryFailures"]
    assert f"> {t.recovery_p99_seconds:g}" in expr["KVCacheRecoveryLatencyHigh"]


def test_rules_name_only_known_signals() -> None:
    known = {s.name for s in S.ALL_SIGNALS}
    known |= {f"{s.name}{sfx}" for s in S.ALL_SIGNALS if s.type is S.MetricType.HISTOGRAM
              for sfx in ("_bucket", "_count", "_sum")}
    exprs = " ".join(r["expr"] for r in _alerts() + _records())
    used = set(re.findall(r"(?<![:\w])kvsidecar_\w+", exprs))
    assert used and used <= known, used - known
    assert (REPO / "alerts" / "rules.py").read_text().count(f"{S.NAMESPACE}_") == 0, \
        "alerts/rules.py must take metric names from sidecar.signals, not literals"


def test_recording_rules_are_named_level_metric_operations() -> None:
    for r in _records():
        level, metric, ops = r["record"].split(":")
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", level), r["record"]
        assert metric.startswith(f"{S.NAMESPACE}_"), r["record"]
        assert re.fullmatch(r"[a-z0-9_]+", ops), r["record"]
        # Every instance-level aggregation keeps the target and base labels; a fleet-level
        # one keeps the fleet's (one model on one engine).
        if level.startswith("fleet"):
            assert re.search(r"(by|on) \(job, engine, model", r["expr"]), r["record"]
        elif "sum by" in r["expr"]:
            assert "sum by (job, instance, engine, model" in r["expr"], r["record"]


def test_every_rule_has_promtool_unit_tests_with_a_boundary() -> None:
    tests = _promtool_tests()
    exprs = " ".join(c["expr"] for t in tests for c in t.get("promql_expr_test", []))
    for r in _records():
        assert r["record"] in exprs, f"no promql_expr_test reads {r['record']}"
    for a in _alerts():
        cases = [c for t in tests for c in t.get("alert_rule_test", [])
                 if c["alertname"] == a["alert"]]
        firing = [c for c in cases if c["exp_alerts"]]
        assert firing, f"{a['alert']}: no test where it fires"
        quiet_before = [c for c in cases if not c["exp_alerts"]
                        and any(_minutes(c["eval_time"]) < _minutes(f["eval_time"])
                                for f in firing)]
        assert quiet_before, f"{a['alert']}: no 'not yet' case before a firing one"
        for f in firing:
            for exp in f["exp_alerts"]:
                assert exp["exp_labels"]["severity"] == a["labels"]["severity"]
                assert set(exp["exp_annotations"]) == {"summary", "description",
                                                       "runbook_url"}


def _minutes(text: str) -> float:
    value, unit = float(text[:-1]), text[-1]
    return value * {"s": 1 / 60, "m": 1, "h": 60}[unit]


def test_generator_config_is_the_single_place_for_windows() -> None:
    cfg = MixinConfig()
    assert all(cfg.selector in r.expr for r in recording_rules(cfg) if "rate(" in r.expr)
    assert {a.name for a in alert_rules(cfg)} == {a["alert"] for a in _alerts()}


@pytest.mark.parametrize("name", sorted(a.name for a in alert_rules(MixinConfig())))
def test_runbook_for_every_alert(name: str) -> None:
    path = ALERTS / "runbooks" / f"{name}.md"
    assert path.exists(), f"missing runbook {path}"
    text = path.read_text()
    assert text.startswith(f"# {name}\n")
    headings = re.findall(r"^## (\w+)", text, flags=re.M)
    assert headings[:4] == ["Meaning", "Impact", "Diagnosis", "Mitigation"], headings
    assert "Overview" in text, "a runbook says where to look on the dashboard"


def test_alertmanager_config_is_valid() -> None:
    amtool = require("amtool")
    result = _run([amtool, "check-config", str(AM_CONFIG)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("labels", "receiver"), [
    (["severity=page", "alertname=KVCacheContentAnomaly"], "pager"),
    (["severity=warning", "alertname=KVCacheUsageHigh"], "tickets"),
    (["alertname=SomethingElse"], "tickets"),
])
def test_alertmanager_routes_pages_to_the_pager(labels: list[str], receiver: str) -> None:
    amtool = require("amtool")
    result = _run([amtool, "config", "routes", "test", f"--config.file={AM_CONFIG}",
                   f"--verify.receivers={receiver}", *labels])
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_inhibits_warnings_while_a_page_fires() -> None:
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    rules = cfg["inhibit_rules"]
    assert {"source_matchers": ['severity="page"'], "target_matchers": ['severity="warning"'],
            "equal": ["job", "instance"]} in rules


def test_promtool_unit_tests_catch_a_moved_fleet_share(tmp_path: Path) -> None:
    """The fleet tests pin the share boundary: with the threshold moved from 50% to 52%,
    the replica at 51% is no longer named and the tests fail."""
    promtool = require("promtool")
    shutil.copytree(ALERTS / "tests", tmp_path / "tests")
    text = RULES.read_text()
    share = f"        ) > {THRESHOLDS.fleet_anomaly_share:g}\n"  # inside KVCacheAnomalyLocalised
    assert text.count(share) == 1
    moved = text.replace(share, "        ) > 0.52\n")
    assert moved != text
    (tmp_path / "kv-sidecar.rules.yml").write_text(moved)
    result = _run([promtool, "test", "rules", str(tmp_path / "tests" / "fleet.yml")])
    assert result.returncode != 0
    assert "KVCacheAnomalyLocalised" in result.stdout + result.stderr


def test_alertmanager_fleet_pages_replace_the_per_replica_pages() -> None:
    """A fleet with one bad replica pages once: the localised page inhibits that replica's
    per-replica pages; the fleet-wide page inhibits every per-replica page of the model.
    The names in the config are the generated alerts' names (a rename cannot orphan them)."""
    from alerts.fleet import FLEET_WIDE, LOCALISED, PER_REPLICA_PAGES
    from alerts.rules import ANOMALIES_RECENT

    names = {a["alert"] for a in _alerts()}
    assert {LOCALISED, FLEET_WIDE, *PER_REPLICA_PAGES} <= names
    rules = yaml.safe_load(AM_CONFIG.read_text())["inhibit_rules"]
    per_replica = "|".join(PER_REPLICA_PAGES)
    assert {"source_matchers": [f'alertname="{LOCALISED}"'],
            "target_matchers": [f'alertname=~"{per_replica}"'],
            "equal": ["job", "instance"]} in rules
    assert {"source_matchers": [f'alertname="{FLEET_WIDE}"'],
            "target_matchers": [f'alertname=~"{per_replica}|{LOCALISED}"'],
            "equal": ["job", "engine", "model"]} in rules
    # Each fleet page fires in the same evaluation as the pages it replaces, or those
    # would be delivered before the inhibition exists: same for:, and the same recorded
    # anomalies read directly (not through recordings made later in the rule group).
    by_name = {a["alert"]: a for a in _alerts()}
    for name in (LOCALISED, FLEET_WIDE):
        assert ANOMALIES_RECENT in by_name[name]["expr"], name
        assert "fleet_share" not in by_name[name]["expr"], name
        assert "replicas_ratio" not in by_name[name]["expr"], name
    assert {by_name[n]["for"] for n in (LOCALISED, FLEET_WIDE, *PER_REPLICA_PAGES)} == {"1m"}
