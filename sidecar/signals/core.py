"""The engine-agnostic signals: what any sidecar exports (an adapter's own are beside it).
"""

from __future__ import annotations

import enum

from sidecar.core.signal_types import (
    CHECK_BUCKETS,
    LATENCY_BUCKETS,
    VERIFY_BUCKETS,
    C,
    G,
    H,
    Signal,
)
from sidecar.core.signal_types import signal as _s

LOOKUPS = _s("lookups_total", C, "Prefix-cache lookups seen.")
HITS = _s("hits_total", C, "Lookups that found at least one cached block.")
QUERY_TOKENS = _s("query_tokens_total", C, "Prompt tokens looked up in the prefix cache.")
HIT_TOKENS = _s("hit_tokens_total", C, "Prompt tokens served from the prefix cache.")
SAMPLED = _s("sampled_total", C, "Hits chosen for verification by the sampling policy.")
VERIFIED = _s("verified_total", C,
              "Sampled blocks whose verification completed (per cache group).", ("group",))
ANOMALIES = _s("anomalies_total", C,
               "Verified blocks whose content, key or generation was wrong, by kind.",
               ("group", "kind"))
SAMPLES_DROPPED = _s("samples_dropped_total", C,
                     "Samples not verified, by reason (queue_full, budget, adapter_error, ...).",
                     ("reason",))
PROBE_LOST = _s("probe_lost_total", C,
                "What an in-engine probe or tap could not deliver because its pipe to the "
                "sidecar stayed full, by what (lookups: beyond the probe's bounded carry, "
                "missing from lookups_total and the hit rate; messages: other messages, "
                "e.g. fingerprint counts or SGLang frees). Dropped captures count in "
                "samples_dropped_total{reason=\"queue_full\"}.", ("what",))
ADAPTER_ERRORS = _s("adapter_errors_total", C,
                    "Adapter calls that raised or ran past their time limit.", ("op", "reason"))
HOOK_ERRORS = _s("hook_errors_total", C,
                 "Exceptions caught inside engine hooks (never propagated to the engine).",
                 ("hook",))
ALLOCATIONS = _s("allocations_total", C, "Block allocation attempts reported by the engine.")
ALLOCATION_FAILURES = _s("allocation_failures_total", C,
                         "Block allocations that failed (pool exhausted or no usable run).")
USAGE_RATIO = _s("usage_ratio", G,
                 "Blocks referenced by live sequences / total blocks.", unit="ratio")
FRAGMENTATION_RATIO = _s("fragmentation_ratio", G,
                         "1 - largest free run / free blocks (0 when nothing is free).",
                         unit="ratio")
INTERNAL_FRAGMENTATION_RATIO = _s(
    "internal_fragmentation_ratio", G,
    "Unused token slots in blocks held by live sequences / allocated slots.", unit="ratio")
BLOCKS = _s("blocks", G, "Blocks of the pool by state (free, cached, used, total).", ("state",))
REQUEST_LATENCY = _s("request_latency_seconds", H, "End-to-end request latency in the engine.",
                     unit="seconds", buckets=LATENCY_BUCKETS)
VERIFY_DURATION = _s("verify_duration_seconds", H,
                     "Time to verify one sampled hit (read, checks, recompute).",
                     unit="seconds", buckets=VERIFY_BUCKETS)
LAST_VERIFICATION = _s("last_verification_timestamp_seconds", G,
                       "Unix time of the last completed verification (silence is not health).",
                       unit="seconds")
BUILD_INFO = _s("build_info", G, "Always 1; labels carry the sidecar version and engine.",
                ("version",))
INVARIANT_VIOLATIONS = _s("invariant_violations_total", C,
                          "Allocator invariants found broken (a free block still indexed, "
                          "a ref count below its holders, ...), by kind.", ("kind",))
LEAK_SUSPECTED = _s("leak_suspected_blocks", G,
                    "Block references the allocator counts that no live sequence holds "
                    "(ref count minus live holders, summed over blocks): what a leak grows.")
# --- allocator health (sidecar/allocator): invariant checks, leak trend, thresholds.
LEAK_SUSPECTED_FLAG = _s("leak_suspected", G,
                         "1 while the leak trend test holds: references held by no live "
                         "sequence were positive and never fell over the last leak_window "
                         "polls, and grew.")
