"""``/healthz``: is the sidecar actually watching, not just "is the process up".

A verifier thread killed by an adapter, a dead event subscriber or a wedged poller used to
leave ``/healthz`` answering ``ok`` while nothing was verified. :func:`monitor_health` checks
that each thread the sidecar relies on is alive and that verification keeps progressing:
samples waiting while nothing was verified for ``stall_s`` is a stall.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.core.monitor import Monitor


def monitor_health(monitor: Monitor, parts: Mapping[str, Callable[[], bool]] | None = None,
                   stall_s: float | None = None, verifier: bool = True) -> dict[str, Any]:
    """``{"ok": bool, "checks": {name: bool}, ...}``. ``parts``: further liveness checks
    (the vLLM event subscriber, the probe receiver). ``verifier``: whether the Monitor's own
    worker must run (not where an owner verifies on demand)."""
    h = monitor.health()
    checks: dict[str, bool] = {}
    if verifier:
        checks["verifier_thread"] = bool(h["verifier_alive"])
    checks["allocator_poller"] = bool(h["poller_alive"])
    checks["cache_event_journal"] = bool(h["journal_alive"])
    for name, alive in (parts or {}).items():
        try:
            checks[name] = bool(alive())
        except Exception:
            checks[name] = False
    stall = stall_s if stall_s is not None else 10 * monitor.config.adapter_timeout_s + 30
    pending = int(h["pending_samples"])
    last = h["last_verification"] or 0.0
    idle_for = time.time() - max(last, float(h["watching_since"]))
    checks["verification_progressing"] = pending == 0 or idle_for < stall
    # Said, not failed: a wedged engine call is the engine's state, and a liveness probe
    # restarting the sidecar for it would not unwedge it (the alert on
    # adapter_errors{reason="refused"}, KVSidecarAdapterErrors, warns of it).
    degraded = list(h.get("allocator_degraded", ()))
    return {"ok": all(checks.values()), "checks": checks, "degraded": degraded,
            "pending_samples": pending,
            "seconds_since_verification": round(time.time() - last, 3) if last else None}
