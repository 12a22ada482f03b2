"""The Grafana dashboards: committed JSON regenerates identically, and the JSON has the
structure the issue asks for (first row, units, variables, $__rate_interval, signal names).

Whether each query returns data is checked against a live Prometheus in tests/e2e."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts.rules import MixinConfig, recording_rules
from dashboards import generate
from sidecar import signals as S
from sidecar.signals import THRESHOLDS
from tests.promtools import require

REPO = Path(__file__).resolve().parent.parent
SOURCES = generate.sources()


def _dashboard(name: str = "overview") -> dict[str, Any]:
    return dict(json.loads((REPO / "dashboards" / f"{name}.json").read_text()))


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in d["panels"] if p["type"] != "row"]


def _exprs(d: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(d) for t in p["targets"]]


def substitute(expr: str) -> str:
    """Grafana's variables replaced the way an "All" selection and a 1m step expand them."""
    for var in ("job", "instance", "engine", "model"):
        expr = expr.replace(f"${var}", ".+")
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
            .replace("$__interval", "15s"))


def test_there_is_a_dashboard() -> None:
    assert [s.name for s in SOURCES] == ["overview.dashboard.py"]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_committed_json_regenerates_identically(source: Path) -> None:
    committed = generate.json_path(source).read_text()
    assert committed == generate.render(source), \
        f"{generate.json_path(source).name} is stale: run `python -m dashboards.generate`"
    assert generate.render(source) == generate.render(source), "generation is not stable"


def test_check_mode_fails_on_stale_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "overview.dashboard.py"
    source.write_text(SOURCES[0].read_text())
    monkeypatch.setattr(generate, "HERE", tmp_path)
    assert generate.main(["--check"]) == 1  # no JSON yet
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0
    target = tmp_path / "overview.json"
    target.write_text(target.read_text().replace('"Hit rate"', '"Hit ratio"', 1))
    assert generate.main(["--check"]) == 1