INVARIANT_CHECKS = _s("invariant_checks_total", C,
                      "Allocator block-table snapshots checked for invariant violations "
                      "(silence is not health: a flat line means no checks ran).")
INVARIANT_CHECK_DURATION = _s("invariant_check_duration_seconds", H,
                              "Time to take and check one allocator block-table snapshot.",
                              unit="seconds", buckets=CHECK_BUCKETS)
THRESHOLD = _s("threshold", G,
               "Alerting thresholds (sidecar.signals.THRESHOLDS), by name, "
               "for alert rules and dashboard threshold lines.", ("threshold",))

BASE_SIGNALS: tuple[Signal, ...] = (
    LOOKUPS, HITS, QUERY_TOKENS, HIT_TOKENS, SAMPLED, VERIFIED, ANOMALIES, SAMPLES_DROPPED,
    PROBE_LOST, ADAPTER_ERRORS, HOOK_ERRORS, ALLOCATIONS, ALLOCATION_FAILURES, USAGE_RATIO,
    FRAGMENTATION_RATIO, INTERNAL_FRAGMENTATION_RATIO, BLOCKS, REQUEST_LATENCY,
    VERIFY_DURATION, LAST_VERIFICATION, BUILD_INFO, INVARIANT_VIOLATIONS, LEAK_SUSPECTED,
    LEAK_SUSPECTED_FLAG, INVARIANT_CHECKS, INVARIANT_CHECK_DURATION, THRESHOLD,
)


# --- recompute tolerance (sidecar/checks/calibration.py): the error, the tolerance, floor and
# drift.
# Labels are bounded: group (a few cache groups), dtype (one per sidecar), reference
# ("independent" or "engine").
ERROR_BUCKETS = tuple(float(f"{10 ** (k / 3):.3g}") for k in range(-21, 4))  # 1e-7 .. 10
ERROR_CAP = 1e3  # a non-finite error is observed as this (in +Inf), keeping _sum finite
RECOMPUTE_ERROR = _s("recompute_error", H,
                     "Normalized recompute error of each verified block (max|cached - ref| / "
                     "rms(ref)), by cache group and dtype.", ("group", "dtype"),
                     unit="ratio", buckets=ERROR_BUCKETS)
RECOMPUTE_TOLERANCE = _s("recompute_tolerance", G,
                         "Recompute tolerance in use, by reference kind, dtype and write path "
                         "(prefill, decode where the engine says; all otherwise): the hard "
                         "one, the deployment's override, or the calibrated one (0: exact).",
                         ("reference", "dtype", "write_path"), unit="ratio")
RECOMPUTE_NOISE_FLOOR = _s("recompute_noise_floor", G,
                           "Calibrated noise floor (largest error of the first clean blocks), "
                           "by reference kind, dtype and write path; absent until calibrated.",
                           ("reference", "dtype", "write_path"), unit="ratio")
RECOMPUTE_ERROR_DRIFT = _s("recompute_error_drift", G,
                           "Recent recompute-error quantile / calibrated noise floor, by "
                           "reference kind, dtype and write path (reaches the calibration "
                           "multiple at the tolerance); absent until calibrated.",
                           ("reference", "dtype", "write_path"), unit="ratio")
TOLERANCE_SIGNALS: tuple[Signal, ...] = (
    RECOMPUTE_ERROR, RECOMPUTE_TOLERANCE, RECOMPUTE_NOISE_FLOOR, RECOMPUTE_ERROR_DRIFT,
)


# --- Hook-input validation (sidecar/core/hook_input.py): a bad value an engine hands a hook is
# counted here and dropped, never applied. Labels: hook (the six hooks), reason (InputReject).
class InputReject(enum.StrEnum):
    """The value of the ``reason`` label of :data:`HOOK_INPUT_REJECTED`."""

    TYPE = "type"  # not the documented type (None, bool, float count, wrong object)
    NAN = "nan"
    NEGATIVE = "negative"
    ABSURD = "absurd"  # past any real workload (a 400M-token hit, a day-long request)
    INCONSISTENT = "inconsistent"  # e.g. more tokens hit than looked up


HOOK_INPUT_REJECTED = _s("hook_input_rejected_total", C,
                         "Hook calls dropped because their input was invalid (None, NaN, "
                         "negative, absurd, inconsistent), by hook and reason.",
                         ("hook", "reason"))


