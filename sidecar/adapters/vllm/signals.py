"""The vLLM adapter's own signals: the KV event-stream audit, the engine-metrics bridge and the
prefix-cache reset. Registered by the vLLM sidecar (``Metrics.register``) where it runs.
"""

from __future__ import annotations

import enum

from sidecar.core.signal_types import C, G, Signal
from sidecar.core.signal_types import signal as _s

# --- vLLM adapter (sidecar/adapters/vllm): KV event-stream audit and engine-metrics bridge.
# Owned by the vLLM adapter; sidecar.signals adds them to ALL_SIGNALS (Metrics, dashboards, docs).
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

# Write-time fingerprints in the probe (sidecar/adapters/vllm/block_writes.py). group: the
# cache group's label; path: prefill or decode (WritePath); result: FingerprintResult.
PROBE_BLOCKS_FINGERPRINTED = _s("probe_blocks_fingerprinted_total", C,
                                "Full blocks the in-engine probe fingerprinted as a forward "
                                "completed them (1 in fingerprint_every), by cache group and "
                                "write path (prefill, decode).", ("group", "path"))
PROBE_FINGERPRINT_CHECKS = _s("probe_fingerprint_checks_total", C,
                              "Sampled blocks checked against their write-time fingerprint, by "
                              "cache group and result (match; mismatch: the bytes served "
                              "changed after the write; missing: no fingerprint, not one of "
                              "the 1 in fingerprint_every or evicted).", ("group", "result"))
PROBE_FINGERPRINT_EVICTIONS = _s("probe_fingerprint_evictions_total", C,
                                 "Write records the probe dropped (oldest first) from its "
                                 "bounded table: later hits on those blocks go unfingerprinted.")

VLLM_SIGNALS: tuple[Signal, ...] = (
    KV_EVENTS, KV_EVENT_DECODE_ERRORS, KV_EVENT_GAPS, KV_EVENT_BATCHES_LOST,
    KV_EVENT_BATCHES_REPLAYED, KV_EVENT_HASHES_VERIFIED, KV_EVENT_HASH_MISMATCHES,
    KV_EVENT_HASH_UNVERIFIABLE, KV_EVENT_DUPLICATE_STORES, KV_EVENT_UNKNOWN_REMOVALS,
    KV_INDEXED_BLOCKS, CAPACITY_WAITING, ENGINE_SCRAPE_ERRORS,
    KV_EVENT_INDEX_EVICTIONS, PROBE_BLOCKS_FINGERPRINTED, PROBE_FINGERPRINT_CHECKS,
    PROBE_FINGERPRINT_EVICTIONS,
)


class FingerprintResult(enum.StrEnum):
    """The ``result`` label of :data:`PROBE_FINGERPRINT_CHECKS`."""

    MATCH = "match"
    MISMATCH = "mismatch"
    MISSING = "missing"


# vLLM mitigation (sidecar/adapters/vllm/prefix_reset.py, `vllm serve --reset-prefix-cache`);
# registered by the vLLM sidecar where it is switched on. result: reset, busy (gave up while
# requests held blocks), unsupported (no dev endpoint), error, rate_limited.
PREFIX_CACHE_RESETS = _s("prefix_cache_resets_total", C,
                         "POST /reset_prefix_cache requests the sidecar made after an "
                         "anomaly, by result (reset, busy, unsupported, error, "
                         "rate_limited).", ("result",))