def test_first_row_puts_hit_rate_next_to_anomaly_rate() -> None:
    d = _dashboard()
    first_row = d["panels"][0]
    assert first_row["type"] == "row" and first_row["gridPos"]["y"] == 0
    top = sorted((p for p in _panels(d) if p["gridPos"]["y"] == 1),
                 key=lambda p: p["gridPos"]["x"])
    hit, anomaly = top[0], top[1]
    assert "hit rate" in hit["title"].lower() and "anomaly rate" in anomaly["title"].lower()
    assert hit["gridPos"]["x"] + hit["gridPos"]["w"] == anomaly["gridPos"]["x"]
    assert [t["legendFormat"] for t in hit["targets"]] == ["lookups", "tokens"]
    assert S.HITS.name in hit["targets"][0]["expr"]
    assert S.HIT_TOKENS.name in hit["targets"][1]["expr"]
    assert S.ANOMALIES.name in anomaly["targets"][0]["expr"]
    assert S.VERIFIED.name in anomaly["targets"][0]["expr"]
    # Red from the first anomaly; the hit rate turns green only at the alert's threshold.
    steps = anomaly["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0]["color"] == "green" and steps[1]["color"] == "red"
    assert 0 < steps[1]["value"] < 1e-6
    hit_steps = hit["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert hit_steps[1] == {"color": "green", "value": THRESHOLDS.hit_rate_low}


def test_sections_cover_the_issue() -> None:
    d = _dashboard()
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Is the cache serving the right KV?", "Anomalies", "Verification coverage",
                    "Allocator health", "Latency", "Fleet", "Hybrid caches",
                    "Scrub and actions",  # the scrub's row (sidecar/scrub.py, actions.py)
                    "OTLP push",  # sidecar/export/otlp_failures.py
                    "vLLM write-time fingerprints"]  # sidecar/adapters/vllm/block_writes.py
    text = "\n".join(_exprs(d))
    for sig in (S.ANOMALIES, S.VERIFIED, S.SAMPLES_DROPPED, S.LAST_VERIFICATION,
                S.ALLOCATION_FAILURES, S.ALLOCATIONS, S.FRAGMENTATION_RATIO, S.USAGE_RATIO,
                S.INVARIANT_VIOLATIONS, S.SAMPLED, S.OTLP_EXPORTS, S.OTLP_EXPORT_FAILURES,
                S.PROBE_BLOCKS_FINGERPRINTED, S.PROBE_FINGERPRINT_CHECKS,
                S.PROBE_FINGERPRINT_EVICTIONS):
        assert sig.name in text, f"no panel shows {sig.name}"
    assert "sum by (kind)" in text and "sum by (instance, group)" in text
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate({S.REQUEST_LATENCY.name}_bucket"\
            in text
    assert re.search(r"topk\(\d+, .*" + S.ANOMALIES.name, text)


def test_hybrid_row_shows_per_group_and_recovery_signals() -> None:
    text = "\n".join(_exprs(_dashboard()))
    for sig in S.HYBRID_SIGNALS:
        assert sig.name in text, f"no panel shows {sig.name}"
    assert "sum by (group_kind, kind)" in text and "sum by (group, outcome)" in text


def test_every_panel_has_a_unit_a_datasource_and_a_place_on_the_grid() -> None:
    d = _dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        new = {(x, y) for x in range(g["x"], g["x"] + g["w"])
               for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & new, f"{p['title']} overlaps another panel"
        cells |= new
        if p["type"] == "row":
            continue
        assert p["fieldConfig"]["defaults"]["unit"], f"{p['title']} has no unit"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and p["description"], p["title"]


def test_template_variables() -> None:
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance", "engine", "model"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance", "engine", "model"):
        v = variables[name]
        assert v["includeAll"] and v["multi"], name
        assert v["query"].startswith(f"label_values({S.BUILD_INFO.name}{{")
        assert v["query"].endswith(f", {name})")
    for expr in _exprs(_dashboard()):
        for name in ("job", "instance", "engine", "model"):
            assert f'{name}=~"${name}"' in expr, f"{expr} ignores ${name}"


def test_rates_use_rate_interval() -> None:
    for expr in _exprs(_dashboard()):
        windows = re.findall(r"\[([^\]]+)\]", expr)
        assert all(w in ("$__rate_interval", "$__range") for w in windows), expr
        for fn, window in re.findall(r"\b(rate|increase)\([^\[]*\[([^\]]+)\]", expr):
            assert fn == "increase" or window == "$__rate_interval", expr


def test_metric_names_are_signals_or_recording_rules() -> None:
    known = {s.name for s in S.ALL_SIGNALS}
    known |= {f"{s.name}{sfx}" for s in S.ALL_SIGNALS if s.type is S.MetricType.HISTOGRAM
              for sfx in ("_bucket", "_count", "_sum")}
    records = {r.record for r in recording_rules(MixinConfig())}
    for expr in _exprs(_dashboard()):
        names = set(re.findall(r"(?<![\w:])kvsidecar_\w+", expr))
        names |= set(re.findall(r"\b\w+:kvsidecar_\w+:\w+", expr))
        plain = {n for n in names if ":" not in n}
        assert plain <= known, plain - known
        assert {n for n in names if ":" in n} <= records
    for source in (REPO / "dashboards").glob("*.py"):
        assert f"{S.NAMESPACE}_" not in source.read_text(), \
            f"{source.name} writes a metric name; import it from sidecar.signals"


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel query (as a recording rule) after variable expansion."""
    promtool = require("promtool")
    exprs = _exprs(_dashboard())
    exprs += [v["query"][len("label_values("):].rsplit(",", 1)[0]
              for v in _dashboard()["templating"]["list"] if v["type"] == "query"]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}:check", "expr": substitute(e)}
        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_fleet_row_ranks_instances_and_puts_hit_rate_next_to_anomaly_rate() -> None:
    """The fleet row: replicas affected vs scraped, top-k instances by anomaly rate, each
    instance's share of the fleet's anomaly rate with the localising page's threshold, and
    a per-instance table with the anomaly rate next to the hit rates."""
    from alerts.fleet import INSTANCE_ANOMALY_SHARE

    d = _dashboard()
    rows = [p for p in d["panels"] if p["type"] == "row"]
    fleet_y = next(r["gridPos"]["y"] for r in rows if r["title"] == "Fleet")
    fleet = {p["title"]: p for p in _panels(d) if p["gridPos"]["y"] > fleet_y}
    stat = fleet["Replicas with anomalies"]
    assert [t["legendFormat"] for t in stat["targets"]] == ["with anomalies", "replicas"]
    assert S.BUILD_INFO.name in stat["targets"][1]["expr"]
    topk = fleet["Top 5 instances by content-anomaly rate"]["targets"][0]["expr"]
    assert topk.startswith("topk(5, ") and S.ANOMALIES.name in topk
    share = fleet["Share of the fleet's anomaly rate"]
    assert f"topk(5, {INSTANCE_ANOMALY_SHARE}{{" in share["targets"][0]["expr"]
    steps = share["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[1] == {"color": "red", "value": THRESHOLDS.fleet_anomaly_share}
    table = fleet["Fleet: anomalies and hit rate per instance"]
    columns = [o["properties"][0]["value"] for o in table["fieldConfig"]["overrides"]]
    assert columns == ["anomalies", "anomaly rate", "hit rate (lookups)", "hit rate (tokens)"]
    assert all(t["instant"] and "by (instance)" in t["expr"] for t in table["targets"])
