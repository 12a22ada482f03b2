"""The background scrub's alert (sidecar/checks/scrub.py): a scrub that stops completing passes
is silent otherwise: idle entries go unverified while every other signal looks calm."""

from __future__ import annotations

from alerts.rule_parts import _Q, _WHERE, WARNING, Alert, MixinConfig, duration
from sidecar import signals as S
from sidecar.signals import THRESHOLDS


def alert_rules(cfg: MixinConfig) -> list[Alert]:
    t = THRESHOLDS
    last = _Q(cfg).sel(S.SCRUB_LAST_PASS)
    return [Alert(
        "KVSidecarScrubOverdue",
        f"(time() - {last} > {t.scrub_pass_overdue_seconds:g}) and {last} > 0", "15m",
        WARNING,
        "kv-sidecar's background scrub is overdue ({{ $labels.instance }}).",
        f"No background scrub pass has completed for {{{{ $value | humanizeDuration }}}} "
        f"{_WHERE} (threshold {duration(t.scrub_pass_overdue_seconds)}): cache entries "
        "nobody hits are not being re-verified. The scrub is skipped under load, starved "
        "by its recompute budget, or stuck.")]
