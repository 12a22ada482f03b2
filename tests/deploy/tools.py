"""What the deployment tests run: ``kubectl kustomize``, kubernetes-validate, check-jsonschema,
``jsonnet``, and a reading of an AlertmanagerConfig the way prometheus-operator merges it.

``make test-deploy`` installs the tools and sets ``KVSIDECAR_REQUIRE_DEPLOY_TOOLS=1``, so a
missing one fails there; elsewhere the tests that need it skip, saying how to install it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
SCHEMAS = REPO / "deploy" / "schemas"
# Every kustomization a user applies.
KUSTOMIZATIONS = ("base", "monitoring", "overlays/sglang", "overlays/guard")
# Native sidecars (an init container's restartPolicy) are on by default from 1.29; the
# newest schemas kubernetes-validate ships are the other end.
OLDEST_SUPPORTED = "1.29"
CRD_SCHEMAS = {"PodMonitor": "podmonitor.json", "PrometheusRule": "prometheusrule.json",
               "AlertmanagerConfig": "alertmanagerconfig.json"}

HINTS = {
    "kubectl": "kubectl (with kustomize) is preinstalled on this project's machines",
    "jsonnet": "apt-get install -y jsonnet",
    "check-jsonschema": "make test-deploy (installs kubernetes-validate, check-jsonschema)",
}


def require(name: str) -> str:
    """The tool's path, or skip (fail under ``make test-deploy``) with how to get it."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    reason = f"{name} not found: {HINTS.get(name, 'install it')}"
    if os.environ.get("KVSIDECAR_REQUIRE_DEPLOY_TOOLS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate as kv
    except ImportError:
        if os.environ.get("KVSIDECAR_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail("kubernetes-validate is not installed: run make test-deploy")
        pytest.skip("kubernetes-validate is not installed: run make test-deploy")
    return kv


class _Loader(yaml.SafeLoader):
    """YAML 1.2 reading of kustomize output: ``matchType: =`` is the string "=" (PyYAML's
    YAML 1.1 would make it a ``value`` tag)."""


_Loader.add_constructor("tag:yaml.org,2002:value",
                        lambda loader, node: loader.construct_scalar(node))


def load_all(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=_Loader) if d]


def kustomize(path: str | Path, root: Path = KUBE) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of ``root/path``: the objects ``kubectl apply -k`` would send."""
    kubectl = require("kubectl")
    result = subprocess.run([kubectl, "kustomize", str(root / path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {path}: {result.stderr}"
    return load_all(result.stdout)


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def check_jsonschema(objects: list[dict[str, Any]], tmp: Path) -> dict[str, str]:
    """Run check-jsonschema on each CRD object against its schema; ``{kind/name: error}``
    for the failures (empty when all pass)."""
    tool = require("check-jsonschema")
    failures = {}
    for i, obj in enumerate(o for o in objects if o["kind"] in CRD_SCHEMAS):
        doc = tmp / f"{i}-{obj['kind'].lower()}.json"
        doc.write_text(json.dumps(obj))
        result = subprocess.run([tool, "--schemafile", str(SCHEMAS / CRD_SCHEMAS[obj["kind"]]),
                                 str(doc)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            failures[f"{obj['kind']}/{obj['metadata']['name']}"] = result.stdout + result.stderr
    return failures


def core_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] not in CRD_SCHEMAS]


def pod_spec(objects: list[dict[str, Any]], name: str = "engine") -> dict[str, Any]:
    return dict(one(objects, "Deployment", name)["spec"]["template"]["spec"])


# --- AlertmanagerConfig as prometheus-operator merges it into Alertmanager's config -------
def _matcher(m: dict[str, Any]) -> str:
    op = m.get("matchType") or ("=~" if m.get("regex") else "=")
    value = str(m.get("value", "")).replace("\\", "\\\\").replace('"', '\\"')
    return f'{m["name"]}{op}"{value}"'


def _am_route(route: dict[str, Any], prefix: str) -> dict[str, Any]:
    keys = {"groupBy": "group_by", "groupWait": "group_wait", "groupInterval": "group_interval",
            "repeatInterval": "repeat_interval", "continue": "continue"}
    out: dict[str, Any] = {}
    if route.get("receiver"):
        out["receiver"] = prefix + route["receiver"]
    out.update({keys[k]: v for k, v in route.items() if k in keys})
    if route.get("matchers"):
        out["matchers"] = [_matcher(m) for m in route["matchers"]]
    if route.get("routes"):
        out["routes"] = [_am_route(r, prefix) for r in route["routes"]]
    return out


def operator_alertmanager_yaml(amc: dict[str, Any], namespace: str,
                               secret: dict[str, str]) -> dict[str, Any]:
    """The Alertmanager configuration prometheus-operator generates from one
    AlertmanagerConfig (default ``OnNamespace`` matcher strategy): receivers renamed
    ``<namespace>/<name>/<receiver>``, the resource's route a first-level route matching
    ``namespace="<namespace>"`` with ``continue: true``, the namespace matcher added to both
    sides of each inhibit rule, secrets resolved from ``secret``; a ``null`` root receiver."""
    prefix = f"{namespace}/{amc['metadata']['name']}/"
    ns = f'namespace="{namespace}"'
    spec = amc["spec"]
    route = _am_route(spec["route"], prefix)
    route["matchers"] = [ns, *route.get("matchers", [])]
    route["continue"] = True
    receivers = [{"name": "null"}]
    for r in spec["receivers"]:
        hooks = [{"url": secret[h["urlSecret"]["key"]] if "urlSecret" in h else h["url"],
                  "send_resolved": h.get("sendResolved", True)}
                 for h in r.get("webhookConfigs", [])]
        receivers.append({"name": prefix + r["name"], "webhook_configs": hooks})
    inhibit = [{"source_matchers": [ns, *map(_matcher, i.get("sourceMatch", []))],
                "target_matchers": [ns, *map(_matcher, i.get("targetMatch", []))],
                "equal": i.get("equal", [])} for i in spec.get("inhibitRules", [])]
    return {"route": {"receiver": "null", "routes": [route]}, "receivers": receivers,
            "inhibit_rules": inhibit}
