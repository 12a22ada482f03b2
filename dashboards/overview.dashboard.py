"""kv-sidecar overview: is the KV cache serving the right KV, and is anyone checking?

The first row puts the hit rate and the content-anomaly rate side by side: a 98% hit rate
over all-zero blocks must be visible at a glance. Then: which check fails and where, how
much is being verified, the allocator, latency, and a fleet view that ranks instances by
anomaly rate to spot one bad GPU among many.

Generated to ``overview.json`` by ``python -m dashboards.generate``.
"""

from __future__ import annotations

from grafanalib.core import Dashboard, Time

from alerts.fleet import INSTANCE_ANOMALY_SHARE
from alerts.rules import P99_BASELINE
from dashboards.common import (
    RANGE,
    SELECTOR,
    layout,
    quantile,
    rate,
    ratio,
    sel,
    stat,
    steps,
    table,
    templating,
    timeseries,
)
from sidecar import signals as S
from sidecar.signals import THRESHOLDS as T

# "Any anomaly is red": Grafana colours a step from its value upwards, so the red step sits
# just above zero.
ANY = 1e-9

lookup_hit_rate = ratio(S.HITS, S.LOOKUPS)
token_hit_rate = ratio(S.HIT_TOKENS, S.QUERY_TOKENS)
anomaly_rate = ratio(S.ANOMALIES, S.VERIFIED)
age = f"time() - max({sel(S.LAST_VERIFICATION)})"

headline = [
    (stat("Hit rate", "Lookups that hit the prefix cache, and prompt tokens served from "
          "it. A hit rate says a key was found, not that the KV behind it is right: read it "
          "next to the content-anomaly rate.", "percentunit",
          [(lookup_hit_rate, "lookups"), (token_hit_rate, "tokens")],
          steps("red", (T.hit_rate_low, "green")), decimals=1), 6, 4),
    (stat("Content-anomaly rate", "Verified KV blocks that failed a check (zeros, NaN, "
          "recompute mismatch, ...) / verified blocks. Anything above zero means hits are "
          "serving wrong KV.", "percentunit", [(anomaly_rate, "anomalous / verified")],
          steps("green", (ANY, "red")), decimals=2), 6, 4),
    (stat("Anomalies in range", "Content anomalies found over the dashboard's time range.",
          "short", [(f"sum(increase({sel(S.ANOMALIES)}[{RANGE}]))", "anomalies")],
          steps("green", (ANY, "red")), decimals=0), 6, 4),
    (stat("Last verification", "Seconds since the most recent completed verification. "
          "Silence is not health: a stale value while hits flow means nobody is checking.",
          "s", [(age, "age")], steps("green", (T.verification_stale_seconds, "orange"))),
     6, 4),
    (timeseries("Hit rate", "Per instance, by lookups and by prompt tokens. The line marks "
                "the hit-rate threshold (low-hit-rate warning on tokens; the page for "
                "anomalies behind a high hit rate on lookups).", "percentunit",
                [(ratio(S.HITS, S.LOOKUPS, "instance"), "lookups {{instance}}"),
                 (ratio(S.HIT_TOKENS, S.QUERY_TOKENS, "instance"), "tokens {{instance}}")],
                steps("red", (T.hit_rate_low, "green"))), 12, 8),
    (timeseries("Content-anomaly rate", "Anomalous / verified blocks, per instance.",
                "percentunit",
                [(ratio(S.ANOMALIES, S.VERIFIED, "instance"), "{{instance}}")],
                steps("green", (ANY, "red"))), 12, 8),
]

