"""The Monitor, plus the LMCache signals: per-tier verified chunks and anomalies.

The core Monitor counts anomalies by cache group and kind; for LMCache the question that
matters is *which tier* served the bad chunk (a disk that flips bytes, a remote that returns
zeros), so each verdict is also counted by the serving tier its :class:`ChunkHit` names.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.adapters.lmcache.adapter import LMCacheAdapter
from sidecar.checks.verifier import Verdict
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.sampling import Sampler
from sidecar.core.verdict_listeners import Stage
from sidecar.signals import AnomalyKind, LMCacheTier, RetrieveOutcome


class LMCacheMonitor(Monitor):
    """A :class:`sidecar.core.monitor.Monitor` attached to an :class:`LMCacheAdapter`."""

    def __init__(self, adapter: LMCacheAdapter, config: SidecarConfig | None = None,
                 registry: CollectorRegistry | None = None,
                 sampler: Sampler | None = None) -> None:
        super().__init__(adapter, config, registry, sampler)
        m = self.metrics
        m.register(S.ADAPTER_SIGNALS["lmcache"])  # the one path every adapter's set takes
        for tier in LMCacheTier:
            m.inc(S.LMCACHE_VERIFIED_CHUNKS, 0, tier=tier.value)
            for outcome in RetrieveOutcome:
                m.inc(S.LMCACHE_RETRIEVED_CHUNKS, 0, tier=tier.value, outcome=outcome.value)
            for kind in AnomalyKind:
                m.inc(S.LMCACHE_ANOMALIES, 0, tier=tier.value, kind=kind.value)
        # Counted with the core's signals, before anything acts (sidecar.core.verdict_listeners).
        self.verdict_listeners.add(self._count_tiers, Stage.SIGNALS)
        adapter.attach(self)

    def _count_tiers(self, verdict: Verdict) -> None:
        """Verdict listener: the verified chunks and anomalies by the tier that served them."""
        tiers: tuple[Any, ...] = getattr(verdict.sample.hit, "tiers", ())

        def tier(index: int) -> str:
            return str(tiers[index]) if index < len(tiers) else LMCacheTier.OTHER.value

        m = self.metrics
        for ref in verdict.verified:
            m.inc(S.LMCACHE_VERIFIED_CHUNKS, tier=tier(ref.index))
        seen: set[tuple[int, str]] = set()
        for f in verdict.findings:
            if (f.block_index, f.kind.value) not in seen:
                seen.add((f.block_index, f.kind.value))
                m.inc(S.LMCACHE_ANOMALIES, tier=tier(f.block_index), kind=f.kind.value)
