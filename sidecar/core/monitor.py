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

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.allocator import AllocatorHealth, LifecycleLog
from sidecar.allocator.poller import AllocatorPoller
from sidecar.checks.scrub import Scrubber
from sidecar.checks.verifier import Sample, Verdict, Verifier
from sidecar.config.settings import SidecarConfig
from sidecar.core import attach
from sidecar.core import hook_input as HI
from sidecar.core.cache_view import CacheView
from sidecar.core.compose import wire
from sidecar.core.dispatch import Dispatcher
from sidecar.core.hit_input import check_hit_shape, check_sampled_hit
from sidecar.core.journal import CacheEventJournal
from sidecar.core.journal_hooks import JournaledHooks
from sidecar.core.protocol import (
    Adapter,
    AllocatorState,
    BlockKV,
    BlockRef,
    BlockWrite,
    EngineInfo,
    Hit,
    Lookup,
    TierState,
)
from sidecar.core.report import VerdictReporter
from sidecar.core.sampled_hits import SampledHits
from sidecar.core.sampling import Burst, Sampler, UniformSampler
from sidecar.core.store_index import StoreIndex
from sidecar.core.time_limits import Guard
from sidecar.core.verdict_listeners import VerdictListeners
from sidecar.evidence.record import EvidenceLog
from sidecar.export.metrics import Metrics
from sidecar.export.outlook import DetectionOutlook
from sidecar.export.recovery import GroupSignals
from sidecar.export.summary import p99, summarize
from sidecar.protect.actions import Actions
from sidecar.signals import DropReason

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class Monitor(JournaledHooks, SampledHits):
    """Implements :class:`sidecar.core.protocol.EventSink` (module docstring); collaborators
    are set by :func:`sidecar.core.compose.wire`; the hooks need only an EventJournal."""

    metrics: Metrics
    journal: CacheEventJournal
    stored: StoreIndex
    lifecycle: LifecycleLog
    cache: CacheView
    verifier: Verifier
    evidence: EvidenceLog
    _latencies: deque[float]
    allocator_health: AllocatorHealth
    poller: AllocatorPoller
    reporter: VerdictReporter
    verdict_listeners: VerdictListeners
    dispatcher: Dispatcher
    _c_lookups: Any
    _c_query_tokens: Any
    _c_hits: Any
    _c_sampled: Any
    _c_hit_tokens: Any
    _h_latency: Any
    group_signals: GroupSignals
    _should_sample: Callable[[Hit], bool]
    hits_allowed: bool
    actions: Actions
    scrubber: Scrubber | None
    outlook: DetectionOutlook

    def __init__(self, adapter: Adapter, config: SidecarConfig | None = None,
                 registry: CollectorRegistry | None = None, sampler: Sampler | None = None,
                 info: EngineInfo | None = None) -> None:
        self.config = c = config or SidecarConfig()
        c.validate()
        self.adapter = adapter
        self.guard = Guard(c.adapter_timeout_s)
        # describe() is the one call allowed to fail loudly: without it nothing can be checked.
        self.info = info or self.guard.call("describe", adapter.describe)
        self.sampler: Sampler = sampler or UniformSampler(
            c.sample_every, c.seed, burst=Burst(c.burst_hits, c.burst_every))
        # Optional capabilities resolved once, here (sidecar.core.attach): a wrongly shaped
        # one is refused and logged now; policies that learn from cache events get them.
        self.capabilities = caps = attach.resolve(adapter, self.sampler)
        self._sampler_store = caps.observe_store
        self._sampler_free = caps.observe_free
        self._sampler_release = caps.observe_release
        self._hook_error_logged: set[str] = set()
        self._reject_cells: dict[tuple[str, HI.InputReject], Any] = {}
        self.requests_done = 0
        self.watching_since = time.time()  # reset by start(): /healthz's stall clock
        wire(self, registry, caps)  # every collaborator (sidecar.core.compose)
        attach.export(caps, self.metrics)
        self._capture = caps.capture if c.capture else None
        self._started = False

    # ------------------------------------------------------------------ hot path (engine)
    def on_lookup(self, lookup: Lookup) -> None:
        try:
            if type(lookup) is not Lookup:  # None, a stranger (a subclass too): refused
                self._reject("on_lookup", HI.InputReject.TYPE)
                return
            q, h = lookup.query_tokens, lookup.hit_tokens
            # O(1) count checks inline (hook_input: full rules, reasons); the hit when sampled.
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
                # O(groups) here; every id is checked by the verifier (sidecar.core.hit_input)
                if self._reject("on_lookup", HI.check_lookup(lookup)
                                or check_hit_shape(hit, self.info.groups)):
                    return
                self._enqueue(hit, lookup.seq_id, h)
        except Exception as exc:
            self._hook_failed("on_lookup", exc)

    def on_captured(self, lookup: Lookup, blocks: Sequence[BlockKV],
                    writes: Mapping[BlockRef, BlockWrite] | None = None) -> Verdict | None:
        """A hit sampled and captured elsewhere (a probe copied ``blocks`` out at match time;
        ``writes``: what it recorded at their writes): counted like ``on_lookup``, verified
        through the same dispatch. Returns the verdict in inline dispatch mode. Never raises."""
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
            if not refs and lookup.hit_tokens < self.info.block_size:
                return None  # no block: judged on coverage alone, where it claims one
            self._log_hit(hit, lookup.seq_id, lookup.hit_tokens)
            self._c_sampled.value += 1
            return self.dispatcher.submit(self._take(hit, refs, captured, writes))
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

    # _enqueue, _sample, _take, _capture_now, _log_hit: sidecar.core.sampled_hits (SampledHits)

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
            self.watching_since = time.time()
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
        self.guard.close()
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
        """Turn a verdict into signals, evidence and sampler feedback (sidecar.core.report),
        then hand it to the verdict listeners in their stated order
        (:mod:`sidecar.core.verdict_listeners`: signals, export, actions, extras)."""
        self.journal.drain()  # the lifecycle in the evidence is complete up to now
        self.reporter.apply(verdict)

    def poll_allocator(self) -> AllocatorState | None:
        """Poll the allocator now (sidecar.allocator.poller): state, invariants, leak trend."""
        return self.poller.poll()

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` reports: the threads that must run, and whether verification
        progresses (silence is not health)."""
        return {"verifier_alive": self.dispatcher.alive, "poller_alive": self.poller.alive,
                "allocator_degraded": self.poller.degraded,
                "journal_alive": self.journal.alive or not self._started,
                "journal_pending": self.journal.pending, "journal_resets": self.journal.resets,
                "pending_samples": self.dispatcher.pending,
                "verified_samples": self.dispatcher.verified_samples,
                "last_verification": self.reporter.last_verification,
                "last_allocator_poll": self.poller.last_poll,
                "watching_since": self.watching_since}

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
