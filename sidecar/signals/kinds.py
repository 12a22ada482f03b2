"""The label values of the core signals (anomaly, invariant, drop and adapter-error reasons),
the alerting thresholds, and the alert names code reacts to.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
    # The engine's hit counter went down, or fell behind the hits the sidecar counted
    # (a gauge overwritten per batch, a counter stuck at 0): sidecar.allocator.hit_counter.
    HIT_COUNTER_MISMATCH = "hit_counter_mismatch"


class ProbeLoss(enum.StrEnum):
    """The value of the ``what`` label of :data:`PROBE_LOST` (an in-engine probe's pipe)."""

    LOOKUPS = "lookups"  # beyond the probe's bounded carry: missing from the hit rate
    MESSAGES = "messages"  # any other message (fingerprint counts, SGLang frees)


class DropReason(enum.StrEnum):
    """The value of the ``reason`` label of :data:`SAMPLES_DROPPED`."""

    QUEUE_FULL = "queue_full"
    BUDGET = "budget"  # recompute budget exhausted
    ADAPTER_ERROR = "adapter_error"
    ADAPTER_TIMEOUT = "adapter_timeout"
    # Not called: earlier calls of the same op are still stuck past their time limit
    # (sidecar/core/time_limits.py), so the engine is wedged, not this call slow.
    ADAPTER_REFUSED = "adapter_refused"
    # The block was freed or stored again (the sidecar's own epoch moved) between the match
    # and the sidecar's read: legitimately reused, so the read is not compared.
    EVICTED_BEFORE_READ = "evicted_before_read"
    # A captured block was freed or stored again after it was served: what was served is
    # still verified (from the capture); only the later "changed after serving" read is not.
    REUSED_AFTER_SERVING = "reused_after_serving"
    CAPTURE_TOO_LARGE = "capture_too_large"  # served-KV capture over capture_max_bytes
    SHUTDOWN = "shutdown"
    ADMISSION = "admission"  # over the cap on concurrent recomputes / recoveries
    # The hit's token ids are not ints in range (a bool, float, string, nested list, a
    # huge int) or too few for the chosen blocks: bad input, never hashed or recomputed.
    BAD_TOKENS = "bad_tokens"


class AdapterErrorReason(enum.StrEnum):
    """The value of the ``reason`` label of :data:`ADAPTER_ERRORS`."""

    ERROR = "error"  # the call raised
    TIMEOUT = "timeout"  # ran past adapter_timeout_s (abandoned, still running)
    REFUSED = "refused"  # not called: earlier calls of the op still stuck
    GARBAGE = "garbage"  # returned something that is not a BlockKV (skipped)
    MISSING_BLOCK = "missing_block"  # a requested block did not come back
    UNEXPECTED_BLOCK = "unexpected_block"  # a block that was not requested came back


# Which reasons each adapter op can report (pre-created at 0 by the Monitor).
ADAPTER_ERROR_REASONS: dict[str, tuple[AdapterErrorReason, ...]] = {
    op: (AdapterErrorReason.ERROR, AdapterErrorReason.TIMEOUT, AdapterErrorReason.REFUSED,
         AdapterErrorReason.GARBAGE)
    + ((AdapterErrorReason.MISSING_BLOCK, AdapterErrorReason.UNEXPECTED_BLOCK)
       if op in ("read", "recompute") else ())
    for op in ("read", "recompute", "allocator", "block_tables", "capture")
}


@dataclass(frozen=True)
class Thresholds:
    """Alerting thresholds, used by the alert rules, the dashboards'
    threshold lines, the demo summary and the docs."""

    usage_ratio: float = 0.85
    allocation_failure_rate: float = 0.001
    fragmentation_ratio: float = 0.30
    hit_rate_low: float = 0.80
    p99_latency_baseline_factor: float = 2.0
    anomaly_rate: float = 0.0  # any content anomaly is a page
    samples_dropped_ratio: float = 0.10  # dropped / sampled hits, per drop reason
    # Silence is not health: no verification for this long while at least
    # verification_stall_min_hits hits were served is a stall.
    verification_stale_seconds: float = 600.0
    # The hits that must have been served for silence to count (keep it >= 5 x
    # sample_every, or a quiet 1-in-N sampler looks stalled).
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


# --- alert names code reacts to (the cache-bypass guard's webhook); alerts/ names its rules
# with these, so a renamed alert cannot leave the guard matching a name no rule fires.
ALERT_CONTENT_ANOMALY = "KVCacheContentAnomaly"
ALERT_HIGH_HIT_RATE_WITH_ANOMALIES = "KVCacheHighHitRateWithAnomalies"
ALERT_ANOMALY_LOCALISED = "KVCacheAnomalyLocalised"
ALERT_ANOMALY_FLEET_WIDE = "KVCacheAnomalyFleetWide"
