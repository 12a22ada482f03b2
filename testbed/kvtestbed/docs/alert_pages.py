"""The alert list and the runbook copies, from ``alerts/``.

Runbooks stay beside the alerts (``alerts/runbooks/NAME.md``, where each rule's
``runbook_url`` points); MkDocs only builds pages inside ``docs/``, so the site carries
generated copies in ``docs/operations/runbooks/``, and the alert table links each alert to its
copy. The table is read from the generated rule file, so it lists exactly what Prometheus loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvtestbed.docs.code_tables import md_table

RULES = "alerts/kv-sidecar.rules.yml"
RUNBOOKS = "alerts/runbooks"
RUNBOOK_COPIES = "docs/operations/runbooks"


def alert_rules(root: Path) -> list[dict[str, Any]]:
    """Every alerting rule of the shipped rule file, in file order."""
    doc = yaml.safe_load((root / RULES).read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def alerts_table(root: Path) -> str:
    rows = []
    for rule in alert_rules(root):
        name = rule["alert"]
        book = (f"[runbook](runbooks/{name}.md)" if (root / RUNBOOKS / f"{name}.md").exists()
                else "**no runbook**")
        rows.append((f"`{name}`", rule["labels"]["severity"], rule.get("for", "0s"),
                     rule["annotations"]["summary"], book))
    return md_table(("alert", "severity", "for", "summary", "runbook"), rows)


def runbook_names(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / RUNBOOKS).glob("*.md"))


def runbook_copy(root: Path, name: str) -> str:
    """A runbook as the site shows it: the file beside the alert, unchanged below a line that
    says where it lives."""
    text = (root / RUNBOOKS / f"{name}.md").read_text()
    return (f"<!-- A copy of {RUNBOOKS}/{name}.md (where the alert's runbook_url points), made "
            "by `python -m kvtestbed.docs`: edit that file. -->\n"
            + text)
