"""The canary's signals: the in-process sidecar's names with ``engine="canary"``, plus the
canary-only block of :mod:`sidecar.signals` (probe latency, divergence, tolerance, errors,
hit-audit mismatches).

Mapping, so dashboards and alerts read the same way for both: every canary request is a
lookup (its prompt tokens are query tokens); a request the server reports cached tokens
for is a hit (those tokens are hit tokens, as the server says); each compared pair is one
sampled and verified hit; a pair over tolerance is a ``recompute_mismatch`` anomaly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sidecar import signals as S
from sidecar.canary.client import Completion
from sidecar.canary.hit_audit import PairAudit
from sidecar.export.metrics import Metrics
from sidecar.signals import AnomalyKind, AuditKind

ENGINE = "canary"
GROUP = "0"  # a black box shows no cache groups: one logical group


class CanaryExporter:
    def __init__(self, model: str, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics(ENGINE, model)
        self.metrics.register(S.CANARY_SIGNALS)  # the canary's own signals

    def request(self, role: str, c: Completion) -> None:
        m = self.metrics
        m.inc(S.LOOKUPS)
        m.inc(S.QUERY_TOKENS, c.prompt_tokens)
        if c.cached_tokens:
            m.inc(S.HITS)
            m.inc(S.HIT_TOKENS, c.cached_tokens)
        m.observe(S.CANARY_PROBE_LATENCY, c.latency_s, role=role)
        m.observe(S.REQUEST_LATENCY, c.latency_s)

    def verdict(self, divergence: float, tolerance: float, anomalous: bool,
                duration_s: float) -> None:
        m = self.metrics
        m.inc(S.SAMPLED)
        m.inc(S.VERIFIED, group=GROUP)
        if anomalous:
            m.inc(S.ANOMALIES, group=GROUP, kind=AnomalyKind.RECOMPUTE_MISMATCH.value)
        m.gauge(S.CANARY_LOGPROB_DIVERGENCE).set(divergence)
        m.gauge(S.CANARY_TOLERANCE).set(tolerance)
        m.observe(S.VERIFY_DURATION, duration_s)
        m.gauge(S.LAST_VERIFICATION).set(time.time())

    def audit(self, result: PairAudit | None, extra: Iterable[AuditKind] = ()) -> None:
        kinds = [*(result.mismatches if result else ()), *extra]
        for kind in kinds:
            self.metrics.inc(S.HIT_AUDIT_MISMATCHES, kind=kind.value)

    def error(self, reason: str) -> None:
        self.metrics.inc(S.CANARY_ERRORS, reason=reason)