anomalies = [
    (timeseries("Anomalies by kind", "Which check failed: the kind names the fault family "
                "(see the KVCacheContentAnomaly runbook).", "cps",
                [(rate(S.ANOMALIES, "kind"), "{{kind}}")]), 12, 8),
    (timeseries("Anomalies by cache group", "Which cache group (full attention, sliding "
                "window, ...) holds the wrong KV.", "cps",
                [(rate(S.ANOMALIES, "instance, group"), "{{instance}} {{group}}")]), 12, 8),
    # Calibrated tolerance (sidecar/checks/calibration.py).
    (timeseries("Recompute error vs tolerance", "Normalized recompute error of verified "
                "blocks (P50/P99 from the histogram) under the tolerance in use and the "
                "calibrated noise floor, per reference kind and dtype.", "none",
                [(quantile(0.5, S.RECOMPUTE_ERROR, "dtype"), "P50 {{dtype}}"),
                 (quantile(0.99, S.RECOMPUTE_ERROR, "dtype"), "P99 {{dtype}}"),
                 (f"max by (reference, dtype) ({sel(S.RECOMPUTE_TOLERANCE)})",
                  "tolerance {{reference}} {{dtype}}"),
                 (f"max by (reference, dtype) ({sel(S.RECOMPUTE_NOISE_FLOOR)})",
                  "floor {{reference}} {{dtype}}")]), 12, 8),
    (timeseries("Recompute-error drift", "Recent error quantile / calibrated noise floor; "
                "the line is the drift alert's threshold (KVCacheRecomputeErrorDrift).",
                "none", [(f"max by (instance, reference, dtype) "
                          f"({sel(S.RECOMPUTE_ERROR_DRIFT)})",
                          "{{instance}} {{reference}} {{dtype}}")],
                steps("green", (T.recompute_error_drift, "orange"))), 12, 8),
]

coverage = [
    (timeseries("Verified blocks/s", "Sampled blocks whose verification completed, by "
                "cache group.", "cps", [(rate(S.VERIFIED, "group"), "{{group}}")]), 6, 8),
    (timeseries("Sampled and dropped hits/s", "Hits chosen for verification, and those "
                "dropped unverified by reason (queue full, budget, adapter errors).", "cps",
                [(rate(S.SAMPLED), "sampled"),
                 (rate(S.SAMPLES_DROPPED, "reason"), "dropped: {{reason}}")]), 6, 8),
    (timeseries("Age of the last verification", "Seconds since each instance last "
                "completed a verification; the line is the stall threshold.", "s",
                [(f"time() - max by (instance) ({sel(S.LAST_VERIFICATION)})", "{{instance}}")],
                steps("green", (T.verification_stale_seconds, "orange"))), 6, 8),
    (timeseries("Verification time", "Time to verify one sampled hit (read, checks, "
                "recompute).", "s",
                [(quantile(0.5, S.VERIFY_DURATION), "P50"),
                 (quantile(0.99, S.VERIFY_DURATION), "P99")]), 6, 8),
]

allocator = [
    (timeseries("Allocation-failure rate", "Failed block allocations / attempts.",
                "percentunit", [(ratio(S.ALLOCATION_FAILURES, S.ALLOCATIONS, "instance"),
                                 "{{instance}}")],
                steps("green", (T.allocation_failure_rate, "red"))), 8, 8),
    (timeseries("Usage", "Blocks held by live sequences / total blocks.", "percentunit",
                [(f"max by (instance) ({sel(S.USAGE_RATIO)})", "{{instance}}")],
                steps("green", (T.usage_ratio, "orange"))), 8, 8),
    (timeseries("Fragmentation", "External: 1 - largest free run / free blocks. Internal: "
                "unused token slots in held blocks.", "percentunit",
                [(f"max by (instance) ({sel(S.FRAGMENTATION_RATIO)})",
                  "external {{instance}}"),
                 (f"max by (instance) ({sel(S.INTERNAL_FRAGMENTATION_RATIO)})",
                  "internal {{instance}}")],
                steps("green", (T.fragmentation_ratio, "orange"))), 8, 8),
    (timeseries("Blocks by state", "Pool blocks: free, cached (reusable prefix), used, "
                "total; leaked: held references no live sequence holds.", "short",
                [(f"sum by (state) ({sel(S.BLOCKS)})", "{{state}}"),
                 (f"sum({sel(S.LEAK_SUSPECTED)})", "leaked references")]), 12, 8),
    (timeseries("Allocator invariant violations", "Broken invariants (a free block still "
                "indexed, a ref count below its holders): each is a corruption in waiting.",
                "cps", [(rate(S.INVARIANT_VIOLATIONS, "kind"), "{{kind}}")],
                steps("green", (ANY, "red"))), 12, 8),
]

