"""The Monitor: what an engine's hooks call. It owns the hot path and wires the rest.

Hot path (``on_lookup``/``on_store``/``on_free``/``on_request_done``): counter cells updated
in place (:mod:`sidecar.export.instruments`), a sampling decision, a store-record and epoch update
(:mod:`sidecar.core.store_index`) — O(1) per unsampled event, and a ``try/except`` around
everything so no exception ever reaches the engine. A sampled hit is taken *at match time*:
block refs, store records and epochs as they are now, and where the adapter can, a capture
of the KV the request is served. Then it is handed to the rest, one job per module:

* :mod:`sidecar.core.dispatch` — queued (bounded, never blocks), inline or deferred: one mechanism;
* :mod:`sidecar.checks.verifier` and :mod:`sidecar.checks` — the checks, cheapest first;
* :mod:`sidecar.core.report` — verdicts into signals, evidence and sampler feedback;
* :mod:`sidecar.allocator.poller` — allocator state and invariants, on a schedule and on events.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.allocator import AllocatorHealth, LeakTrend, LifecycleLog, LifecycleOp
from sidecar.allocator.poller import AllocatorPoller
from sidecar.checks.calibration import Calibration, calibration_config
from sidecar.checks.scrub import Scrubber, ScrubSettings
from sidecar.checks.verifier import Sample, TokenBucket, Verdict, Verifier
from sidecar.config.settings import SidecarConfig
from sidecar.core import attach
from sidecar.core import hook_input as HI
from sidecar.core.dispatch import Dispatcher
from sidecar.core.hit_input import check_sampled_hit
from sidecar.core.journal import CacheEventJournal
from sidecar.core.journal_hooks import JournaledHooks
from sidecar.core.protocol import (
    Adapter,
    AllocatorState,
    BlockKV,
    BlockRef,
    EngineInfo,
    Hit,
    Lookup,
    SequenceId,
    TierState,
)
from sidecar.core.report import VerdictReporter
from sidecar.core.sampling import Burst, Sampler, UniformSampler
from sidecar.core.store_index import StoreIndex
from sidecar.core.time_limits import Guard
from sidecar.evidence.record import EvidenceLog
from sidecar.export.metrics import Metrics
from sidecar.export.outlook import DetectionOutlook
from sidecar.export.recovery import GroupSignals
from sidecar.export.summary import p99, summarize
from sidecar.protect.actions import Actions, ActionSettings
from sidecar.signals import DropReason

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# The hooks whose errors are counted (kvsidecar_hook_errors_total{hook}), created at 0.
HOOKS = ("on_lookup", "on_captured", "on_store", "on_free", "on_request_done", "on_allocate",
         "on_release", "capture", "on_tier")


class Monitor(JournaledHooks):
    """Implements :class:`sidecar.core.protocol.EventSink`; see the module docstring."""

    def __init__(self, adapter: Adapter, config: SidecarConfig | None = None,
                 registry: CollectorRegistry | None = None, sampler: Sampler | None = None,
                 info: EngineInfo | None = None) -> None:
        self.config = c = config or SidecarConfig()
        c.validate()
        self.adapter = adapter
        self.guard = Guard(c.adapter_timeout_s)
        # describe() is the one call allowed to fail loudly: without it nothing can be checked.
        self.info = info or self.guard.call("describe", adapter.describe)
        self.metrics = Metrics(self.info.engine, self.info.model, registry)
        self.sampler: Sampler = sampler or UniformSampler(
            c.sample_every, c.seed, burst=Burst(c.burst_hits, c.burst_every))
        # Optional capabilities resolved once, here (sidecar.core.attach): a wrongly shaped
        # one is refused and logged now; policies that learn from cache events get them.
        self.capabilities = caps = attach.resolve(adapter, self.sampler)
        attach.export(caps, self.metrics)
        self._sampler_store = caps.observe_store
        self._sampler_free = caps.observe_free
        self._sampler_release = caps.observe_release
        self.stored = StoreIndex(c.store_records)
        self.verifier = Verifier(adapter, self.info, self.guard,
                                 TokenBucket(c.recompute_tokens_per_s),
                                 recompute=c.recompute, epoch_of=self._epoch_now,
                                 calibration=Calibration(self.info.dtype, self.info.kv_storage,
                                                         calibration_config(c),
                                                         model=self.info.model),
                                 max_recomputes=c.max_concurrent_recomputes,
                                 max_recoveries=c.max_concurrent_recoveries,
                                 capabilities=caps)
        self.evidence = EvidenceLog(c.evidence_capacity, c.evidence_dir)
        self._latencies: deque[float] = deque(maxlen=c.latency_window)
        self._hook_error_logged: set[str] = set()
        self._reject_cells: dict[tuple[str, HI.InputReject], Any] = {}
        self.requests_done = 0
        self.lifecycle = LifecycleLog(c.lifecycle_sample_rate, c.lifecycle_window,
                                      burst=c.lifecycle_burst)
        # Store/free events leave the engine's thread as one append (sidecar.core.journal).
        self.journal = CacheEventJournal(
            self.stored, self.lifecycle,
            reject=lambda hook, why: self._reject(hook, why))
        self.lifecycle.before_read = self.journal.drain
        self.allocator_health = AllocatorHealth(self.metrics, self.evidence, self.lifecycle,
                                                LeakTrend(c.leak_window), self.info.engine,
                                                self.info.model)
        self.poller = AllocatorPoller(adapter, self.metrics, self.allocator_health,
                                      lambda: self.requests_done, c.adapter_timeout_s,
                                      c.allocator_every_s, c.allocator_check_min_interval_s,
                                      introspection=caps.introspection)
        self.reporter = VerdictReporter(self.metrics, self.info, self.evidence,
                                        self.allocator_health, self.sampler,
                                        self.verifier.calibration,
                                        lambda: self.requests_done, self.poller.nudge)
        # ``apply`` looked up per verdict, so a caller may wrap it (benchmarks timing it).
        self.dispatcher = Dispatcher(self.verifier.verify, lambda v: self.apply(v), self._drop,
                                     c.dispatch, c.queue_size)
        self._init_series()
        m = self.metrics
        # The hot path updates these cells in place (sidecar.export.instruments): no lookups.
        self._c_lookups = m.cell(S.LOOKUPS)
        self._c_query_tokens = m.cell(S.QUERY_TOKENS)
        self._c_hits = m.cell(S.HITS)
        self._c_hit_tokens = m.cell(S.HIT_TOKENS)
        self._h_latency = m.cell(S.REQUEST_LATENCY)
        self.group_signals = GroupSignals(m, self.info)  # hits per group, tier recoveries
        # Hits per cache group: a one-group engine's series is the hits cell itself (no
        # hot-path cost); a hybrid one counts the groups of each hit on the way to sampling.
        self._should_sample = self.group_signals.wrap(self.sampler.should_sample)
        self._journal_events = self.journal.events  # the journaled hooks append inline
        self._nudge = self.poller.nudge
        self._capture = caps.capture if c.capture else None
        self._started = False
        # Background scrub and protective actions (sidecar/scrub.py, sidecar/actions.py;
        # off by default): verdict listeners run after each verdict is reported, and the
        # engine reads ``hits_allowed`` (a plain attribute, O(1)) at lookup: the circuit
        # breaker clears it while open.
        self.hits_allowed = True
        self.verdict_listeners: list[Callable[[Verdict], None]] = []
        self.actions = Actions(self, ActionSettings.of(c))
        self.scrubber: Scrubber | None = None
        if c.scrub or c.breaker:  # the breaker's probes are scrub verifications
            self.scrubber = scrubber = Scrubber(self, ScrubSettings.of(c))
            self.verdict_listeners.append(scrubber.on_verdict)
            breaker = self.actions.breaker
            if breaker is not None:
                scrubber.probe_mode = lambda: breaker.open
        self.verdict_listeners.extend(self.actions.listeners())
        # Verified share, expected time to detection, start bursts (sidecar/outlook.py).
        self.outlook = DetectionOutlook(m, self.stored, self.sampler,
                                        lambda: self._c_hits.value, c.detection_fault_fraction)
        self.verdict_listeners.append(self.outlook.on_verdict)

    def _init_series(self) -> None:
        """Create every labelled series at 0, so rate() and dashboards see a clean zero
        instead of a missing series before the first anomaly."""
        m = self.metrics
        for g in self.info.groups:
            m.inc(S.VERIFIED, 0, group=g.label)
            for kind in S.AnomalyKind:
                m.inc(S.ANOMALIES, 0, group=g.label, kind=kind.value)
        for reason in DropReason:
            m.inc(S.SAMPLES_DROPPED, 0, reason=reason.value)
        for hook in HOOKS:
            m.inc(S.HOOK_ERRORS, 0, hook=hook)
        for op, reasons in S.ADAPTER_ERROR_REASONS.items():
            for why in reasons:
                m.inc(S.ADAPTER_ERRORS, 0, op=op, reason=why.value)
        for name, value in dataclasses.asdict(S.THRESHOLDS).items():
            m.gauge(S.THRESHOLD, threshold=name).set(value)
        self.verifier.calibration.publish(m, self.verifier.reference_kind)
        HI.init_series(m)

    # ------------------------------------------------------------------ hot path (engine)
    def on_lookup(self, lookup: Lookup) -> None:
        try:
            if type(lookup) is not Lookup:  # None, a stranger (a subclass too): refused
                self._reject("on_lookup", HI.InputReject.TYPE)
                return
            q, h = lookup.query_tokens, lookup.hit_tokens
            # The counts checked in O(1) inline (sidecar.core.hook_input has the full rules and
            # the reasons); the hit itself is checked only when it is sampled.
            if (type(q) is not int or type(h) is not int or not 0 <= h <= q <= HI.MAX_TOKENS) \
                    and self._reject("on_lookup", HI.check_lookup(lookup)):
                return
            self._c_lookups.value += 1
            self._c_query_tokens.value += q
            if h <= 0:
                return
            self._c_hits.value += 1
            self._c_hit_tokens.value += h
            hit = lookup.hit
            if hit is not None and self._should_sample(hit):  # walked from here on
                if self._reject("on_lookup", HI.check_lookup(lookup)
                                or check_sampled_hit(hit, self.info.groups)):
                    return
                self._enqueue(hit, lookup.seq_id, h)
        except Exception as exc:
            self._hook_failed("on_lookup", exc)

    def on_captured(self, lookup: Lookup, blocks: Sequence[BlockKV]) -> Verdict | None:
        """A hit sampled and captured elsewhere (an out-of-process probe copied ``blocks``
        out of the engine at match time): counted like ``on_lookup``, then verified through
        the same dispatch, with the blocks as the capture. Returns the verdict in inline
        dispatch mode. Never raises."""
        try:
            hit = lookup.hit if type(lookup) is Lookup else None
            if self._reject("on_captured", HI.check_lookup(lookup) or (
                    None if hit is None else check_sampled_hit(hit, self.info.groups))):
                return None
            self._c_lookups.value += 1
            self._c_query_tokens.value += lookup.query_tokens
            if lookup.hit_tokens <= 0 or lookup.hit is None:
                return None
            self._c_hits.value += 1
            self._c_hit_tokens.value += lookup.hit_tokens
            hit = lookup.hit
            self.group_signals.on_hit(hit)
            captured = {b.ref: b for b in blocks}
            refs = tuple(sorted(captured, key=lambda r: (r.group_id, r.index)))
            if not refs:
                return None
            self._log_hit(hit, lookup.seq_id, lookup.hit_tokens)
            self.metrics.inc(S.SAMPLED)
            return self.dispatcher.submit(self._take(hit, refs, captured))
        except Exception as exc:
            self._hook_failed("on_captured", exc)
            return None

    # on_store, on_free, on_allocate, on_release: sidecar.core.journal_hooks (JournaledHooks)

    def on_tier(self, group_id: int, block_id: int, state: TierState,
                seconds: float | None = None) -> None:
        """Optional :class:`sidecar.core.protocol.TierSink` event: an offload-tier entry moved to
        ``state``; a finished load feeds the recovery signals (:mod:`sidecar.export.recovery`).
        O(1), never raises; bad input is counted and dropped."""
        try:
            if self._reject("on_tier", self.group_signals.on_tier(group_id, block_id, state,
                                                                  seconds)):
                return
            if self.scrubber is not None:  # a block back from a tier is scrubbed soon
                self.scrubber.on_tier(group_id, block_id, state, seconds)
        except Exception as exc:
            self._hook_failed("on_tier", exc)

    def on_request_done(self, latency_seconds: float) -> None:
        try:
            x = latency_seconds
            if (type(x) is not float or not 0.0 <= x <= HI.MAX_LATENCY_S) \
                    and self._reject("on_request_done", HI.check_latency(x)):
                return  # NaN fails the range test too
            self._h_latency.observe(x)
            self.requests_done += 1
            self._latencies.append(latency_seconds)
            self._nudge()
        except Exception as exc:
            self._hook_failed("on_request_done", exc)

    def _sample(self, hit: Hit) -> Sample | None:
        """The blocks to check, their store records and epochs as they are now (match
        time), and, where the adapter can, a capture of the KV the request is served."""
        refs = tuple(self.sampler.choose(hit, self.info.block_size,
                                         self.config.blocks_per_sample, self.info.groups))
        if not refs:
            return None
        return self._take(hit, refs, self._capture_now(hit, refs))

    def _take(self, hit: Hit, refs: tuple[BlockRef, ...],
              captured: dict[BlockRef, BlockKV] | None) -> Sample:
        """A sample as of this match: every store/free so far applied, then the refs'
        store records and epochs snapshotted next to the capture."""
        self.journal.drain()
        records, epochs = self.stored.snapshot(refs)
        return Sample(hit, refs, records, time.time(), epochs, captured)

    def _capture_now(self, hit: Hit, refs: tuple[BlockRef, ...]
                     ) -> dict[BlockRef, BlockKV] | None:
        """The served bytes of ``refs``, copied on the engine's thread before the hook
        returns (bounded in bytes); ``None`` when the adapter cannot or the copy failed."""
        if self._capture is None:
            return None
        try:
            blocks = self._capture(hit, refs)
        except Exception as exc:
            self._hook_failed("capture", exc)
            return None
        out: dict[BlockRef, BlockKV] = {}
        size = 0
        for b in blocks:
            if b.ref in refs:
                size += b.key.numel() * b.key.element_size() * 2
                out[b.ref] = b
        if size > self.config.capture_max_bytes:
            self.metrics.inc(S.SAMPLES_DROPPED, reason=DropReason.CAPTURE_TOO_LARGE.value)
            return None
        return out

    def _enqueue(self, hit: Hit, seq_id: SequenceId | None = None,
                 hit_tokens: int | None = None) -> None:
        self._log_hit(hit, seq_id, hit_tokens)
        sample = self._sample(hit)
        if sample is None:
            return
        self.metrics.inc(S.SAMPLED)
        self.dispatcher.submit(sample)

    def _log_hit(self, hit: Hit, seq_id: SequenceId | None, hit_tokens: int | None) -> None:
        """The lifecycle's hit event, per group: for sampled hits only (O(prefix))."""
        for group_id, blocks in hit.blocks.items():
            self.journal.lifecycle_event(LifecycleOp.HIT, group_id, seq_id, blocks,
                                         hit.generations.get(group_id, ()), hit_tokens)

    def _epoch_now(self, group_id: int, block_id: int) -> int:
        """A block's epoch with every store/free so far applied (the verifier's check)."""
        self.journal.drain()
        return self.stored.epoch(group_id, block_id)

    def _reject(self, hook: str, why: HI.InputReject | None) -> bool:
        """Count a rejected hook input (``hook_input_rejected_total{hook,reason}``) through
        a cached cell, so a flood of bad input costs little more than good input; True when
        the event must be dropped."""
        if why is None:
            return False
        cell = self._reject_cells.get((hook, why))
        if cell is None:
            cell = self._reject_cells[(hook, why)] = self.metrics.cell(
                S.HOOK_INPUT_REJECTED, hook=hook, reason=why.value)
        cell.value += 1
        return True

    def _drop(self, reason: DropReason) -> None:
        self.metrics.inc(S.SAMPLES_DROPPED, reason=reason.value)

    def guarded(self, hook: str) -> Callable[[F], F]:
        """A decorator for an adapter's own hook code (translating engine events into
        ``Lookup``/``StoredBlock`` calls): whatever it raises is counted in
        ``kvsidecar_hook_errors_total{hook}`` and logged once, never raised into the engine;
        the call returns ``None`` then. ``hook`` names the code (a fixed string: it is a
        label value)::

            @monitor.guarded("my_engine_match")
            def on_match(req, node): monitor.on_lookup(...)
        """
        self.metrics.inc(S.HOOK_ERRORS, 0, hook=hook)

        def wrap(fn: F) -> F:
            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                try:
                    return fn(*args, **kwargs)
                except Exception as exc:
                    self._hook_failed(hook, exc)
                    return None
            return call  # type: ignore[return-value]
        return wrap

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        try:
            self.metrics.inc(S.HOOK_ERRORS, hook=hook)
            if hook not in self._hook_error_logged:  # log the first of each, not a flood
                self._hook_error_logged.add(hook)
                log.exception("kv-sidecar hook %s failed (counted; engine unaffected): %s",
                              hook, exc)
        except Exception:
            pass

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Monitor:
        """Start verification (queued mode) and allocator polling; idempotent."""
        if not self._started:
            self._started = True
            self.journal.start()
            self.dispatcher.start()
            self.poller.start()
            if self.scrubber is not None:
                self.scrubber.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling and the worker; samples still queued are dropped and counted."""
        if self.scrubber is not None:
            self.scrubber.stop()
        self.poller.stop(timeout_s)
        self.dispatcher.stop(timeout_s)
        self.journal.stop(timeout_s)
        self._started = False

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued sample is verified; False on timeout."""
        return self.dispatcher.drain(timeout_s)

    def verify(self, hit: Hit) -> Verdict:
        """Verify one hit now, on this thread, whatever the dispatch mode (tests,
        benchmarks, on-demand checks)."""
        return self.verify_sample(self._sample(hit)
                                  or Sample(hit, (), {}, time.time(), {}, None))

    def verify_sample(self, sample: Sample) -> Verdict:
        """Verify an already-taken sample again, on this thread (e.g. against another
        reference)."""
        verdict = self.verifier.verify(sample)
        self.apply(verdict)
        return verdict

    def verify_pending(self) -> list[Verdict]:
        """Deferred mode: verify every sample kept so far, on this thread."""
        return self.dispatcher.run_pending()

    def apply(self, verdict: Verdict) -> None:
        """Turn a verdict into signals, evidence and sampler feedback (sidecar.core.report)."""
        self.journal.drain()  # the lifecycle in the evidence is complete up to now
        self.reporter.apply(verdict)
        for listener in self.verdict_listeners:  # scrub, quarantine, breaker
            try:
                listener(verdict)
            except Exception:
                log.exception("verdict listener failed (ignored)")

    def poll_allocator(self) -> AllocatorState | None:
        """Poll the allocator now (sidecar.allocator.poller): state, invariants, leak trend."""
        return self.poller.poll()

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` reports: the threads that must run, and whether verification
        progresses (silence is not health)."""
        return {"verifier_alive": self.dispatcher.alive, "poller_alive": self.poller.alive,
                "journal_alive": self.journal.alive or not self._started,
                "journal_pending": self.journal.pending, "journal_resets": self.journal.resets,
                "pending_samples": self.dispatcher.pending,
                "verified_samples": self.dispatcher.verified_samples,
                "last_verification": self.reporter.last_verification,
                "last_allocator_poll": self.poller.last_poll}

    @property
    def first_anomaly_request(self) -> int | None:
        return self.reporter.first_anomaly_request

    @property
    def max_recompute_error(self) -> float:
        return self.reporter.max_recompute_error

    # ------------------------------------------------------------------ summaries
    def p99_latency(self) -> float | None:
        return p99(self._latencies)

    def summary(self) -> dict[str, Any]:
        """The demo's JSON summary and ``/status`` (see
        :func:`sidecar.export.summary.summarize`)."""
        return {**summarize(self.metrics, self.info, self.allocator_health,
                            requests=self.requests_done, p99_latency=self.p99_latency(),
                            max_recompute_error=self.max_recompute_error,
                            tolerance=self.verifier.tolerance,
                            first_anomaly_request=self.first_anomaly_request),
                **self.outlook.summary()}
