"""prometheus-operator resources for kv-sidecar, built from the repo's one source of truth.

* ``PodMonitor``: scrapes the port named ``metrics`` of every pod labelled
  ``app.kubernetes.io/part-of: kv-sidecar`` and sets ``job`` to the job the rules select
  (:class:`alerts.rules.MixinConfig`), so the shipped rules and dashboards apply unchanged.
* ``PrometheusRule``: the groups of ``alerts/kv-sidecar.rules.yml`` (fleet rules included),
  taken from :func:`alerts.rules.rule_groups`, the function that writes that file.
* ``AlertmanagerConfig``: the routes and inhibit rules of ``alerts/alertmanager.yml``. The
  receivers keep their names; their webhook URLs come from a Secret (the example file's
  loopback webhooks mean nothing in a cluster).
* The dashboards as one ConfigMap labelled for Grafana's dashboard sidecar, each value the
  JSON that ``python -m dashboards.generate`` writes, byte for byte.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from alerts.rules import MixinConfig, rule_groups

REPO = Path(__file__).resolve().parent.parent
ALERTMANAGER_EXAMPLE = REPO / "alerts" / "alertmanager.yml"

NAME = "kv-sidecar"
PART_OF = {"app.kubernetes.io/part-of": NAME}
LABELS = {"app.kubernetes.io/name": NAME, **PART_OF}
METRICS_PORT = "metrics"  # the container port name of every kv-sidecar process in a pod
RECEIVER_SECRET = "kv-sidecar-alert-receivers"
GRAFANA_LABEL = {"grafana_dashboard": "1"}

_MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*$')
# alertmanager.yml route keys and their AlertmanagerConfig (v1alpha1) names.
_ROUTE_KEYS = {"receiver": "receiver", "group_by": "groupBy", "group_wait": "groupWait",
               "group_interval": "groupInterval", "repeat_interval": "repeatInterval",
               "continue": "continue"}


def scrape_job(cfg: MixinConfig | None = None) -> str:
    """The job the rules select: ``MixinConfig.selector`` must be exactly ``job="NAME"``
    (anything else cannot be set by a PodMonitor; say so instead of scraping into a job the
    rules never read)."""
    selector = (cfg or MixinConfig()).selector
    m = re.fullmatch(r'job="([^"]+)"', selector)
    if not m:
        raise ValueError(f"MixinConfig.selector is {selector!r}; the PodMonitor can only set "
                         'a job label: use job="NAME"')
    return m.group(1)


def meta(name: str, **extra: str) -> dict[str, Any]:
    return {"name": name, "labels": {**LABELS, **extra}}


def pod_monitor(cfg: MixinConfig | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta(NAME),
        "spec": {
            "selector": {"matchLabels": dict(PART_OF)},
            "podMetricsEndpoints": [{
                "port": METRICS_PORT,
                "path": "/metrics",
                "interval": "30s",
                "relabelings": [
                    # The rules select job="kv-sidecar"; the operator's default job is
                    # "<namespace>/<podmonitor>". Relabelings run after the operator's own.
                    {"action": "replace", "targetLabel": "job",
                     "replacement": scrape_job(cfg)},
                    # The fleet page names the replica (alerts/fleet.py target_labels).
                    {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_name"],
                     "targetLabel": "replica"},
                ],
            }],
        },
    }


def prometheus_rule(cfg: MixinConfig | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": meta(NAME),
        "spec": {"groups": rule_groups(cfg)["groups"]},
    }


def parse_matcher(text: str) -> dict[str, str]:
    """``severity="page"`` -> ``{"name": "severity", "matchType": "=", "value": "page"}``."""
    m = _MATCHER.match(text)
    if not m:
        raise ValueError(f"cannot read Alertmanager matcher {text!r} (expected name=\"value\","
                         " with =, !=, =~ or !~)")
    value = m.group(3).replace('\\"', '"').replace("\\\\", "\\")
    return {"name": m.group(1), "matchType": m.group(2), "value": value}


def _route(route: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in route.items():
        if key in _ROUTE_KEYS:
            out[_ROUTE_KEYS[key]] = value
        elif key == "matchers":
            out["matchers"] = [parse_matcher(m) for m in value]
        elif key == "routes":
            out["routes"] = [_route(r) for r in value]
        else:
            raise ValueError(f"alertmanager.yml route key {key!r} has no AlertmanagerConfig "
                             "equivalent in deploy/monitoring.py")
    return out


def _receiver(receiver: dict[str, Any]) -> dict[str, Any]:
    name = receiver["name"]
    hooks = receiver.get("webhook_configs", [])
    if set(receiver) - {"name", "webhook_configs"}:
        raise ValueError(f"receiver {name!r}: only webhook_configs are translated")
    return {"name": name, "webhookConfigs": [
        {"urlSecret": {"name": RECEIVER_SECRET, "key": f"{name}-url"},
         "sendResolved": bool(h.get("send_resolved", True))} for h in hooks]}


def alertmanager_config(source: Path = ALERTMANAGER_EXAMPLE) -> dict[str, Any]:
    """The AlertmanagerConfig for the routes, inhibit rules and receivers of ``source``
    (``global`` settings have no place in a namespaced AlertmanagerConfig)."""
    am = yaml.safe_load(source.read_text())
    inhibit = [{"sourceMatch": [parse_matcher(m) for m in r["source_matchers"]],
                "targetMatch": [parse_matcher(m) for m in r["target_matchers"]],
                "equal": list(r.get("equal", []))} for r in am.get("inhibit_rules", [])]
    return {
        "apiVersion": "monitoring.coreos.com/v1alpha1",
        "kind": "AlertmanagerConfig",
        "metadata": meta(NAME),
        "spec": {"route": _route(am["route"]),
                 "receivers": [_receiver(r) for r in am["receivers"]],
                 "inhibitRules": inhibit},
    }


def receiver_keys(source: Path = ALERTMANAGER_EXAMPLE) -> list[str]:
    """The Secret keys the AlertmanagerConfig reads (one webhook URL per receiver)."""
    return [f"{r['name']}-url" for r in yaml.safe_load(source.read_text())["receivers"]]


def dashboards_config_map() -> dict[str, Any]:
    """Every generated dashboard, keyed ``kv-sidecar-<name>.json``, as the exact text
    ``python -m dashboards.generate`` writes."""
    from dashboards import generate as dashboards

    data = {f"{NAME}-{dashboards.json_path(src).name}": dashboards.render(src)
            for src in dashboards.sources()}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": meta(f"{NAME}-dashboards", **GRAFANA_LABEL), "data": data}