latency = [
    (timeseries("Request latency", "End-to-end request latency from the histogram; the "
                "baseline is the recorded median of the day's 5m P99.", "s",
                [(quantile(0.5, S.REQUEST_LATENCY), "P50"),
                 (quantile(0.99, S.REQUEST_LATENCY), "P99"),
                 (f"max({P99_BASELINE}{{{SELECTOR}}})", "P99 baseline")]), 16, 8),
    (timeseries("Requests/s", "Completed requests per second.", "reqps",
                [(rate(S.REQUEST_LATENCY, "instance", suffix="_count"), "{{instance}}")]),
     8, 8),
]

by_instance_anomaly_rate = ratio(S.ANOMALIES, S.VERIFIED, "instance")


def over_range(num: S.Signal, den: S.Signal) -> str:
    """Per-instance ratio over the whole time range (the table summarises the range)."""
    return (f"sum by (instance) (increase({sel(num)}[{RANGE}]))\n/\n"
            f"sum by (instance) (increase({sel(den)}[{RANGE}]))")


# Replicas scraped in the selection, each counted once, and those with anomalies in range.
replicas = f"count(count by (instance) ({sel(S.BUILD_INFO)}))"
affected = (f"count(sum by (instance) (increase({sel(S.ANOMALIES)}[{RANGE}])) > 0) "
            "or vector(0)")

fleet = [
    (stat("Replicas with anomalies", "Replicas that found a content anomaly over the time "
          "range, next to the replicas scraped: one of many is a bad replica "
          "(KVCacheAnomalyLocalised), most of them a rollout (KVCacheAnomalyFleetWide).",
          "short", [(affected, "with anomalies"), (replicas, "replicas")],
          steps("green", (ANY, "red")), decimals=0), 4, 9),
    (timeseries("Top 5 instances by content-anomaly rate", "One bad GPU among many shows "
                "up here first.", "percentunit",
                [(f"topk(5, {by_instance_anomaly_rate})", "{{instance}}")],
                steps("green", (ANY, "red"))), 10, 9),
    (timeseries("Share of the fleet's anomaly rate", "Each instance's anomalous / verified "
                "ratio (10m) over the sum of its fleet's (one model on one engine). Above "
                "the line, with enough replicas, the replica is named by "
                "KVCacheAnomalyLocalised; equal shares across replicas are a rollout.",
                "percentunit",
                [(f"topk(5, {INSTANCE_ANOMALY_SHARE}{{{SELECTOR}}})", "{{instance}}")],
                steps("green", (T.fleet_anomaly_share, "red"))), 10, 9),
    (table("Fleet: anomalies and hit rate per instance", "Per instance over the time range: "
           "anomalies and the anomaly rate next to the hit rates, so a replica with a "
           "healthy hit rate and wrong KV stands out; sort by anomaly rate.",
           [(f"sum by (instance) (increase({sel(S.ANOMALIES)}[{RANGE}]))", "anomalies",
             "short"),
            (over_range(S.ANOMALIES, S.VERIFIED), "anomaly rate", "percentunit"),
            (over_range(S.HITS, S.LOOKUPS), "hit rate (lookups)", "percentunit"),
            (over_range(S.HIT_TOKENS, S.QUERY_TOKENS), "hit rate (tokens)", "percentunit")]),
     24, 9),
]

# Hybrid caches (issue 11): each cache group (full attention, sliding window, recurrent
# state, offload tier) must hold recoverable state; the tier's loads are recoveries.
hybrid = [
    (timeseries("Hits by cache group", "Hits served through each cache group: a hybrid hit "
                "needs every group (full, sliding window, recurrent state) to serve it.",
                "cps", [(rate(S.GROUP_HITS, "group, group_kind"),
                         "{{group}} ({{group_kind}})")]), 6, 8),
    (timeseries("Anomalies by group kind", "Which kind of cache group holds the wrong state, "
                "and how (window_mismatch, missing_group_state, null_block_read, "
                "stale_recurrent_state, tier_not_loaded, partial_load, ...).", "cps",
                [(rate(S.GROUP_KIND_ANOMALIES, "group_kind, kind"),
                  "{{group_kind}}: {{kind}}")], steps("green", (ANY, "red"))), 6, 8),
    (timeseries("Tier recoveries by outcome", "Offload-tier loads reported by the engine, "
                "by cache group, loaded or failed (a failed share above "
                f"{T.recovery_failure_ratio:.0%} warns: KVCacheRecoveryFailures).", "cps",
                [(rate(S.RECOVERIES, "group, outcome"), "{{group}} {{outcome}}")]), 6, 8),
    (timeseries("Tier recovery time", "How long offload-tier loads take (P50/P99 from the "
                "histogram); the line is the KVCacheRecoveryLatencyHigh threshold.", "s",
                [(quantile(0.5, S.RECOVERY_DURATION), "P50"),
                 (quantile(0.99, S.RECOVERY_DURATION), "P99")],
                steps("green", (T.recovery_p99_seconds, "orange"))), 6, 8),
]

