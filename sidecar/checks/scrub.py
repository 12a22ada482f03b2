"""Background scrub: re-verify resident cache entries nobody is hitting, like a storage
deep-scrub.

Sampling only ever checks blocks that are hit, so a block corrupted while it sits idle in the
cache (a bit flip, a late write, a bad tier load) is found at the earliest when a request is
served from it: after the damage is done. The scrub walks the resident set the Monitor's
store index knows (:meth:`sidecar.core.store_index.StoreIndex.resident`) in passes and verifies
blocks through the same :class:`~sidecar.checks.verifier.Verifier` and reporter as sampled hits, so
its findings are ordinary anomalies with evidence.

* **Which blocks**: each pass is a random order of the resident set, seeded per replica
  (host name and pid unless ``scrub_seed`` is set) so replicas do not scrub in lockstep.
  Blocks near an earlier anomaly (the same hit, neighbouring block ids: corruption clusters)
  and blocks that came back from a lower tier (:meth:`Scrubber.on_tier`) jump the queue.
  Blocks seen in a sampled hit within ``scrub_idle_s`` are skipped (the hit path checks
  them), and the adapter declines blocks a live sequence holds now.
* **How a block is checked**: the adapter rebuilds a hit ending with the block
  (:class:`sidecar.core.protocol.ScrubSource`); without that capability nothing is scrubbed
  and every candidate is counted ``unsupported``.
* **How much**: a recompute budget in tokens per minute
  (:class:`sidecar.checks.recompute_budget.RecomputeBudget`, the hit path's mechanism), a block
  cap per tick, and no tick at all while samples wait for the verifier or the adapter says
  the engine is busy (``busy()``, optional). The measured rate is exported next to the
  budget.
* **When**: an APScheduler interval job with jitter, ``max_instances=1``, ``coalesce`` and a
  misfire grace time (as :mod:`sidecar.allocator.poller`), so a slow tick never stacks up.

While the circuit breaker is open (:mod:`sidecar.protect.actions`) the scrub's verifications are the
breaker's probes: it then ticks even when the scrub itself is switched off, and does not skip
recently hit blocks (those are the suspects).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar import signals as S
from sidecar.checks.calibration import Calibration
from sidecar.checks.recompute_budget import RecomputeBudget
from sidecar.checks.verifier import Sample, Verdict, Verifier
from sidecar.core import attach
from sidecar.core.cache_view import CacheView
from sidecar.core.protocol import Adapter, BlockRef, EngineInfo, Hit, TierState
from sidecar.core.time_limits import Guard
from sidecar.export.metrics import Metrics
from sidecar.signals import ScrubSkip

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (group_id, block_id)
NEIGHBOUR_RADIUS = 2  # block ids this close to an anomalous block are scrubbed first
MEMORY = 65_536  # bound of the recently-hit and priority maps


@dataclass(frozen=True)
class ScrubSettings:
    """The scrub's knobs, read from :class:`sidecar.config.settings.SidecarConfig` (``scrub_*``)."""

    enabled: bool = False
    every_s: float = 10.0
    jitter_s: float = 2.0
    blocks_per_tick: int = 4
    tokens_per_minute: float = 60_000.0
    idle_s: float = 30.0
    max_pending: int = 0
    seed: int | None = None

    @classmethod
    def of(cls, config: Any) -> ScrubSettings:
        return cls(config.scrub, config.scrub_every_s, config.scrub_jitter_s,
                   config.scrub_blocks_per_tick, config.scrub_tokens_per_minute,
                   config.scrub_idle_s, config.scrub_max_pending, config.scrub_seed)


def replica_seed() -> int:
    """A seed that differs between replicas (host and process) and is stable within one."""
    return zlib.crc32(f"{socket.gethostname()}/{os.getpid()}".encode())


