"""kv-sidecar's recording and alerting rules, built from :mod:`sidecar.signals`.

Metric names and thresholds come only from the signals module, so renaming a metric or
moving a threshold regenerates the rules (``python -m alerts.generate``) instead of leaving
a silently dead alert behind. The shape follows the kubernetes-mixin habits: one config of
selectors and windows, recording rules named ``level:metric:operations`` that aggregate the
numerator and the denominator separately, and alerts that all carry ``for:``, a severity, a
summary, a templated description and a runbook URL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from sidecar import signals as S
from sidecar.signals import THRESHOLDS, Signal

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


def _core_recording_rules(cfg: MixinConfig) -> list[Recording]:
    q = _Q(cfg)
    w = cfg.rate_window
    p99 = ("histogram_quantile(0.99, sum by ({by}, le) "
           "(rate({sel}[{w}])))")
    bucket = q.sel(R, "_bucket")
    on = f"on ({q.by}) group_left"
    return [
        Recording(LOOKUPS_RATE, q.rate(S.LOOKUPS, w)),
        Recording(HITS_RATE, q.rate(S.HITS, w)),
        # Exposure: the share of requests whose prompt reused cached KV.
        Recording(LOOKUP_HIT_RATIO, f"{HITS_RATE}\n/\n{LOOKUPS_RATE}"),
        Recording(QUERY_TOKENS_RATE, q.rate(S.QUERY_TOKENS, w)),
        Recording(HIT_TOKENS_RATE, q.rate(S.HIT_TOKENS, w)),
        # Efficiency, the hit rate engines report (vLLM's prefix-cache hit rate): prompt
        # tokens served from cache / tokens looked up.
        Recording(TOKEN_HIT_RATIO, f"{HIT_TOKENS_RATE}\n/\n{QUERY_TOKENS_RATE}"),
        Recording(VERIFIED_RATE, q.rate(S.VERIFIED, w)),
        Recording(ANOMALIES_RATE, q.rate(S.ANOMALIES, w)),
        # Fraction of verified blocks that were wrong: the fleet view's ranking key.
        Recording(ANOMALY_RATIO, f"{ANOMALIES_RATE}\n/\n{VERIFIED_RATE}"),
        Recording(ANOMALIES_RECENT, q.new_or_increased(S.ANOMALIES, "group, kind")),
        Recording(ALLOCATIONS_RATE, q.rate(S.ALLOCATIONS, w)),
        Recording(ALLOC_FAILURES_RATE, q.rate(S.ALLOCATION_FAILURES, w)),
        Recording(ALLOC_FAILURE_RATIO, f"{ALLOC_FAILURES_RATE}\n/\n{ALLOCATIONS_RATE}"),
        Recording(SAMPLED_RATE, q.rate(S.SAMPLED, w)),
        Recording(DROPPED_RATE, q.rate(S.SAMPLES_DROPPED, w, extra_by="reason")),
        Recording(DROPPED_RATIO, f"{DROPPED_RATE}\n/ {on}\n{SAMPLED_RATE}"),
        Recording(REQUESTS_RATE, q.rate(R, w, suffix="_count")),
        # ">= 0" drops the NaN of an idle window, so idle hours do not poison the baseline.
        Recording(P99_RATE, p99.format(by=q.by, sel=bucket, w=w) + " >= 0"),
        # The baseline is the median over the last day of the 5m P99: a regression has to
        # last half a day before it becomes the baseline (a P99 over a 1d window of buckets
        # would absorb it after ~1% of the day, i.e. before a 15m `for:` elapsed).
        Recording(P99_BASELINE,
                  f"quantile_over_time(0.5, {P99_RATE}[{cfg.baseline_window}])"),
        Recording(INVARIANTS_RECENT, q.new_or_increased(S.INVARIANT_VIOLATIONS, "kind")),
        *_fleet().recording_rules(cfg),
        Recording(HIT_AUDIT_RECENT, q.new_or_increased(S.HIT_AUDIT_MISMATCHES, "kind")),
        Recording(HOOK_ERRORS_RECENT, q.new_or_increased(S.HOOK_ERRORS, "hook")),
        Recording(ADAPTER_ERRORS_RECENT, q.new_or_increased(S.ADAPTER_ERRORS, "op, reason")),
        *_recovery_rules(cfg, q),
    ]


def _recovery_rules(cfg: MixinConfig, q: _Q) -> list[Recording]:
    """Offload-tier recoveries: loads by outcome, the failed share, the P99 load time."""
    w = cfg.rate_window
    failed = (f"sum by ({q.by}) (rate({S.RECOVERIES.name}{{{cfg.selector}, "
              f'outcome="{S.RecoveryOutcome.FAILED.value}"}}[{w}]))')
    return [
        Recording(RECOVERIES_RATE, q.rate(S.RECOVERIES, w, extra_by="outcome")),
        Recording(RECOVERY_FAILURE_RATIO, f"{failed}\n/\n{q.rate(S.RECOVERIES, w)}"),
        Recording(RECOVERY_P99, f"histogram_quantile(0.99, sum by ({q.by}, le) "
                                f"(rate({q.sel(S.RECOVERY_DURATION, '_bucket')}[{w}]))) >= 0"),
    ]


def _fleet() -> ModuleType:
    """alerts.fleet builds on this module's names, so it is imported when rules are built."""
    from alerts import fleet

    return fleet


