"""The SGLang adapter's own signals; registered by the SGLang sidecar.
"""

from __future__ import annotations

from sidecar.core.signal_types import C, G, Signal
from sidecar.core.signal_types import signal as _s

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
SGLANG_TAP_SECONDS = _s("sglang_tap_seconds_total", C,
                        "Time SGLang's process spent in the kv-sidecar tap, as the tap "
                        "reports it: the wall time of its hooks' own work on the scheduler "
                        "thread (SGLang's wrapped calls not included; a hook preempted on a "
                        "busy host counts its wait) plus the CPU time of its shipper thread "
                        "(packing and sending): the tap's cost, next to SGLang's CPU time.",
                        unit="seconds")
SGLANG_SIGNALS: tuple[Signal, ...] = (
    SGLANG_CACHE_HIT_RATE, SGLANG_CACHED_TOKENS, SGLANG_HIT_TOKENS_DISCREPANCY,
    SGLANG_TAP_SECONDS,
)
