"""Write (or check) the generated deployment files: the prometheus-operator resources in
``deploy/kubernetes/monitoring/`` and the monitoring mixin in ``mixin/``.

    python -m deploy.generate          # rewrite them from alerts/, dashboards/, signals
    python -m deploy.generate --check  # exit 1 when any committed file is stale

Re-run it after ``python -m alerts.generate`` / ``python -m dashboards.generate`` (or after
changing ``alerts/alertmanager.yml``): the files are committed so that ``kubectl apply -k``
and ``jsonnet`` need no Python.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deploy import guard_alerts, mixin, monitoring
from deploy.yamlio import dump, header

REPO = Path(__file__).resolve().parent.parent
MONITORING = REPO / "deploy" / "kubernetes" / "monitoring"
GUARD = REPO / "deploy" / "kubernetes" / "overlays" / "guard"
MIXIN = REPO / "mixin"
COMMAND = "python -m deploy.generate"

_RESOURCES: dict[str, Callable[[], dict[str, Any]]] = {
    "podmonitor.yaml": monitoring.pod_monitor,
    "prometheusrule.yaml": monitoring.prometheus_rule,
    "alertmanagerconfig.yaml": monitoring.alertmanager_config,
    "dashboards.yaml": monitoring.dashboards_config_map,
}


def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    out = {MONITORING / name: header(COMMAND) + dump(build())
           for name, build in _RESOURCES.items()}
    out[GUARD / "alertmanagerconfig.yaml"] = (
        header(COMMAND) + dump(guard_alerts.guard_alertmanager_config()))
    out.update({MIXIN / rel: text for rel, text in mixin.files().items()})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail when a committed file differs from its sources")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path.relative_to(REPO)} is stale: run `{COMMAND}`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