@dataclass(frozen=True)
class ScrubDeps:
    """What the scrub works with (built by :func:`sidecar.core.compose.scrubber_for`): the
    adapter and engine, where to count, the hit path's calibration, the store as of now,
    the hit path's queue length (a long queue skips a tick) and where its verdicts go."""

    adapter: Adapter
    info: EngineInfo
    metrics: Metrics
    calibration: Calibration
    recompute: bool
    adapter_timeout_s: float
    cache: CacheView
    pending: Callable[[], int]
    apply: Callable[[Verdict], None]
    capabilities: attach.Capabilities | None = None  # the Monitor's, resolved at attach


class Scrubber:
    """The background scrub of one Monitor (see the module docstring)."""

    def __init__(self, deps: ScrubDeps, settings: ScrubSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.deps = deps
        self.settings = settings
        self.seed = settings.seed if settings.seed is not None else replica_seed()
        self._rng = random.Random(self.seed)
        self._clock = clock
        self.adapter = deps.adapter
        # The Monitor's capabilities as resolved at attach; resolved here for another adapter.
        caps = deps.capabilities
        self.capabilities = caps if caps is not None and caps.adapter is self.adapter \
            else attach.resolve(self.adapter, quiet=True)
        self._source = self.capabilities.scrub_source
        self.guard = Guard(deps.adapter_timeout_s)  # a hung scrub_hit wedges only the scrub
        # Its own verifier: same checks, tolerance and calibration, but not the hit path's
        # recompute budget nor its guard. The scrub's own budget (below) is spent here per
        # block, so the verifier's is unlimited (0): one budget per job, never two.
        self.verifier = Verifier(self.adapter, deps.info, self.guard, RecomputeBudget(0),
                                 recompute=deps.recompute, epoch_of=deps.cache.epoch,
                                 calibration=deps.calibration,
                                 capabilities=self.capabilities)
        tick_s = settings.every_s + settings.jitter_s
        self.budget = RecomputeBudget.per_minute(
            settings.tokens_per_minute, settings.tokens_per_minute / 60.0 * tick_s, clock=clock)
        self._lock = threading.Lock()
        self._recent: OrderedDict[Key, float] = OrderedDict()  # seen in a sampled hit
        self._priority: OrderedDict[Key, str] = OrderedDict()  # near an anomaly, tier load
        self._order: list[Key] = []
        self._pos = 0
        self._done: set[Key] = set()
        self._last_done: set[Key] = set()
        self._own = threading.local()  # .applying: this thread reports a scrub verdict now
        self.passes = 0
        self.started_at = time.time()
        self.last_pass: float | None = None
        self.probe_mode: Callable[[], bool] = lambda: False  # set by the breaker
        self._scheduler: Any = None
        m = deps.metrics
        for result in ("clean", "anomalous", "dropped"):
            m.inc(S.SCRUB_VERIFIED, 0, result=result)
        for reason in ScrubSkip:
            m.inc(S.SCRUB_SKIPPED, 0, reason=reason.value)
        m.inc(S.SCRUB_RECOMPUTE_TOKENS, 0)
        m.inc(S.SCRUB_PASSES, 0)
        m.gauge(S.SCRUB_BUDGET).set(settings.tokens_per_minute if settings.enabled else 0)
        if settings.enabled:
            m.gauge(S.SCRUB_LAST_PASS).set(self.started_at)
            # Known from the start: nothing scrubbed yet (no series would read as "unknown").
            m.gauge(S.SCRUB_PROGRESS).set(0.0)
            m.gauge(S.SCRUB_COVERAGE).set(0.0)
            m.gauge(S.SCRUB_RECOMPUTE_RATE).set(0.0)

    # ------------------------------------------------------------------ events
    def on_verdict(self, verdict: Verdict) -> None:
        """Verdict listener: blocks of sampled hits count as recently hit; blocks near an
        anomalous block go to the front of the queue."""
        hit = verdict.sample.hit
        now = self._clock()
        with self._lock:
            if not getattr(self._own, "applying", False):  # the scrub's own: not a hit
                for gid, ids in hit.blocks.items():
                    for b in ids:
                        _remember(self._recent, (gid, int(b)), now)
            for f in verdict.findings:
                ids = hit.blocks.get(f.group_id, ())
                if not 0 <= f.block_index < len(ids):
                    continue
                bad = int(ids[f.block_index])
                near = {int(b) for b in ids}
                near.update(range(bad - NEIGHBOUR_RADIUS, bad + NEIGHBOUR_RADIUS + 1))
                near.discard(bad)  # the bad one itself is reported (and maybe evicted)
                for b in sorted(near):
                    _remember(self._priority, (f.group_id, b), "anomaly")

    def on_tier(self, group_id: int, block_id: int, state: TierState,
                seconds: float | None = None) -> None:
        """A block came back from a lower tier (``loaded``): scrub it soon. The Monitor's
        ``on_tier`` forwards here (O(1), never raises)."""
        try:
            if state is TierState.LOADED:
                with self._lock:
                    _remember(self._priority, (int(group_id), int(block_id)), "tier")
        except Exception:
            log.debug("scrub on_tier ignored a bad event", exc_info=True)

    # ------------------------------------------------------------------ one tick
    @property
    def active(self) -> bool:
        return self.settings.enabled or self.probe_mode()

    def _busy(self) -> bool:
        if self.deps.pending() > self.settings.max_pending:
            return True
        busy = self.capabilities.busy
        try:
            return bool(busy()) if busy is not None else False
        except Exception:
            return False

    def tick(self) -> list[Verdict]:
        """Verify up to ``blocks_per_tick`` candidates within the budget; the verdicts."""
        if not self.active:
            return []
        m = self.metrics
        if self._busy():
            m.inc(S.SCRUB_SKIPPED, reason=ScrubSkip.LOAD.value)
            return []
        probing = self.probe_mode()
        resident = {(g, b): p for g, b, p in self._resident()}
        verdicts: list[Verdict] = []
        bs = self.deps.info.block_size
        examined = 0  # each resident block at most once a tick, whatever is skipped
        while len(verdicts) < self.settings.blocks_per_tick and examined <= len(resident):
            key = self._next(resident)
            if key is None:
                break
            examined += 1
            cost = resident[key] + bs
            if not self.budget.allows(cost):
                m.inc(S.SCRUB_SKIPPED, reason=ScrubSkip.BUDGET.value)
                self._requeue(key)
                break
            last_hit = self._recent.get(key)
            if not probing and last_hit is not None \
                    and self._clock() - last_hit < self.settings.idle_s:
                m.inc(S.SCRUB_SKIPPED, reason=ScrubSkip.RECENTLY_HIT.value)
                continue
            verdict = self._verify(key, cost)
            if verdict is not None:
                verdicts.append(verdict)
        self._publish(resident)
        return verdicts

    def _next(self, resident: dict[Key, int]) -> Key | None:
        """The next resident candidate: queue jumpers first, then the pass order. Starts a
        new pass when the order is exhausted."""
        with self._lock:
            while self._priority:
                key, _ = self._priority.popitem(last=False)
                if key in resident:
                    return key
            for _ in range(2):  # at most one pass boundary per call
                while self._pos < len(self._order):
                    key = self._order[self._pos]
                    self._pos += 1
                    if key in resident and key not in self._done:
                        return key
                self._new_pass(resident)
                if not self._order:
                    return None
            return None

    def _requeue(self, key: Key) -> None:
        with self._lock:
            if self._pos > 0 and self._order[self._pos - 1] == key:
                self._pos -= 1
            else:
                self._priority[key] = "budget"
                self._priority.move_to_end(key, last=False)

    def _new_pass(self, resident: dict[Key, int]) -> None:
        if self._order:  # a pass over an actual resident set just ended
            self.passes += 1
            self.metrics.inc(S.SCRUB_PASSES)
        self.last_pass = time.time()
        if self.settings.enabled:
            self.metrics.gauge(S.SCRUB_LAST_PASS).set(self.last_pass)
        self._last_done, self._done = self._done, set()
        self._order = sorted(resident)
        self._rng.shuffle(self._order)
        self._pos = 0

    def _verify(self, key: Key, cost: int) -> Verdict | None:
        m = self.metrics
        gid, bid = key
        if self._source is None:
            m.inc(S.SCRUB_SKIPPED, reason=ScrubSkip.UNSUPPORTED.value)
            return None
        try:
            hit = self.guard.call("scrub_hit", self._source.scrub_hit, gid, bid)
        except Exception as exc:
            m.inc(S.SCRUB_SKIPPED, reason=ScrubSkip.ADAPTER_ERROR.value)
            log.warning("adapter scrub_hit(%s, %s) failed: %s", gid, bid, exc)
            return None
        ref = _last_ref(hit, gid, bid)
        if hit is None or ref is None:
            m.inc(S.SCRUB_SKIPPED, reason=ScrubSkip.UNAVAILABLE.value)
            return None
        self.budget.spend(cost)
        m.inc(S.SCRUB_RECOMPUTE_TOKENS, cost)
        records, epochs = self.deps.cache.snapshot((ref,))
        verdict = self.verifier.verify(Sample(hit, (ref,), records, time.time(), epochs))
        with self._lock:
            self._done.add(key)
        self._own.applying = True
        try:
            self.deps.apply(verdict)  # signals, evidence, listeners (the breaker's probes)
        finally:
            self._own.applying = False
        result = ("anomalous" if verdict.findings
                  else "clean" if verdict.verified else "dropped")
        m.inc(S.SCRUB_VERIFIED, result=result)
        return verdict

    def _publish(self, resident: dict[Key, int]) -> None:
        m = self.metrics
        with self._lock:
            n = len(self._order)
            progress = self._pos / n if n else 1.0
            seen = self._done | self._last_done
            covered = sum(1 for k in resident if k in seen)
        m.gauge(S.SCRUB_PROGRESS).set(progress)
        m.gauge(S.SCRUB_COVERAGE).set(covered / len(resident) if resident else 1.0)
        m.gauge(S.SCRUB_RECOMPUTE_RATE).set(self.budget.last_minute())

    def run_pass(self, max_ticks: int = 10_000) -> list[Verdict]:
        """Tick until the current pass completes (tests, on-demand scrubs)."""
        start = self.passes
        out: list[Verdict] = []
        for _ in range(max_ticks):
            out.extend(self.tick())
            if self.passes > start:
                break
        return out

    # ------------------------------------------------------------------ plumbing
    @property
    def metrics(self) -> Metrics:
        return self.deps.metrics

    def _resident(self) -> list[tuple[int, int, int]]:
        return self.deps.cache.resident()

    def _scheduled(self) -> None:
        try:
            self.tick()
        except Exception:
            log.exception("scrub tick failed (skipped)")

    def start(self) -> None:
        """Schedule ticks (idempotent): every ``every_s`` plus up to ``jitter_s``."""
        if self._scheduler is not None:
            return
        from apscheduler.schedulers.background import BackgroundScheduler

        s = self.settings
        self.budget.restart()
        self._scheduler = BackgroundScheduler(daemon=True, job_defaults={
            "coalesce": True, "max_instances": 1,
            "misfire_grace_time": max(1, int(s.every_s))})
        self._scheduler.add_job(self._scheduled, "interval", seconds=s.every_s,
                                jitter=s.jitter_s or None, id="scrub")
        self._scheduler.start()

    @property
    def alive(self) -> bool:
        return self._scheduler is not None and self._scheduler.running

    def stop(self) -> None:
        """Stop ticking; a tick under way finishes first (each of its adapter calls is time
        limited), so no scrub verdict reaches the listeners after ``stop`` returns."""
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=True)
        self._scheduler = None
        self.guard.close()


def _last_ref(hit: Hit | None, group_id: int, block_id: int) -> BlockRef | None:
    """The ref of ``block_id`` as the last block of the rebuilt hit, if it is one."""
    if hit is None:
        return None
    ids = hit.blocks.get(group_id)
    if not ids or int(ids[-1]) != block_id:
        return None
    return BlockRef(group_id, len(ids) - 1, block_id)


def _remember(store: OrderedDict[Key, Any], key: Key, value: Any) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > MEMORY:
        store.popitem(last=False)
