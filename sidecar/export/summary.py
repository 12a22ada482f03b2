"""The run summary: the demo's ``--json`` object and the ``/status`` page.

Its keys are part of the CLI contract (docs/getting-started.md, "What the demo shows"); every
value is read from the same registry Prometheus scrapes, so the summary and /metrics never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from sidecar import signals as S
from sidecar.allocator import AllocatorHealth
from sidecar.core.protocol import EngineInfo
from sidecar.export.metrics import Metrics, fragmentation_ratio, usage_ratio


def p99(latencies: Iterable[float]) -> float | None:
    """Nearest-rank 99th percentile of the recent latencies (None when there are none)."""
    lat = sorted(latencies)
    if not lat:
        return None
    return lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]


def summarize(m: Metrics, info: EngineInfo, health: AllocatorHealth, *, requests: int,
              p99_latency: float | None, max_recompute_error: float, tolerance: float,
              first_anomaly_request: int | None) -> dict[str, Any]:
    """The summary of one sidecar's own state (what the Monitor passes in)."""
    lookups = m.value(S.LOOKUPS.name)
    hits = m.value(S.HITS.name)
    q = m.value(S.QUERY_TOKENS.name)
    ht = m.value(S.HIT_TOKENS.name)
    verified = m.value_sum(S.VERIFIED.name)
    anomalies = {k: int(v) for k, v in m.by_label(S.ANOMALIES.name, "kind").items()}
    state = m.allocator.state
    return {
        "engine": info.engine,
        "model": info.model,
        "dtype": info.dtype,
        "requests": requests,
        "lookups": int(lookups),
        "hits": int(hits),
        "hit_rate": hits / lookups if lookups else 0.0,
        "token_hit_rate": ht / q if q else 0.0,
        "sampled": int(m.value(S.SAMPLED.name)),
        "verified": int(verified),
        "anomalies": anomalies,
        "anomaly_rate": sum(anomalies.values()) / verified if verified else 0.0,
        "dropped": {k: int(v) for k, v in m.by_label(S.SAMPLES_DROPPED.name, "reason").items()},
        "adapter_errors": int(m.value_sum(S.ADAPTER_ERRORS.name)),
        # null where the engine does not report it (unknown is not 0)
        "allocations": state.allocations if state else None,
        "allocation_failures": state.allocation_failures if state else None,
        "usage_ratio": usage_ratio(state) if state else None,
        "fragmentation_ratio": fragmentation_ratio(state) if state else None,
        "p99_latency_seconds": p99_latency,
        "max_recompute_error": max_recompute_error,
        "tolerance": tolerance,
        "first_content_anomaly_request": first_anomaly_request,
        **health.summary(state),
    }
