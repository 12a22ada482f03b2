"""Verdicts into signals, evidence and sampler feedback: the one place a verdict is reported,
whichever mode verified it (:mod:`sidecar.core.dispatch`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sidecar import signals as S
from sidecar.allocator import AllocatorHealth
from sidecar.checks.calibration import Calibration
from sidecar.checks.verifier import Verdict
from sidecar.core.protocol import EngineInfo
from sidecar.core.sampling import Sampler
from sidecar.core.verdict_listeners import VerdictListeners
from sidecar.evidence.record import EvidenceLog
from sidecar.export.metrics import Metrics

log = logging.getLogger(__name__)


class VerdictReporter:
    """Counts verified blocks, anomalies (one per block and kind), drops and adapter errors;
    records evidence of every anomalous verdict; tells the sampler how it went."""

    def __init__(self, metrics: Metrics, info: EngineInfo, evidence: EvidenceLog,
                 health: AllocatorHealth, sampler: Sampler, calibration: Calibration,
                 requests_done: Callable[[], int],
                 on_anomaly: Callable[[], None] = lambda: None) -> None:
        self.metrics = metrics
        self.info = info
        self.evidence = evidence
        self.health = health
        self.sampler = sampler
        self.calibration = calibration
        self._requests_done = requests_done
        self._on_anomaly = on_anomaly
        self._groups = {g.group_id: g.label for g in info.groups}
        self._group_kinds = {g.group_id: g.kind.value for g in info.groups}
        self.first_anomaly_request: int | None = None
        self.max_recompute_error = 0.0
        self.last_verification: float | None = None
        # Whatever acts on a verdict, called after it is counted, in stages, with one error
        # policy (sidecar.core.verdict_listeners): the Monitor's ``verdict_listeners`` too.
        self.listeners = VerdictListeners()

    def _group(self, group_id: int) -> str:
        # Only groups the engine described become label values: a verdict naming another
        # group (an adapter bug) is counted under one bounded "unknown" value.
        return self._groups.get(group_id, "unknown")

    def apply(self, verdict: Verdict) -> None:
        m = self.metrics
        for ref in verdict.verified:
            m.inc(S.VERIFIED, group=self._group(ref.group_id))
        seen: set[tuple[int, int, str]] = set()
        for f in verdict.findings:
            key = (f.group_id, f.block_index, f.kind.value)
            if key in seen:  # one count per block and kind
                continue
            seen.add(key)
            m.inc(S.ANOMALIES, group=self._group(f.group_id), kind=f.kind.value)
            m.inc(S.GROUP_KIND_ANOMALIES, group_kind=self._group_kinds.get(
                f.group_id, "unknown"), kind=f.kind.value)
        for reason, n in verdict.dropped.items():
            m.inc(S.SAMPLES_DROPPED, n, reason=reason.value)
        for op, why in verdict.adapter_errors:
            m.inc(S.ADAPTER_ERRORS, op=op, reason=why)
        if verdict.verified:
            now = time.time()
            m.observe(S.VERIFY_DURATION, verdict.duration_s)
            m.gauge(S.LAST_VERIFICATION).set(now)
            self.last_verification = now
        if verdict.max_error is not None:
            self.max_recompute_error = max(self.max_recompute_error, verdict.max_error)
        for group_id, err in verdict.errors:  # recompute error histogram + calibration gauges
            m.observe(S.RECOMPUTE_ERROR, min(err, S.ERROR_CAP),  # inf would poison _sum
                      group=self._group(group_id), dtype=self.calibration.dtype)
        if verdict.errors:
            self.calibration.publish(m)
        if verdict.findings:
            self._anomalous(verdict)
        try:
            self.sampler.feedback(verdict.sample.hit, verdict.anomalous)
        except Exception:
            log.exception("sampler feedback failed (ignored)")
        self.listeners.notify(verdict)

    @property
    def _listener_errors(self) -> int:
        return self.listeners.errors

    def _anomalous(self, verdict: Verdict) -> None:
        if self.first_anomaly_request is None:
            self.first_anomaly_request = self._requests_done()
        rec = self.evidence.record(verdict, self.info.engine, self.info.model,
                                   self.health.anomaly_context(verdict.sample.refs))
        self._on_anomaly()
        # The first few in full, then one line in a hundred: a broken cache must not turn
        # the log into a flood (the counters and the evidence keep every one).
        if rec["seq"] <= 5 or rec["seq"] % 100 == 0:
            log.warning("KV anomaly #%d: %s", rec["seq"], "; ".join(
                f"{f.kind.value} group={f.group_id} block#{f.block_index}: {f.detail}"
                for f in verdict.findings[:4]))
