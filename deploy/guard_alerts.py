"""The guard overlay's AlertmanagerConfig: page alerts go to the guard's webhook.

A separate object (in ``deploy/kubernetes/overlays/guard/``), not a receiver in the
monitoring one: it refers to the guard's Secret, which exists only where the guard is
deployed (the operator rejects an AlertmanagerConfig whose Secret is missing). The operator
makes each AlertmanagerConfig's route a first-level route with ``continue: true``, so pages
still reach the pager of ``monitoring/`` as well.

The webhook URL and bearer token come from the ``kv-sidecar-guard`` Secret (the URL names
the guard Service's namespace, which only the user knows; the token is the one the guard
checks on ``/guard/*``).
"""

from __future__ import annotations

from typing import Any

from deploy.monitoring import NAME, meta

GUARD_SECRET = f"{NAME}-guard"
URL_KEY = "alertmanager-url"
TOKEN_KEY = "token"
WEBHOOK_PATH = "/guard/alertmanager"


def guard_alertmanager_config() -> dict[str, Any]:
    """Pages (``severity="page"``) to the guard: the page for its engine's instance and the
    fleet-wide page for its model open its breaker (it ignores the others)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1alpha1",
        "kind": "AlertmanagerConfig",
        "metadata": meta(GUARD_SECRET),
        "spec": {
            "route": {
                "receiver": "guard",
                "matchers": [{"name": "severity", "matchType": "=", "value": "page"}],
                "groupBy": ["job", "instance", "model"],
                "groupWait": "0s",  # the guard should open as soon as the page fires
                "groupInterval": "1m",
                "repeatInterval": "5m",  # re-sent while firing: a restarted guard re-opens
            },
            "receivers": [{
                "name": "guard",
                "webhookConfigs": [{
                    "urlSecret": {"name": GUARD_SECRET, "key": URL_KEY},
                    "sendResolved": True,
                    "httpConfig": {"authorization": {
                        "type": "Bearer",
                        "credentials": {"name": GUARD_SECRET, "key": TOKEN_KEY}}},
                }],
            }],
        },
    }