_ALARM_KINDS = "|".join(k.value for k in S.AUDIT_ALARM_KINDS)
_WHERE = "on {{ $labels.instance }} ({{ $labels.engine }}, {{ $labels.model }})"
_COUNT = '{{ printf "%.0f" $value }}'
_PCT = "{{ $value | humanizePercentage }}"


def _core_alert_rules(cfg: MixinConfig) -> list[Alert]:
    q = _Q(cfg)
    t = THRESHOLDS
    by = q.by
    ew = cfg.event_window
    stale = duration(t.verification_stale_seconds)
    return [
        Alert(S.ALERT_CONTENT_ANOMALY, f"{ANOMALIES_RECENT} > 0", "1m", PAGE,
              "KV cache hits are serving wrong KV ({{ $labels.kind }}).",
              f"{_COUNT} sampled KV block(s) of cache group {{{{ $labels.group }}}} failed "
              f"the {{{{ $labels.kind }}}} check in the last {ew} {_WHERE}. Every sampled "
              "anomaly stands for about sample_every unverified hits served the same way."),
        Alert(S.ALERT_HIGH_HIT_RATE_WITH_ANOMALIES,
              f"{LOOKUP_HIT_RATIO} >= {t.hit_rate_low:g}\nand on ({by})\n"
              f"sum by ({by}) ({ANOMALIES_RECENT}) > 0", "1m", PAGE,
              "Hit rate looks healthy while the cache serves wrong KV.",
              f"{_PCT} of lookups hit the prefix cache {_WHERE} while content anomalies were "
              f"found in the last {ew}: most requests reuse cached KV, and it holds wrong "
              "KV."),
        Alert("KVCacheInvariantViolation", f"{INVARIANTS_RECENT} > 0", "1m", PAGE,
              "The KV block allocator broke an invariant ({{ $labels.kind }}).",
              f"{_COUNT} allocator invariant violation(s) of kind {{{{ $labels.kind }}}} in "
              f"the last {ew} {_WHERE}: a block is shared, freed or indexed in a way that "
              "lets one request read another request's KV."),
        Alert("KVCacheLeakSuspected",
              f"max by ({by}) ({q.sel(S.LEAK_SUSPECTED_FLAG)}) > 0", "5m", WARNING,
              "KV blocks are leaking.",
              f"The allocator holds block references that no live sequence holds, and their "
              f"number only grows {_WHERE}: the free pool will drain and allocations fail."),
        Alert("KVCacheAllocationFailuresHigh",
              f"{ALLOC_FAILURE_RATIO} > {t.allocation_failure_rate:g}", "5m", WARNING,
              "KV block allocations are failing.",
              f"{_PCT} of KV block allocations failed over the last {cfg.rate_window} "
              f"{_WHERE} (threshold {percent(t.allocation_failure_rate)})."),
        Alert("KVCacheUsageHigh",
              f"max by ({by}) ({q.sel(S.USAGE_RATIO)}) > {t.usage_ratio:g}", "15m", WARNING,
              "KV cache pool is nearly full.",
              f"{_PCT} of KV blocks are held by live sequences {_WHERE} "
              f"(threshold {percent(t.usage_ratio)})."),
        Alert("KVCacheFragmentationHigh",
              f"max by ({by}) ({q.sel(S.FRAGMENTATION_RATIO)}) > {t.fragmentation_ratio:g}",
              "15m", WARNING, "KV cache free space is fragmented.",
              f"Fragmentation is {_PCT} {_WHERE}: free blocks exist but not in usable runs "
              f"(threshold {percent(t.fragmentation_ratio)})."),
        Alert("KVCacheHitRateLow", f"{TOKEN_HIT_RATIO} < {t.hit_rate_low:g}", "15m", WARNING,
              "KV cache token hit rate is low.",
              f"Token hit rate is {_PCT} over the last {cfg.rate_window} {_WHERE} "
              f"(threshold {percent(t.hit_rate_low)})."),
        Alert("KVCacheLatencyP99High",
              f"(\n  {P99_RATE}\n/\n  {P99_BASELINE}\n) > {t.p99_latency_baseline_factor:g}\n"
              f"and on ({by})\n{REQUESTS_RATE} > {cfg.latency_min_requests_per_second:g}",
              "15m", WARNING, "P99 request latency is well above its baseline.",
              f'P99 request latency over {cfg.rate_window} is {{{{ printf "%.1f" $value }}}}x '
              f"its {cfg.baseline_window} baseline {_WHERE} "
              f"(threshold {t.p99_latency_baseline_factor:g}x)."),
        Alert("KVSidecarVerificationStalled",
              f"sum by ({by}) (increase({q.sel(S.HITS)}[{stale}])) "
              f"> {t.verification_stall_min_hits:g}\nunless on ({by})\n"
              f"(time() - max by ({by}) ({q.sel(S.LAST_VERIFICATION)}) "
              f"< {t.verification_stale_seconds:g})",
              "5m", WARNING, "KV cache verification has stopped while hits flow.",
              f"No KV verification completed in the last {stale} {_WHERE} while {_COUNT} "
              "cache hits were served: the sidecar is blind, and silence is not health."),
        Alert("KVSidecarSamplesDropped",
              f"{DROPPED_RATIO} > {t.samples_dropped_ratio:g}", "15m", WARNING,
              "kv-sidecar is dropping sampled hits ({{ $labels.reason }}).",
              f"{_PCT} of sampled hits were dropped unverified with reason "
              f"{{{{ $labels.reason }}}} over the last {cfg.rate_window} {_WHERE} "
              f"(threshold {percent(t.samples_dropped_ratio)})."),
        # Calibrated tolerance (sidecar/checks/calibration.py): the errors moved off their floor.
        Alert("KVCacheRecomputeErrorDrift",
              f"max by ({by}, reference, dtype) ({q.sel(S.RECOMPUTE_ERROR_DRIFT)}) "
              f"> {t.recompute_error_drift:g}", "15m", WARNING,
              "Recompute errors drifted away from their calibrated noise floor.",
              f'Recent recompute errors against the {{{{ $labels.reference }}}} reference in '
              f'{{{{ $labels.dtype }}}} are {{{{ printf "%.1f" $value }}}}x the calibrated '
              f"noise floor {_WHERE} (threshold {t.recompute_error_drift:g}x): the cache's "
              "KV is moving away from a correct recompute, though no block has failed its "
              "tolerance yet."),
        # Silence is not health: a hook or adapter that keeps failing blinds the sidecar
        # while every other signal looks calm.
        Alert("KVSidecarHookErrors", f"{HOOK_ERRORS_RECENT} > 0", "5m", WARNING,
              "kv-sidecar hooks are failing ({{ $labels.hook }}).",
              f"{_COUNT} exception(s) were caught in the {{{{ $labels.hook }}}} hook in the "
              f"last {ew} {_WHERE}. The engine was not affected, but the events of that hook "
              "are not counted or verified: the sidecar is partly blind."),
        Alert("KVSidecarAdapterErrors", f"{ADAPTER_ERRORS_RECENT} > 0", "15m", WARNING,
              "kv-sidecar adapter calls are failing ({{ $labels.op }}, {{ $labels.reason }}).",
              f"{_COUNT} {{{{ $labels.op }}}} call(s) to the engine adapter failed with "
              f"{{{{ $labels.reason }}}} in the last {ew} {_WHERE}: samples that needed them "
              "were dropped unverified."),
        Alert("KVSidecarDown", f"up{{{cfg.selector}}} == 0", "5m", WARNING,
              "kv-sidecar cannot be scraped.",
              "Prometheus has failed to scrape {{ $labels.instance }} of job "
              "{{ $labels.job }} for 5m: KV cache verification there is not visible."),
        Alert("KVSidecarAbsent", f"absent({q.sel(S.BUILD_INFO)})", "15m", WARNING,
              "No kv-sidecar is being scraped.",
              f"No {S.BUILD_INFO.name} series of job {{{{ $labels.job }}}} has been scraped "
              "for 15m: KV cache verification is not running, or Prometheus lost its targets."),
        *_fleet().alert_rules(cfg),
        Alert("KVCacheHitCounterMismatch",
              f"{HIT_AUDIT_RECENT}{{kind=~\"{_ALARM_KINDS}\"}} > 0", "5m", WARNING,
              "The server's reported cache hits contradict the canary ({{ $labels.kind }}).",
              f"{_COUNT} canary probe(s) in the last {ew} {_WHERE} found the server's own "
              "hit counters wrong ({{ $labels.kind }}): its reported hit rate cannot be "
              "trusted for capacity, cost or cache-health decisions."),
        # Hybrid caches: the offload tier's loads (recoveries), from on_tier.
        Alert("KVCacheRecoveryFailures",
              f"{RECOVERY_FAILURE_RATIO} > {t.recovery_failure_ratio:g}", "10m", WARNING,
              "Offload-tier loads (recoveries) are failing.",
              f"{_PCT} of offload-tier loads failed over the last {cfg.rate_window} {_WHERE} "
              f"(threshold {percent(t.recovery_failure_ratio)}): those hits must be "
              "recomputed, and a failed load served as a hit is wrong KV "
              "(tier_not_loaded anomalies)."),
        Alert("KVCacheRecoveryLatencyHigh",
              f"{RECOVERY_P99} > {t.recovery_p99_seconds:g}", "15m", WARNING,
              "Offload-tier loads (recoveries) are slow.",
              f'P99 offload-tier load time over {cfg.rate_window} is '
              f'{{{{ printf "%.2f" $value }}}}s {_WHERE} '
              f"(threshold {t.recovery_p99_seconds:g}s): hits served from the tier wait on "
              "it, and a slow copy back widens the window for partial loads."),
    ]


