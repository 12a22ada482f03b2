"""The parts every rule module builds with: the mixin's config, the rule types, PromQL
fragments over the configured selector, recording-rule names, and description templates.

Apart from :mod:`alerts.rules` (which assembles the groups) so that the rule modules of one
job each (:mod:`alerts.fleet`, :mod:`alerts.otlp`, :mod:`alerts.scrub`) and the assembly all
build on it without importing each other in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar import signals as S
from sidecar.signals import Signal

PAGE = "page"
WARNING = "warning"


@dataclass(frozen=True)
class MixinConfig:
    """Selectors and windows: the knobs a deployment changes (thresholds live in signals)."""

    selector: str = 'job="kv-sidecar"'
    # Labels an instance-level aggregation keeps: the target plus the sidecar's base labels.
    instance_labels: tuple[str, ...] = ("job", "instance", *S.BASE_LABELS)
    rate_window: str = "5m"
    # Anomalies are rare events, not a rate: an alert keeps firing this long after the last.
    event_window: str = "10m"
    baseline_window: str = "1d"
    # Below this request rate a P99 is a handful of requests; do not compare it.
    latency_min_requests_per_second: float = 0.1
    runbook_base_url: str = (
        "https://github.com/kv-sidecar/kv-sidecar/blob/main/alerts/runbooks/")
    # A fleet: the replicas compared with each other (one model on one engine; alerts/fleet.py).
    fleet_labels: tuple[str, ...] = ("job", *S.BASE_LABELS)
    # Target labels a scrape config adds per replica, copied onto the fleet page so it can
    # name the GPU (docs/operations/fleet.md); absent ones are simply left out.
    target_labels: tuple[str, ...] = ("replica", "gpu")


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    extra_labels: dict[str, str] = field(default_factory=dict)


def duration(seconds: float) -> str:
    """A Prometheus duration for ``seconds`` (whole minutes where possible)."""
    s = int(seconds)
    if s % 3600 == 0:
        return f"{s // 3600}h"
    return f"{s // 60}m" if s % 60 == 0 else f"{s}s"


def percent(ratio: float) -> str:
    return f"{ratio * 100:g}%"


class _Q:
    """PromQL fragments over the configured selector."""

    def __init__(self, cfg: MixinConfig) -> None:
        self.cfg = cfg
        self.by = ", ".join(cfg.instance_labels)

    def sel(self, sig: Signal, suffix: str = "") -> str:
        return f"{sig.name}{suffix}{{{self.cfg.selector}}}"

    def rate(self, sig: Signal, window: str, extra_by: str = "", suffix: str = "") -> str:
        by = f"{self.by}, {extra_by}" if extra_by else self.by
        return f"sum by ({by}) (rate({self.sel(sig, suffix)}[{window}]))"

    def new_or_increased(self, sig: Signal, extra_by: str) -> str:
        """How much a labelled event counter grew over the event window, counting a series
        that was born with a value > 0 as grown by that value.

        ``increase()`` alone misses the first event of a series that did not exist before
        it (prometheus-client creates labelled children on first use). The second branch
        counts such a series only when the target was scraped in the window while the
        series was absent (fewer samples than ``build_info``), so neither a fresh
        Prometheus nor a scrape gap in front of old, non-zero counters pages anyone.
        """
        w = self.cfg.event_window
        m = self.sel(sig)
        presence = (f"sum by ({self.by}) "
                    f"(count_over_time({self.sel(S.BUILD_INFO)}[{w}]))")
        return (
            f"sum by ({self.by}, {extra_by}) (\n"
            f"    (increase({m}[{w}]) > 0)\n"
            f"  or\n"
            f"    (\n"
            f"      {m} > 0\n"
            f"      and\n"
            f"      count_over_time({m}[{w}])\n"
            f"        < on ({self.by}) group_left\n"
            f"      {presence}\n"
            f"    )\n"
            f")"
        )


def _name(level: str, sig: Signal, ops: str) -> str:
    base = sig.name[: -len("_total")] if sig.name.endswith("_total") else sig.name
    return f"{level}:{base}:{ops}"


# Recording-rule names, shared by the alerts below, the dashboards and the tests. The
# operation suffixes follow the default windows of MixinConfig.
R = S.REQUEST_LATENCY
LOOKUPS_RATE = _name("instance", S.LOOKUPS, "rate5m")
HITS_RATE = _name("instance", S.HITS, "rate5m")
LOOKUP_HIT_RATIO = _name("instance", S.HITS, "ratio_rate5m")
QUERY_TOKENS_RATE = _name("instance", S.QUERY_TOKENS, "rate5m")
HIT_TOKENS_RATE = _name("instance", S.HIT_TOKENS, "rate5m")
TOKEN_HIT_RATIO = _name("instance", S.HIT_TOKENS, "ratio_rate5m")
VERIFIED_RATE = _name("instance", S.VERIFIED, "rate5m")
ANOMALIES_RATE = _name("instance", S.ANOMALIES, "rate5m")
ANOMALY_RATIO = _name("instance", S.ANOMALIES, "ratio_rate5m")
ANOMALIES_RECENT = _name("instance_group_kind", S.ANOMALIES, "increase10m")
ALLOCATIONS_RATE = _name("instance", S.ALLOCATIONS, "rate5m")
ALLOC_FAILURES_RATE = _name("instance", S.ALLOCATION_FAILURES, "rate5m")
ALLOC_FAILURE_RATIO = _name("instance", S.ALLOCATION_FAILURES, "ratio_rate5m")
SAMPLED_RATE = _name("instance", S.SAMPLED, "rate5m")
DROPPED_RATE = _name("instance_reason", S.SAMPLES_DROPPED, "rate5m")
DROPPED_RATIO = _name("instance_reason", S.SAMPLES_DROPPED, "ratio_rate5m")
REQUESTS_RATE = f"instance:{R.name}_count:rate5m"
P99_RATE = _name("instance", R, "p99_rate5m")
P99_BASELINE = _name("instance", R, "p99_rate5m_median1d")
INVARIANTS_RECENT = _name("instance_kind", S.INVARIANT_VIOLATIONS, "increase10m")
# The sidecar's own failures: exceptions caught in engine hooks, failed adapter calls.
HOOK_ERRORS_RECENT = _name("instance_hook", S.HOOK_ERRORS, "increase10m")
ADAPTER_ERRORS_RECENT = _name("instance_op_reason", S.ADAPTER_ERRORS, "increase10m")
# The black-box canary's hit-counter audit (sidecar/canary).
HIT_AUDIT_RECENT = _name("instance_kind", S.HIT_AUDIT_MISMATCHES, "increase10m")
# Hybrid caches: offload-tier recoveries (loads) reported through on_tier.
RECOVERIES_RATE = _name("instance_outcome", S.RECOVERIES, "rate5m")
RECOVERY_FAILURE_RATIO = _name("instance", S.RECOVERIES, "failed_ratio_rate5m")
RECOVERY_P99 = _name("instance", S.RECOVERY_DURATION, "p99_rate5m")


# Description templates shared by the rule modules.
_ALARM_KINDS = "|".join(k.value for k in S.AUDIT_ALARM_KINDS)
_WHERE = "on {{ $labels.instance }} ({{ $labels.engine }}, {{ $labels.model }})"
_COUNT = '{{ printf "%.0f" $value }}'
_PCT = "{{ $value | humanizePercentage }}"
