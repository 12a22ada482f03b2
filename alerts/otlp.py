"""OTLP push health (sidecar/export/otlp_failures.py, issue 21): a receiver that keeps refusing the
push loses every pushed value while the sidecar itself looks calm (Prometheus still scrapes
it), so failed batches warn like failing hooks do: any in the event window, for 15m."""

from __future__ import annotations

from alerts.rule_parts import _COUNT, _Q, _WHERE, WARNING, Alert, MixinConfig, Recording, _name
from sidecar import signals as S

OTLP_FAILURES_RECENT = _name("instance_signal_reason", S.OTLP_EXPORT_FAILURES, "increase10m")


def recording_rules(cfg: MixinConfig) -> list[Recording]:
    return [Recording(OTLP_FAILURES_RECENT,
                      _Q(cfg).new_or_increased(S.OTLP_EXPORT_FAILURES, "signal, reason"))]


def alert_rules(cfg: MixinConfig) -> list[Alert]:
    return [Alert(
        "KVSidecarOtlpExportFailing", f"{OTLP_FAILURES_RECENT} > 0", "15m", WARNING,
        "kv-sidecar's OTLP push is failing ({{ $labels.signal }}: {{ $labels.reason }}).",
        f"{_COUNT} OTLP {{{{ $labels.signal }}}} batch(es) were not taken by the receiver "
        f"({{{{ $labels.reason }}}}) in the last {cfg.event_window} {_WHERE}: what the "
        "OTLP backend shows of this sidecar is stale or missing. Verification goes on.")]