# --- background scrub (sidecar/checks/scrub.py) and protective actions
# (sidecar/protect/actions.py).
# Appended to ALL_SIGNALS like the blocks above. Bounded labels: reason (ScrubSkip),
# action (Action), result (fixed sets in the help text), group (a few cache groups).
class ScrubSkip(enum.StrEnum):
    """The value of the ``reason`` label of :data:`SCRUB_SKIPPED`."""

    LOAD = "load"  # a tick skipped: verifier queue not empty or the engine busy
    BUDGET = "budget"  # the recompute budget per minute is spent until it refills
    RECENTLY_HIT = "recently_hit"  # in a sampled hit within scrub_idle_s: the hit path checks it
    # The adapter declined: held by a live sequence now, no longer indexed, or its full
    # prefix cannot be rebuilt.
    UNAVAILABLE = "unavailable"
    UNSUPPORTED = "unsupported"  # the adapter has no scrub_hit capability
    ADAPTER_ERROR = "adapter_error"  # scrub_hit raised


class Action(enum.StrEnum):
    """The value of the ``action`` label of :data:`ACTION_ENABLED`."""

    QUARANTINE = "quarantine"
    BREAKER = "breaker"


SCRUB_VERIFIED = _s("scrub_verified_blocks_total", C,
                    "Resident blocks the background scrub re-verified (not being hit), by "
                    "result (clean, anomalous, dropped).", ("result",))
SCRUB_SKIPPED = _s("scrub_skipped_total", C,
                   "Scrub ticks or candidate blocks skipped, by reason (load, budget, "
                   "recently_hit, unavailable, unsupported, adapter_error).", ("reason",))
SCRUB_RECOMPUTE_TOKENS = _s("scrub_recompute_tokens_total", C,
                            "Tokens the scrub recomputed (its share of the recompute cost).")
SCRUB_RECOMPUTE_RATE = _s("scrub_recompute_tokens_per_minute", G,
                          "Tokens the scrub recomputed over the last minute (measured), to "
                          "compare with its budget.")
SCRUB_BUDGET = _s("scrub_budget_tokens_per_minute", G,
                  "The scrub's recompute budget in tokens per minute (configured).")
SCRUB_PROGRESS = _s("scrub_pass_progress_ratio", G,
                    "How far the current scrub pass is through the resident set it started "
                    "with (0..1).", unit="ratio")
SCRUB_COVERAGE = _s("scrub_coverage_ratio", G,
                    "Share of the blocks resident now that the scrub verified in this pass or "
                    "the last one.", unit="ratio")
SCRUB_LAST_PASS = _s("scrub_last_pass_completed_timestamp_seconds", G,
                     "Unix time the last scrub pass completed (the scrub's start time until "
                     "the first pass completes; absent or 0 while no scrub runs).",
                     unit="seconds")
SCRUB_PASSES = _s("scrub_passes_total", C, "Scrub passes completed over the resident set.")
ACTION_ENABLED = _s("action_enabled", G,
                    "1 where a protective action is switched on (quarantine, breaker), "
                    "0 where it is off (the default).", ("action",))
QUARANTINED = _s("quarantined_blocks_total", C,
                 "Blocks found bad and handed to the adapter's evict, by result (evicted, "
                 "unsupported, error).", ("result",))
BREAKER_OPEN = _s("breaker_open", G,
                  "1 while the cache-bypass circuit breaker is open (the engine serves no "
                  "prefix hits), 0 while closed.")
BREAKER_TRIPS = _s("breaker_trips_total", C,
                   "Times the circuit breaker opened (K anomalies within its window).")
BREAKER_PROBES = _s("breaker_probes_total", C,
                    "Verifications that completed while the breaker was open, by result "
                    "(clean, anomalous): M clean ones in a row close it.", ("result",))
SCRUB_ACTION_SIGNALS: tuple[Signal, ...] = (
    SCRUB_VERIFIED, SCRUB_SKIPPED, SCRUB_RECOMPUTE_TOKENS, SCRUB_RECOMPUTE_RATE, SCRUB_BUDGET,
    SCRUB_PROGRESS, SCRUB_COVERAGE, SCRUB_LAST_PASS, SCRUB_PASSES, ACTION_ENABLED,
    QUARANTINED, BREAKER_OPEN, BREAKER_TRIPS, BREAKER_PROBES,
)


