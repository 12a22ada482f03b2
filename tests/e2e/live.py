"""Helpers the end-to-end tests share: query a live Prometheus, wait for a condition, and
run the dashboard's panel queries against it the way Grafana would."""

from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "overview.json"


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def query(prometheus: str, expr: str, **params: str) -> list[dict[str, Any]]:
    """An instant query, or a range query when ``start`` is given; the result list."""
    path = "query_range" if "start" in params else "query"
    qs = urllib.parse.urlencode({"query": expr, **params})
    body = get(f"{prometheus}/api/v1/{path}?{qs}")
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def wait_for(what: str, timeout_s: float, probe: Callable[[], Any]) -> Any:
    """Poll ``probe`` until it returns something truthy; fail the test after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def variable_values(prometheus: str, board: dict[str, Any]) -> dict[str, str]:
    """Each query variable set to "All", expanded the way Grafana does: a regex
    alternation of the values its label_values() query returns from this Prometheus."""
    values: dict[str, str] = {}
    for v in board["templating"]["list"]:
        if v["type"] != "query":
            continue
        expr = v["query"]
        for name, value in values.items():
            expr = expr.replace(f"${name}", value)
        match, label = expr[len("label_values("):-1].rsplit(",", 1)
        series = query(prometheus, f"group by ({label.strip()}) ({match})")
        found = sorted(s["metric"][label.strip()] for s in series)
        assert found, f"variable {v['name']} has no values"
        values[v["name"]] = "(" + "|".join(found) + ")"
    return values


def panels_without_data(prometheus: str, panels: Iterable[dict[str, Any]], started: float,
                        values: dict[str, str]) -> tuple[int, list[str]]:
    """Run every target of ``panels`` since ``started`` (instant ones now); return how many
    ran and the ``title / legend: query`` of those with no finite sample."""
    now = time.time()
    rng = f"{max(60, int(now - started))}s"
    empty = []
    checked = 0
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in values.items():
                expr = expr.replace(f"${name}", value)
            expr = expr.replace("$__rate_interval", "5s").replace("$__range", rng)
            if target.get("instant"):
                result = query(prometheus, expr, time=f"{now:.3f}")
                samples = [r["value"] for r in result]
            else:
                result = query(prometheus, expr, start=f"{started:.3f}", end=f"{now:.3f}",
                               step="2")
                samples = [v for r in result for v in r["values"]]
            checked += 1
            if not any(math.isfinite(float(v)) for _, v in samples):
                empty.append(f"{panel['title']} / {target['legendFormat']}: {expr}")
    return checked, empty


def row_panels(board: dict[str, Any], row_title: str) -> list[dict[str, Any]]:
    """The panels below the row titled ``row_title`` up to the next row."""
    out: list[dict[str, Any]] = []
    inside = False
    for p in sorted(board["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if p["type"] == "row":
            inside = p["title"] == row_title
        elif inside:
            out.append(p)
    return out