dashboard = Dashboard(
    title="kv-sidecar / Overview",
    uid="kv-sidecar-overview",
    description="Is the KV cache serving the right KV? Hit rate next to content anomalies, "
                "verification coverage, allocator health, latency and the fleet.",
    tags=["kv-sidecar", "kv-cache"],
    timezone="utc",
    time=Time("now-1h", "now"),
    refresh="30s",
    schemaVersion=36,
    graphTooltip=1,
    templating=templating(),
    panels=layout([
        ("Is the cache serving the right KV?", headline),
        ("Anomalies", anomalies),
        ("Verification coverage", coverage),
        ("Allocator health", allocator),
        ("Latency", latency),
        ("Fleet", fleet),
        ("Hybrid caches", hybrid),
    ]),
).auto_panel_ids()

# --- scrub and actions (sidecar/checks/scrub.py, sidecar/protect/actions.py; engineer scrub): one
# row
# appended under the others. What the protective actions are doing (off by default) and
# whether the background scrub keeps up with the resident set within its budget.
scrub_actions = [
    (stat("Action state", "Protective actions switched on (1) or off (0, the default), and "
          "whether the circuit breaker is open now: while it is, the engine serves no cache "
          "hits (every lookup a miss) until M clean probes close it.", "short",
          [(f"max by (action) ({sel(S.ACTION_ENABLED)})", "{{action}} on"),
           (f"max({sel(S.BREAKER_OPEN)})", "breaker open")],
          steps("green", (ANY, "orange")), decimals=0), 6, 6),
    (timeseries("Hit rate and the breaker", "The token hit rate next to the breaker state "
                "and its probes: the hit rate dips to 0 while the breaker is open and "
                "recovers when it closes.", "percentunit",
                [(token_hit_rate, "hit rate (tokens)"),
                 (f"max({sel(S.BREAKER_OPEN)})", "breaker open"),
                 (f"{rate(S.BREAKER_PROBES, 'result')} > 0", "probes/s {{result}}"),
                 (f"{rate(S.QUARANTINED)} > 0", "quarantined blocks/s")]),
     6, 6),
    (timeseries("Scrub recompute rate vs budget", "Tokens the scrub recomputed over the "
                "last minute (measured) against its budget per minute: at the line the "
                "scrub is budget-bound.", "short",
                [(f"sum by (instance) ({sel(S.SCRUB_RECOMPUTE_RATE)})", "{{instance}} used"),
                 (f"max({sel(S.SCRUB_BUDGET)})", "budget")]), 6, 6),
    (timeseries("Scrub pass progress and coverage", "How far the current pass is, the "
                "share of the resident set verified in this pass or the last, and the age "
                "of the last completed pass against KVSidecarScrubOverdue.", "percentunit",
                [(f"max by (instance) ({sel(S.SCRUB_PROGRESS)})", "{{instance}} progress"),
                 (f"max by (instance) ({sel(S.SCRUB_COVERAGE)})", "{{instance}} coverage")]),
     6, 6),
]

# --- the cache-bypass guard (sidecar/protect/, issue 25): two panels appended to the
# scrub-and-actions row. The guard in front of an OpenAI server salts every request while
# its breaker is open; these show its state and what it did to the traffic.
from dashboards.common import RATE  # noqa: E402  (kept inside the guard's block)