# --- hybrid caches (hcore, issue 11): per cache-group kind, and offload-tier recoveries.
# Bounded labels: group (the engine's few cache groups), group_kind (GroupKind), kind
# (AnomalyKind), outcome (RecoveryOutcome). New series, so no existing one gains a label.
GROUP_HITS = _s("group_hits_total", C,
                "Hits served through each cache group (a hybrid hit counts once in every "
                "group that lists blocks for it), by group and its kind.",
                ("group", "group_kind"))
GROUP_KIND_ANOMALIES = _s("group_kind_anomalies_total", C,
                          "Anomalies by the kind of cache group they were found in "
                          "(full_attention, sliding_window, recurrent_state, ...) and by "
                          "anomaly kind: anomalies_total summed over groups of a kind.",
                          ("group_kind", "kind"))
RECOVERIES = _s("recoveries_total", C,
                "Offload-tier loads (recoveries) the engine reported finished, by cache "
                "group and outcome (loaded, failed).", ("group", "outcome"))
RECOVERY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)
RECOVERY_DURATION = _s("recovery_duration_seconds", H,
                       "Time an offload-tier load (recovery) took, from the engine's on_tier "
                       "report, by cache group.", ("group",), unit="seconds",
                       buckets=RECOVERY_BUCKETS)
HYBRID_SIGNALS: tuple[Signal, ...] = (
    GROUP_HITS, GROUP_KIND_ANOMALIES, RECOVERIES, RECOVERY_DURATION,
)


class RecoveryOutcome(enum.StrEnum):
    """The value of the ``outcome`` label of :data:`RECOVERIES`."""

    LOADED = "loaded"
    FAILED = "failed"


# --- detection outlook (sidecar/export/outlook.py, issue 23): how much of the cache has been
# checked,
# how fast a fault would be found, and the start burst. Bounded label: reason (BurstReason).
class BurstReason(enum.StrEnum):
    """The value of the ``reason`` label of :data:`SAMPLE_BURSTS`."""

    START = "start"  # the sidecar (or the in-engine probe) started
    RESTART = "restart"  # the engine restarted: a new probe said hello
    UPGRADE = "upgrade"  # the probe's hello reports another version, KV layout or kernel


VERIFIED_BLOCK_SHARE = _s("verified_block_share", G,
                          "Share of the distinct cached blocks the sidecar knows of (its "
                          "store records) verified since they were last written.")
EXPECTED_DETECTION_SECONDS = _s(
    "expected_detection_seconds", G,
    "Expected time to the first detection of a fault that affects a fraction f of hits "
    "(detection_fault_fraction): current 1-in-N / (f x hits per second); +Inf without hits.",
    unit="seconds")
EXPECTED_DETECTION_HITS = _s("expected_detection_hits", G,
                             "Expected hits to the first detection of a fault affecting a "
                             "fraction f of hits: current 1-in-N / f.")
SAMPLE_EVERY_CURRENT = _s("sample_every", G,
                          "The sampling rate in force: 1 hit in this many (lower during a "
                          "start burst).")
SAMPLE_BURSTS = _s("sample_bursts_total", C,
                   "Start bursts of higher-rate sampling, by what started them (start, "
                   "restart, upgrade).", ("reason",))
OUTLOOK_SIGNALS: tuple[Signal, ...] = (
    VERIFIED_BLOCK_SHARE, EXPECTED_DETECTION_SECONDS, EXPECTED_DETECTION_HITS,
    SAMPLE_EVERY_CURRENT, SAMPLE_BURSTS,
)

# --- adapter capabilities (sidecar/core/attach.py, issue 20): what conformance found when the
# Monitor attached. Bounded label: capability (the names in sidecar.core.capabilities).
CAPABILITY_PROBLEMS = _s("capability_problems", G,
                         "Problems the conformance check found in an optional adapter or "
                         "sampler capability when the Monitor attached (a wrong signature, a "
                         "value outside the declared ones, a misspelt name), by capability; "
                         "a capability with a problem is refused and the Monitor runs "
                         "without it.", ("capability",))
CAPABILITY_IN_USE = _s("capability_in_use", G,
                       "1 for each optional capability in force (offered and conforming), "
                       "0 for one not offered or refused.", ("capability",))
CAPABILITY_SIGNALS: tuple[Signal, ...] = (CAPABILITY_PROBLEMS, CAPABILITY_IN_USE)
