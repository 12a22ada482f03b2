"""Composition: the one function that builds a Monitor's collaborators and wires them.

The Monitor (:mod:`sidecar.core.monitor`) owns the hot path; everything else it works with
is built here, each part given what it needs as typed values and callables — the store view,
a metrics object, a ``pending()`` count, an ``apply`` — never the Monitor itself, so no part
reaches back into it. :func:`wire` sets the parts onto the Monitor as plain attributes (the
hot path reads them with one attribute load, as before); the order of the verdict listeners
is stated in :mod:`sidecar.core.verdict_listeners`.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.allocator import AllocatorHealth, LeakTrend, LifecycleLog
from sidecar.allocator.poller import AllocatorPoller
from sidecar.checks.calibration import Calibration, calibration_config
from sidecar.checks.recompute_budget import RecomputeBudget
from sidecar.checks.scrub import Scrubber, ScrubDeps, ScrubSettings
from sidecar.checks.verifier import Verifier
from sidecar.core import hook_input as HI
from sidecar.core.attach import Capabilities
from sidecar.core.cache_view import CacheView
from sidecar.core.dispatch import Dispatcher
from sidecar.core.journal import CacheEventJournal
from sidecar.core.protocol import EngineInfo
from sidecar.core.report import VerdictReporter
from sidecar.core.store_index import StoreIndex
from sidecar.core.verdict_listeners import Stage
from sidecar.evidence.record import EvidenceLog
from sidecar.export.metrics import Metrics
from sidecar.export.outlook import DetectionOutlook
from sidecar.export.recovery import GroupSignals
from sidecar.protect.actions import Actions, ActionSettings
from sidecar.signals import DropReason

# The hooks whose errors are counted (kvsidecar_hook_errors_total{hook}), created at 0.
HOOKS = ("on_lookup", "on_captured", "on_store", "on_free", "on_request_done", "on_allocate",
         "on_release", "capture", "on_tier")


def wire(mon: Any, registry: CollectorRegistry | None, caps: Capabilities) -> None:
    """Build and attach every collaborator of ``mon``, a :class:`sidecar.core.monitor.Monitor`
    with its ``config``, ``adapter``, ``guard``, ``info`` and ``sampler`` already set (typed
    ``Any``: the Monitor imports this module, and an import back would be a circle), given
    the adapter's and sampler's optional capabilities as resolved at attach (``caps``)."""
    c, info, adapter = mon.config, mon.info, mon.adapter
    mon.metrics = m = Metrics(info.engine, info.model, registry)
    mon.stored = StoreIndex(c.store_records)
    mon.lifecycle = LifecycleLog(c.lifecycle_sample_rate, c.lifecycle_window,
                                 burst=c.lifecycle_burst)
    # Store/free events leave the engine's thread as one append (sidecar.core.journal).
    mon.journal = CacheEventJournal(mon.stored, mon.lifecycle,
                                    reject=lambda hook, why: mon._reject(hook, why))
    mon.lifecycle.before_read = mon.journal.drain
    mon.cache = cache = CacheView(mon.journal, mon.stored)
    mon.verifier = Verifier(adapter, info, mon.guard,
                            RecomputeBudget(c.recompute_tokens_per_s, full=True),
                            recompute=c.recompute, epoch_of=cache.epoch,
                            calibration=Calibration(info.dtype, info.kv_storage,
                                                    calibration_config(c), model=info.model),
                            max_recomputes=c.max_concurrent_recomputes,
                            max_recoveries=c.max_concurrent_recoveries, reject=mon._reject,
                            capabilities=caps)
    mon.evidence = EvidenceLog(c.evidence_capacity, c.evidence_dir)
    mon._latencies = deque(maxlen=c.latency_window)
    mon.allocator_health = AllocatorHealth(m, mon.evidence, mon.lifecycle,
                                           LeakTrend(c.leak_window), info.engine, info.model,
                                           lambda: mon._c_hit_tokens.value)
    mon.poller = AllocatorPoller(adapter, m, mon.allocator_health, lambda: mon.requests_done,
                                 c.adapter_timeout_s, c.allocator_every_s,
                                 c.allocator_check_min_interval_s,
                                 introspection=caps.introspection)
    mon.reporter = VerdictReporter(m, info, mon.evidence, mon.allocator_health, mon.sampler,
                                   mon.verifier.calibration, lambda: mon.requests_done,
                                   mon.poller.nudge)
    mon.verdict_listeners = listeners = mon.reporter.listeners
    # ``apply`` looked up per verdict, so a caller may wrap it (benchmarks timing it).
    mon.dispatcher = Dispatcher(mon.verifier.verify, lambda v: mon.apply(v), mon._drop,
                                c.dispatch, c.queue_size)
    init_series(m, info, mon.verifier)
    # The hot path updates these cells in place (sidecar.export.instruments): no lookups.
    mon._c_lookups = m.cell(S.LOOKUPS)
    mon._c_query_tokens = m.cell(S.QUERY_TOKENS)
    mon._c_hits = m.cell(S.HITS)
    mon._c_sampled = m.cell(S.SAMPLED)
    mon._c_hit_tokens = m.cell(S.HIT_TOKENS)
    mon._h_latency = m.cell(S.REQUEST_LATENCY)
    mon.group_signals = GroupSignals(m, info)  # hits per group, tier recoveries
    # Hits per cache group: a one-group engine's series is the hits cell itself (no
    # hot-path cost); a hybrid one counts the groups of each hit on the way to sampling.
    mon._should_sample = mon.group_signals.wrap(mon.sampler.should_sample)
    mon._journal_events = mon.journal.events  # the journaled hooks append inline
    mon._nudge = mon.poller.nudge
    # Background scrub and protective actions (off by default); the engine reads
    # ``hits_allowed`` (a plain attribute, O(1)) at lookup: the circuit breaker clears it.
    mon.hits_allowed = True

    def set_hits_allowed(allowed: bool) -> None:
        mon.hits_allowed = allowed
    mon.actions = actions = Actions(caps.evictor, m, c.adapter_timeout_s, ActionSettings.of(c),
                                    set_hits_allowed)
    mon.scrubber = None
    if c.scrub or c.breaker:  # the breaker's probes are scrub verifications
        mon.scrubber = scrubber = scrubber_for(mon, ScrubSettings.of(c))
        listeners.add(scrubber.on_verdict, Stage.ACTIONS)
        breaker = actions.breaker
        if breaker is not None:
            scrubber.probe_mode = lambda: breaker.open
    for listener in actions.listeners():
        listeners.add(listener, Stage.ACTIONS)
    # Verified share, expected time to detection, start bursts (sidecar.export.outlook).
    mon.outlook = DetectionOutlook(m, mon.stored, mon.sampler, lambda: mon._c_hits.value,
                                   c.detection_fault_fraction)
    listeners.add(mon.outlook.on_verdict, Stage.SIGNALS)


def scrubber_for(mon: Any, settings: ScrubSettings, **kwargs: Any) -> Scrubber:
    """A :class:`Scrubber` over ``mon``'s adapter, store and reporting (``kwargs``: the
    scrubber's own, e.g. ``clock``)."""
    deps = ScrubDeps(mon.adapter, mon.info, mon.metrics, mon.verifier.calibration,
                     mon.config.recompute, mon.config.adapter_timeout_s, mon.cache,
                     lambda: mon.dispatcher.pending, lambda v: mon.apply(v),
                     mon.capabilities)
    return Scrubber(deps, settings, **kwargs)


def init_series(m: Metrics, info: EngineInfo, verifier: Verifier) -> None:
    """Create every labelled series at 0, so rate() and dashboards see a clean zero
    instead of a missing series before the first anomaly."""
    for g in info.groups:
        m.inc(S.VERIFIED, 0, group=g.label)
        for kind in S.AnomalyKind:
            m.inc(S.ANOMALIES, 0, group=g.label, kind=kind.value)
    for reason in DropReason:
        m.inc(S.SAMPLES_DROPPED, 0, reason=reason.value)
    for hook in HOOKS:
        m.inc(S.HOOK_ERRORS, 0, hook=hook)
    for what in S.ProbeLoss:
        m.inc(S.PROBE_LOST, 0, what=what.value)
    for op, reasons in S.ADAPTER_ERROR_REASONS.items():
        for why in reasons:
            m.inc(S.ADAPTER_ERRORS, 0, op=op, reason=why.value)
    for name, value in dataclasses.asdict(S.THRESHOLDS).items():
        m.gauge(S.THRESHOLD, threshold=name).set(value)
    verifier.calibration.publish(m, verifier.reference_kind)
    HI.init_series(m)