scrub_actions += [
    (stat("Guard state", "The cache-bypass guard's breaker: open (every request gets a "
          "fresh cache_salt, the engine serves misses), half-open (probes with the cache), "
          "and whether the guard can bypass at all (0: the server ignores cache_salt, the "
          "guard only alerts).", "short",
          [("max(" + sel(S.GUARD_STATE, extra='state="open"') + ")", "open"),
           ("max(" + sel(S.GUARD_STATE, extra='state="half_open"') + ")", "half-open"),
           (f"min({sel(S.GUARD_BYPASS_SUPPORTED)})", "bypass supported")],
          steps("green", (ANY, "orange")), decimals=0), 6, 6),
    (timeseries("Guard: requests by route and transitions", "Requests through the guard "
                "per second by route (forwarded as sent, bypassed with a salt, probe, "
                "unprotected), and its breaker's transitions by the state entered and what "
                "moved it (local verdict, sidecar, webhook page, operator, timer, probes).",
                "reqps",
                [(rate(S.GUARD_REQUESTS, "route"), "{{route}}"),
                 (f"sum by (to, source) (increase({sel(S.GUARD_TRANSITIONS)}[{RATE}])) > 0",
                  "to {{to}} ({{source}})")]), 18, 6),
]
# --- end of the guard's block.


def _append_row(board: Dashboard, title: str,
                panels: list[tuple[object, int, int]]) -> Dashboard:
    """``board`` with one more row laid out below its lowest panel."""
    from attr import evolve
    from grafanalib.core import GridPos

    bottom = max(p.gridPos.y + p.gridPos.h for p in board.panels)
    extra = layout([(title, panels)])  # type: ignore[list-item]
    for p in extra:
        g = p.gridPos
        p.gridPos = GridPos(h=g.h, w=g.w, x=g.x, y=g.y + bottom)
    return evolve(board, panels=[*board.panels, *extra]).auto_panel_ids()

dashboard = _append_row(dashboard, "Scrub and actions", scrub_actions)
# --- end of the scrub and actions block.

# --- OTLP push health (sidecar/export/otlp_failures.py, issue 21): one row appended under the
# others. A receiver that is down, silent or answering errors loses the pushed values while
# the sidecar itself looks calm; here its failed batches show by reason next to the batches.
otlp = [
    (timeseries("OTLP export", "Batches the OTLP push exported per second, by signal, and "
                "those the receiver did not take, by reason (connect: down; timeout: "
                "silent; http: an error status or a redirect; error: anything else). "
                "Failed batches are lost to the OTLP backend; verification goes on.",
                "cps",
                [(rate(S.OTLP_EXPORTS, "signal"), "{{signal}} batches"),
                 (f"{rate(S.OTLP_EXPORT_FAILURES, 'signal, reason')} > 0",
                  "{{signal}} failed: {{reason}}")],
                steps("green", (ANY, "red"))), 24, 6),
]
dashboard = _append_row(dashboard, "OTLP push", otlp)
# --- end of the OTLP push block.

# --- vLLM write-time fingerprints (sidecar/adapters/vllm/block_writes.py, issue 23): one row.
# The probe fingerprints each full block as a forward completes it; a sampled hit's blocks
# are checked against those digests. A mismatch is also a fingerprint_mismatch anomaly; here
# the coverage shows: how much is fingerprinted, how often a check found none (missing).
fingerprints = [
    (timeseries("vLLM write-time fingerprints", "Blocks the in-engine probe fingerprinted "
                "per second by write path (prefill, decode), sampled blocks checked against "
                "their fingerprint by result (match, mismatch: bytes changed after the write, "
                "missing: not fingerprinted or evicted), and fingerprints evicted from the "
                "probe's bounded table.", "cps",
                [(rate(S.PROBE_BLOCKS_FINGERPRINTED, "path"), "fingerprinted ({{path}})"),
                 (rate(S.PROBE_FINGERPRINT_CHECKS, "result"), "checked: {{result}}"),
                 (f"sum(rate({sel(S.PROBE_FINGERPRINT_EVICTIONS)}[{RATE}])) > 0",
                  "evicted")],
                steps("green", (ANY, "orange"))), 24, 6),
]
dashboard = _append_row(dashboard, "vLLM write-time fingerprints", fingerprints)
# --- end of the fingerprints block.
