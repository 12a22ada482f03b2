"""The detection outlook: how much of the cache has been verified, and how long a fault
would stay unseen at the current traffic and sampling rate.

* **Verified share** (``kvsidecar_verified_block_share``): of the distinct blocks the sidecar
  holds a store record of, the share verified since they were last written. A verified block
  is remembered with the epoch it had at match time (:mod:`sidecar.core.store_index`); a block
  freed or written again moves its epoch and counts as unverified. Bounded: as many
  remembered blocks as store records.
* **Expected time to first detection** of a fault that affects a fraction ``f`` of hits
  (``detection_fault_fraction``, 0.01 by default). Each hit is sampled with probability
  ``1/N`` (``N`` the rate in force: the start burst's while it lasts), so a hit both
  affected and sampled comes with probability ``f/N`` per hit: geometric, with mean
  ``N / f`` hits (``kvsidecar_expected_detection_hits``), i.e.
  ``N / (f x hits per second)`` seconds (``kvsidecar_expected_detection_seconds``; the hit
  rate over the last minute; +Inf while there are no hits). It assumes a sampled affected
  hit has its bad block checked: the last block always is, earlier ones within the
  prefix's length in samples (:mod:`sidecar.core.coverage_cursor`).

Refreshed after verdicts (at most once a second) and whenever the summary is read; never
on the engine's hook path.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from sidecar import signals as S
from sidecar.core.sampling import Rearmable, Sampler
from sidecar.core.store_index import StoreIndex

RATE_WINDOW_S = 60.0  # the hit rate is measured over this much recent time
REFRESH_EVERY_S = 1.0


class DetectionOutlook:
    """See the module docstring. ``hits`` reads the hits counted so far."""

    def __init__(self, metrics: Any, stored: StoreIndex, sampler: Sampler,
                 hits: Callable[[], float], fault_fraction: float = 0.01,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics, self.stored, self.sampler = metrics, stored, sampler
        self.fault_fraction = fault_fraction
        self._hits, self._clock = hits, clock
        self._verified: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._rate_points: deque[tuple[float, float]] = deque()
        self._last_refresh = -math.inf
        self._bursts_seen = 0
        self._lock = threading.Lock()
        for reason in S.BurstReason:
            metrics.inc(S.SAMPLE_BURSTS, 0, reason=reason.value)
        self.refresh(force=True)

    @property
    def sample_every(self) -> int:
        s = self.sampler
        return int(s.current_every) if isinstance(s, Rearmable) \
            else int(getattr(s, "every", 1))

    def rearm(self, reason: S.BurstReason) -> None:
        """Start a burst on the sampler (if it has one) and count it."""
        if isinstance(self.sampler, Rearmable):
            self.sampler.rearm(reason.value)
        self.refresh(force=True)

    def on_verdict(self, verdict: Any) -> None:
        epochs = verdict.sample.epochs
        with self._lock:
            for ref in verdict.verified:
                key = (ref.group_id, ref.block_id)
                self._verified.pop(key, None)
                self._verified[key] = epochs.get(ref, self.stored.epoch(*key))
            while len(self._verified) > max(self.stored.capacity, 1):
                self._verified.popitem(last=False)
        self.refresh()

    def verified_share(self) -> float:
        """Verified blocks whose epoch has not moved / blocks with a store record."""
        with self._lock:
            stale = [k for k, e in self._verified.items() if self.stored.epoch(*k) != e]
            for k in stale:
                del self._verified[k]
            current = len(self._verified)
        total = len(self.stored)
        return min(1.0, current / total) if total else 0.0

    def hits_per_second(self) -> float:
        now, hits = self._clock(), float(self._hits())
        points = self._rate_points
        points.append((now, hits))
        while len(points) > 2 and now - points[1][0] >= RATE_WINDOW_S:
            points.popleft()
        t0, h0 = points[0]
        return (hits - h0) / (now - t0) if now > t0 else 0.0

    def expected(self) -> tuple[float, float]:
        """(hits, seconds) to the first detection of a fault affecting ``fault_fraction``
        of hits, at the rate in force now."""
        hits = self.sample_every / self.fault_fraction
        rate = self.hits_per_second()
        return hits, (hits / rate if rate > 0 else math.inf)

    def refresh(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._last_refresh < REFRESH_EVERY_S:
            return
        self._last_refresh = now
        m = self.metrics
        hits, seconds = self.expected()
        m.gauge(S.EXPECTED_DETECTION_HITS).set(hits)
        m.gauge(S.EXPECTED_DETECTION_SECONDS).set(seconds)
        m.gauge(S.SAMPLE_EVERY_CURRENT).set(self.sample_every)
        m.gauge(S.VERIFIED_BLOCK_SHARE).set(self.verified_share())
        burst = getattr(self.sampler, "burst", None) if isinstance(self.sampler, Rearmable) \
            else None
        if burst is not None and burst.armed > self._bursts_seen:
            known = {r.value for r in S.BurstReason}
            reason = burst.reason if burst.reason in known else S.BurstReason.RESTART.value
            m.inc(S.SAMPLE_BURSTS, burst.armed - self._bursts_seen, reason=reason)
            self._bursts_seen = burst.armed

    def summary(self) -> dict[str, Any]:
        self.refresh(force=True)
        hits, seconds = self.expected()
        burst = self.sampler.burst if isinstance(self.sampler, Rearmable) else None
        return {"verified_block_share": round(self.verified_share(), 4),
                "sample_every_now": self.sample_every,
                "burst_hits_left": max(burst.left, 0) if burst is not None else 0,
                "expected_detection_hits": hits,
                "expected_detection_seconds": None if math.isinf(seconds) else seconds,
                "detection_fault_fraction": self.fault_fraction}
