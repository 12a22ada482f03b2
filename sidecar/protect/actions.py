"""Protective actions: what the sidecar does about a bad cache besides telling someone.

Engines today log a KV mismatch, abort the request, or quietly treat it as a miss; none
keeps a known-bad entry from being served again. Two actions, each off by default, each a
:class:`~sidecar.config.settings.SidecarConfig` switch and a signal (``kvsidecar_action_enabled``):

* **quarantine** (``quarantine``): a block found bad is handed to the adapter's ``evict``
  (:class:`sidecar.core.capabilities.Evictor`), so later requests recompute it instead of hitting it
  again: one corrupted entry is one anomaly, not one per later hit.
* **circuit breaker** (``breaker``): ``breaker_anomalies`` anomalous verdicts within
  ``breaker_window_s`` open it: the Monitor's ``hits_allowed`` flag (an O(1) attribute the
  engine reads at lookup, as the reference engine does) turns False and the engine serves
  every lookup as a miss. Verifications that complete while it is open are its probes (the
  background scrub runs them, :mod:`sidecar.checks.scrub`); ``breaker_probes`` clean ones in a row
  close it again, an anomalous one starts the count over.

Both listen to verdicts after the reporter counted them (stage ``ACTIONS`` of
:mod:`sidecar.core.verdict_listeners`), on the verifier's or the scrub's thread, never on an
engine hook's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar import signals as S
from sidecar.checks.verifier import Verdict
from sidecar.core.capabilities import Evictor
from sidecar.core.time_limits import Guard
from sidecar.signals import Action

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActionSettings:
    """The actions' knobs, read from :class:`sidecar.config.settings.SidecarConfig`."""

    quarantine: bool = False
    breaker: bool = False
    breaker_anomalies: int = 3
    breaker_window_s: float = 60.0
    breaker_probes: int = 5

    @classmethod
    def of(cls, config: Any) -> ActionSettings:
        return cls(config.quarantine, config.breaker, config.breaker_anomalies,
                   config.breaker_window_s, config.breaker_probes)


def bad_blocks(verdict: Verdict) -> dict[int, list[int]]:
    """Group id -> ids of the blocks the verdict's findings condemn, in order, once each."""
    hit = verdict.sample.hit
    out: dict[int, list[int]] = {}
    for f in verdict.findings:
        ids = hit.blocks.get(f.group_id, ())
        if 0 <= f.block_index < len(ids):
            b = int(ids[f.block_index])
            if b not in out.setdefault(f.group_id, []):
                out[f.group_id].append(b)
    return out


class Quarantine:
    """Evicts the blocks an anomalous verdict names (see the module docstring)."""

    def __init__(self, evictor: Evictor | None, metrics: Any, timeout_s: float) -> None:
        self.metrics = metrics
        self._evictor = evictor  # the adapter's, as resolved at attach (None: unsupported)
        self.guard = Guard(timeout_s)
        self.evicted = 0
        for result in ("evicted", "unsupported", "error"):
            metrics.inc(S.QUARANTINED, 0, result=result)

    def on_verdict(self, verdict: Verdict) -> None:
        if not verdict.findings:
            return
        for gid, ids in bad_blocks(verdict).items():
            if self._evictor is None:
                self.metrics.inc(S.QUARANTINED, len(ids), result="unsupported")
                continue
            try:
                n = int(self.guard.call("evict", self._evictor.evict, gid, ids))
            except Exception as exc:
                self.metrics.inc(S.QUARANTINED, len(ids), result="error")
                log.warning("adapter evict(%s, %s) failed: %s", gid, ids, exc)
                continue
            self.evicted += n
            self.metrics.inc(S.QUARANTINED, n, result="evicted")
            log.warning("quarantined %d block(s) of group %s: %s", n, gid, ids)


class CircuitBreaker:
    """Cache bypass after K anomalies in a window; closed again by M clean probes.

    ``set_hits_allowed`` is how the decision reaches the engine (the Monitor sets its
    ``hits_allowed`` attribute); ``on_change`` is told of every open/close (the scrub
    switches its probe mode with it)."""

    def __init__(self, settings: ActionSettings, metrics: Any,
                 set_hits_allowed: Callable[[bool], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.metrics = metrics
        self._set = set_hits_allowed
        self._clock = clock
        self._lock = threading.Lock()
        self._anomalies: deque[float] = deque()
        self.open = False
        self.clean_probes = 0
        self.trips = 0
        metrics.gauge(S.BREAKER_OPEN).set(0)
        metrics.inc(S.BREAKER_TRIPS, 0)
        for result in ("clean", "anomalous"):
            metrics.inc(S.BREAKER_PROBES, 0, result=result)

    def on_verdict(self, verdict: Verdict) -> None:
        s = self.settings
        with self._lock:
            if not self.open:
                if not verdict.findings:
                    return
                now = self._clock()
                self._anomalies.append(now)
                while self._anomalies and self._anomalies[0] < now - s.breaker_window_s:
                    self._anomalies.popleft()
                if len(self._anomalies) >= s.breaker_anomalies:
                    self._trip()
                return
            if not verdict.verified:
                return  # nothing was decided: not a probe
            if verdict.findings:
                self.clean_probes = 0
                self.metrics.inc(S.BREAKER_PROBES, result="anomalous")
                return
            self.clean_probes += 1
            self.metrics.inc(S.BREAKER_PROBES, result="clean")
            if self.clean_probes >= s.breaker_probes:
                self._close()

    def _trip(self) -> None:
        self.open = True
        self.clean_probes = 0
        self.trips += 1
        self._set(False)
        self.metrics.inc(S.BREAKER_TRIPS)
        self.metrics.gauge(S.BREAKER_OPEN).set(1)
        log.warning("circuit breaker open: %d anomalies within %gs; serving no cache hits "
                    "until %d clean probes", len(self._anomalies),
                    self.settings.breaker_window_s, self.settings.breaker_probes)

    def _close(self) -> None:
        self.open = False
        self._anomalies.clear()
        self._set(True)
        self.metrics.gauge(S.BREAKER_OPEN).set(0)
        log.warning("circuit breaker closed after %d clean probes: serving cache hits again",
                    self.clean_probes)


class Actions:
    """The actions a Monitor was configured with, as verdict listeners."""

    def __init__(self, evictor: Evictor | None, metrics: Any, adapter_timeout_s: float,
                 settings: ActionSettings,
                 set_hits_allowed: Callable[[bool], None] = lambda allowed: None) -> None:
        """``evictor``: where quarantine evicts (the adapter's declared capability, or
        ``None``: it can only count); ``set_hits_allowed``: the breaker's switch (the
        composition sets the Monitor's ``hits_allowed`` with it)."""
        self.settings = settings
        m = metrics
        m.gauge(S.ACTION_ENABLED, action=Action.QUARANTINE.value).set(int(settings.quarantine))
        m.gauge(S.ACTION_ENABLED, action=Action.BREAKER.value).set(int(settings.breaker))
        self.quarantine = (Quarantine(evictor, m, adapter_timeout_s)
                           if settings.quarantine else None)
        self.breaker = (CircuitBreaker(settings, m, set_hits_allowed)
                        if settings.breaker else None)

    def listeners(self) -> list[Callable[[Verdict], None]]:
        # The breaker first: the verdict that trips it is counted before its blocks go.
        out: list[Callable[[Verdict], None]] = []
        if self.breaker is not None:
            out.append(self.breaker.on_verdict)
        if self.quarantine is not None:
            out.append(self.quarantine.on_verdict)
        return out
