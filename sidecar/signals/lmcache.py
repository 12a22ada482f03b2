"""The LMCache adapter's own signals and label values. Here, not beside the adapter: the
``sidecar.adapters.lmcache`` package imports its Monitor and HF reference when imported,
and those import :mod:`sidecar.signals`, which imports this set to assemble ``ALL_SIGNALS``.
"""

from __future__ import annotations

import enum

from sidecar.core.signal_types import C, Signal
from sidecar.core.signal_types import signal as _s

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