def rule_groups(cfg: MixinConfig | None = None) -> dict[str, object]:
    """The rule file as a YAML-ready document."""
    cfg = cfg or MixinConfig()
    records = [{"record": r.record, "expr": r.expr} for r in recording_rules(cfg)]
    alerts = []
    for a in alert_rules(cfg):
        alerts.append({
            "alert": a.name,
            "expr": a.expr,
            "for": a.for_,
            "labels": {"severity": a.severity, **a.extra_labels},
            "annotations": {
                "summary": a.summary,
                "description": a.description,
                "runbook_url": f"{cfg.runbook_base_url}{a.name}.md",
            },
        })
    return {"groups": [
        {"name": "kv-sidecar.rules", "rules": records},
        {"name": "kv-sidecar.alerts", "rules": alerts},
    ]}



def recording_rules(cfg: MixinConfig) -> list[Recording]:
    """Every recording rule: the core ones, then OTLP push health's (alerts/otlp.py)."""
    from alerts import otlp  # it imports this module's types

    return [*_core_recording_rules(cfg), *otlp.recording_rules(cfg)]


def alert_rules(cfg: MixinConfig) -> list[Alert]:
    """Every alert: the core ones, the background scrub's, then OTLP push health's."""
    from alerts import otlp, scrub

    return [*_core_alert_rules(cfg), *scrub.alert_rules(cfg), *otlp.alert_rules(cfg)]
