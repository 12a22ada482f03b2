"""The Monitor: what an engine's hooks call, and the worker that verifies samples.

Hot path (``on_lookup``/``on_store``/``on_free``/``on_request_done``): counters, a sampling
decision, a dict update — O(1) per event (O(blocks sampled) for a sampled hit), and a
``try/except`` around everything so no exception ever reaches the engine. A sampled hit is
snapshotted (block refs, store records as they are *now*) and put on a bounded queue; a full
queue drops the sample and counts it, it never blocks the engine.

Worker: takes samples off the queue, runs :class:`sidecar.verifier.Verifier`, and turns each
Verdict into signals, evidence and sampler feedback.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar import hook_input as HI
from sidecar import signals as S
from sidecar.allocator import AllocatorHealth, LeakTrend, LifecycleLog, LifecycleOp, PollTrigger
from sidecar.evidence import EvidenceLog
from sidecar.guard import Guard
from sidecar.metrics import Metrics
from sidecar.protocol import (
    Adapter,
    AllocatorIntrospection,
    AllocatorState,
    BlockTableSnapshot,
    EngineInfo,
    Hit,
    Lookup,
    SequenceId,
    StoredBlock,
)
from sidecar.sampling import Sampler, UniformSampler
from sidecar.signals import DropReason
from sidecar.store_index import StoreIndex
from sidecar.summary import p99, summarize
from sidecar.verifier import Sample, TokenBucket, Verdict, Verifier

log = logging.getLogger(__name__)


@dataclass
class SidecarConfig:
    """Knobs with defaults fit for production; the demo lowers ``sample_every``."""

    sample_every: int = 1000
    blocks_per_sample: int = 2
    queue_size: int = 64
    adapter_timeout_s: float = 5.0
    recompute_tokens_per_s: float = 100_000.0  # recompute budget; <= 0 means unlimited
    recompute: bool = True
    store_records: int = 200_000  # bounded memory of stored blocks (LRU)
    evidence_capacity: int = 100
    evidence_dir: str | None = None
    latency_window: int = 10_000  # recent request latencies kept for the P99 summary
    seed: int = 0
    # Allocator health (sidecar/allocator). Besides the scheduled poll, a release or a
    # finished request triggers an invariant check, at most once per this interval
    # (0: after every event; < 0: scheduled polls only).
    allocator_check_min_interval_s: float = 0.25
    lifecycle_sample_rate: float = 0.01  # block lifecycle events logged outside bursts
    lifecycle_window: int = 2048  # full-rate lifecycle events kept in memory for evidence
    lifecycle_burst: int = 256  # events logged at full rate after an anomaly
    leak_window: int = 8  # polls the leak trend test looks at

    def validate(self) -> None:
        for name in ("sample_every", "queue_size", "store_records", "evidence_capacity",
                     "latency_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.blocks_per_sample < 1:
            raise ValueError(f"blocks_per_sample must be >= 1, got {self.blocks_per_sample}")
        if not self.adapter_timeout_s > 0:
            raise ValueError(f"adapter_timeout_s must be > 0, got {self.adapter_timeout_s}")
        if not 0.0 <= self.lifecycle_sample_rate <= 1.0:
            raise ValueError(f"lifecycle_sample_rate must be in [0, 1], got "
                             f"{self.lifecycle_sample_rate}")
        if self.leak_window < 2:
            raise ValueError(f"leak_window must be >= 2, got {self.leak_window}")


class Monitor:
    """Implements :class:`sidecar.protocol.EventSink`; see the module docstring."""

    def __init__(self, adapter: Adapter, config: SidecarConfig | None = None,
                 registry: CollectorRegistry | None = None, sampler: Sampler | None = None,
                 info: EngineInfo | None = None) -> None:
        self.config = config or SidecarConfig()
        self.config.validate()
        self.adapter = adapter
        self.guard = Guard(self.config.adapter_timeout_s)
        # describe() is the one call allowed to fail loudly: without it nothing can be checked.
        self.info = info or self.guard.call("describe", adapter.describe)
        self.metrics = Metrics(self.info.engine, self.info.model, registry)
        self.sampler: Sampler = sampler or UniformSampler(self.config.sample_every,
                                                          self.config.seed)
        # Policies that learn from cache events (boundary-biased) get them forwarded.
        self._sampler_store = getattr(self.sampler, "observe_store", None)
        self._sampler_free = getattr(self.sampler, "observe_free", None)
        self._sampler_release = getattr(self.sampler, "observe_release", None)
        self.verifier = Verifier(adapter, self.info, self.guard,
                                 TokenBucket(self.config.recompute_tokens_per_s),
                                 recompute=self.config.recompute)
        self.evidence = EvidenceLog(self.config.evidence_capacity, self.config.evidence_dir)
        self._queue: queue.Queue[Sample | None] = queue.Queue(self.config.queue_size)
        self.stored = StoreIndex(self.config.store_records)
        self._group_labels = {g.group_id: g.label for g in self.info.groups}
        self._latencies: deque[float] = deque(maxlen=self.config.latency_window)
        self._worker: threading.Thread | None = None
        self._pending = 0  # samples queued or being verified
        self._pending_cond = threading.Condition()
        self._hook_error_logged: set[str] = set()
        self.requests_done = 0
        self._init_series()
        self.first_anomaly_request: int | None = None
        self.max_recompute_error = 0.0
        c = self.config
        self.lifecycle = LifecycleLog(c.lifecycle_sample_rate, c.lifecycle_window,
                                      burst=c.lifecycle_burst)
        self.allocator_health = AllocatorHealth(self.metrics, self.evidence, self.lifecycle,
                                                LeakTrend(c.leak_window), self.info.engine,
                                                self.info.model)
        self._introspection = adapter if isinstance(adapter, AllocatorIntrospection) else None
        self._poll_lock = threading.Lock()
        self._trigger: PollTrigger | None = None
        if c.allocator_check_min_interval_s >= 0:
            self._trigger = PollTrigger(self.poll_allocator, c.allocator_check_min_interval_s)

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
        for op in ("read", "recompute", "allocator", "block_tables"):
            for why in ("error", "timeout"):
                m.inc(S.ADAPTER_ERRORS, 0, op=op, reason=why)
        for name, value in dataclasses.asdict(S.THRESHOLDS).items():
            m.gauge(S.THRESHOLD, threshold=name).set(value)
        HI.init_series(m)

    # ------------------------------------------------------------------ hot path (engine)
    def on_lookup(self, lookup: Lookup) -> None:
        try:
            if HI.reject(self.metrics, "on_lookup", HI.check_lookup(lookup)): return  # noqa: E701
            m = self.metrics
            m.inc(S.LOOKUPS)
            m.inc(S.QUERY_TOKENS, lookup.query_tokens)
            hit = lookup.hit
            if lookup.hit_tokens <= 0 or hit is None:
                return
            m.inc(S.HITS)
            m.inc(S.HIT_TOKENS, lookup.hit_tokens)
            for group_id, blocks in hit.blocks.items():
                self.lifecycle.record(LifecycleOp.HIT, group_id, lookup.seq_id, blocks,
                                      hit.generations.get(group_id, ()), lookup.hit_tokens)
            if self.sampler.should_sample(hit):
                self._enqueue(hit)
        except Exception as exc:
            self._hook_failed("on_lookup", exc)

    def on_store(self, block: StoredBlock) -> None:
        try:
            if HI.reject(self.metrics, "on_store", HI.check_store(block)): return  # noqa: E701
            self.stored.record(block)
            if self._sampler_store is not None:
                self._sampler_store(block)
            self.lifecycle.record(LifecycleOp.STORE, block.group_id, block.seq_id,
                                  (block.block_id,), (block.generation,),
                                  block.prefix_tokens + len(block.tokens))
        except Exception as exc:
            self._hook_failed("on_store", exc)

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        try:
            if HI.reject(self.metrics, "on_free", HI.check_blocks(group_id, block_ids)): return  # noqa: E701
            self.stored.forget(group_id, block_ids)
            if self._sampler_free is not None:
                self._sampler_free(group_id, block_ids)
            self.lifecycle.record(LifecycleOp.EVICT, group_id, None, block_ids)
        except Exception as exc:
            self._hook_failed("on_free", exc)

    def on_allocate(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int],
                    generations: Sequence[int]) -> None:
        """Optional lifecycle event (:class:`sidecar.protocol.BlockLifecycleSink`)."""
        try:
            if HI.reject(self.metrics, "on_allocate", HI.check_blocks(group_id, block_ids)): return  # noqa: E701
            self.lifecycle.record(LifecycleOp.ALLOCATE, group_id, seq_id, block_ids,
                                  generations)
        except Exception as exc:
            self._hook_failed("on_allocate", exc)

    def on_release(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int]) -> None:
        """Optional lifecycle event: a sequence freed its blocks; nudges an invariant
        check, since a release is where premature and double frees happen."""
        try:
            if HI.reject(self.metrics, "on_release", HI.check_blocks(group_id, block_ids)): return  # noqa: E701
            self.lifecycle.record(LifecycleOp.FREE, group_id, seq_id, block_ids)
            if self._sampler_release is not None:
                self._sampler_release(group_id, seq_id, block_ids)
            if self._trigger is not None:
                self._trigger.nudge()
        except Exception as exc:
            self._hook_failed("on_release", exc)

    def on_request_done(self, latency_seconds: float) -> None:
        try:
            if HI.reject(self.metrics, "on_request_done", HI.check_latency(latency_seconds)): return  # noqa: E701
            self.requests_done += 1
            self._latencies.append(latency_seconds)
            self.metrics.observe(S.REQUEST_LATENCY, latency_seconds)
            if self._trigger is not None:
                self._trigger.nudge()
        except Exception as exc:
            self._hook_failed("on_request_done", exc)

    def _sample(self, hit: Hit) -> Sample | None:
        """The blocks to check and their store records as they are now (hit time)."""
        refs = tuple(self.sampler.choose(hit, self.info.block_size,
                                         self.config.blocks_per_sample))
        if not refs:
            return None
        return Sample(hit, refs, self.stored.snapshot(refs), time.time())

    def _enqueue(self, hit: Hit) -> None:
        sample = self._sample(hit)
        if sample is None:
            return
        self.metrics.inc(S.SAMPLED)
        with self._pending_cond:
            self._pending += 1
        try:
            self._queue.put_nowait(sample)
        except queue.Full:
            self._done_pending()
            self.metrics.inc(S.SAMPLES_DROPPED, reason=DropReason.QUEUE_FULL.value)

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        try:
            self.metrics.inc(S.HOOK_ERRORS, hook=hook)
            if hook not in self._hook_error_logged:  # log the first of each, not a flood
                self._hook_error_logged.add(hook)
                log.exception("kv-sidecar hook %s failed (counted; engine unaffected): %s",
                              hook, exc)
        except Exception:
            pass

    # ------------------------------------------------------------------ worker
    def start(self) -> Monitor:
        if self._trigger is not None and self._introspection is not None:
            self._trigger.start()
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="kvsidecar-verifier",
                                            daemon=True)
            self._worker.start()
        return self

    def _run(self) -> None:
        while True:
            sample = self._queue.get()
            if sample is None:
                return
            try:
                self.apply(self.verifier.verify(sample))
            except Exception:
                log.exception("verification failed unexpectedly (sample dropped)")
                self.metrics.inc(S.SAMPLES_DROPPED, reason=DropReason.ADAPTER_ERROR.value)
            finally:
                self._done_pending()

    def _done_pending(self) -> None:
        with self._pending_cond:
            self._pending -= 1
            self._pending_cond.notify_all()

    def verify(self, hit: Hit) -> Verdict:
        """Verify one hit now, synchronously (tests, benchmarks, on-demand checks)."""
        sample = self._sample(hit) or Sample(hit, (), {}, time.time())
        verdict = self.verifier.verify(sample)
        self.apply(verdict)
        return verdict

    def apply(self, verdict: Verdict) -> None:
        """Turn a verdict into signals, evidence and sampler feedback."""
        m = self.metrics
        groups = self._group_labels
        for ref in verdict.verified:
            m.inc(S.VERIFIED, group=groups.get(ref.group_id, str(ref.group_id)))
        seen: set[tuple[int, int, str]] = set()
        for f in verdict.findings:
            key = (f.group_id, f.block_index, f.kind.value)
            if key in seen:  # one count per block and kind
                continue
            seen.add(key)
            m.inc(S.ANOMALIES, group=groups.get(f.group_id, str(f.group_id)), kind=f.kind.value)
        for reason, n in verdict.dropped.items():
            m.inc(S.SAMPLES_DROPPED, n, reason=reason.value)
        for op, why in verdict.adapter_errors:
            m.inc(S.ADAPTER_ERRORS, op=op, reason=why)
        if verdict.verified:
            m.observe(S.VERIFY_DURATION, verdict.duration_s)
            m.gauge(S.LAST_VERIFICATION).set(time.time())
        if verdict.max_error is not None:
            self.max_recompute_error = max(self.max_recompute_error, verdict.max_error)
        if verdict.findings:
            if self.first_anomaly_request is None:
                self.first_anomaly_request = self.requests_done
            rec = self.evidence.record(verdict, self.info.engine, self.info.model,
                                       self.allocator_health.anomaly_context(
                                           verdict.sample.refs))
            if self._trigger is not None:
                self._trigger.nudge()
            # The first few in full, then one line in a hundred: a broken cache must not
            # turn the log into a flood (the counters and the evidence keep every one).
            if rec["seq"] <= 5 or rec["seq"] % 100 == 0:
                log.warning("KV anomaly #%d: %s", rec["seq"], "; ".join(
                    f"{f.kind.value} group={f.group_id} block#{f.block_index}: {f.detail}"
                    for f in verdict.findings[:4]))
        try:
            self.sampler.feedback(verdict.sample.hit, verdict.anomalous)
        except Exception as exc:
            self._hook_failed("sampler_feedback", exc)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued sample is verified; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._pending_cond:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pending_cond.wait(left)
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker; samples still queued are dropped and counted."""
        if self._trigger is not None:
            self._trigger.stop(timeout_s)
        if self._worker is None:
            return
        while True:
            try:
                s = self._queue.get_nowait()
            except queue.Empty:
                break
            if s is not None:
                self._done_pending()
                self.metrics.inc(S.SAMPLES_DROPPED, reason=DropReason.SHUTDOWN.value)
        self._queue.put(None)
        self._worker.join(timeout_s)
        self._worker = None

    # ------------------------------------------------------------------ allocator
    def poll_allocator(self) -> AllocatorState | None:
        """Ask the adapter for allocator state and, where it offers them, its block tables
        (each call time-limited); publish the state, check the allocator's invariants and
        the leak trend (:mod:`sidecar.allocator`). Polls from the schedule, the event
        trigger and callers are serialised."""
        with self._poll_lock:
            state = self._adapter_call("allocator", self.adapter.allocator)
            if HI.reject_adapter_output(self.metrics, "allocator", HI.check_allocator_state(state)): state = None  # noqa: E501,E701
            if state is not None:
                self.metrics.allocator.update(state)
            tables: Sequence[BlockTableSnapshot] | None = None
            started = time.perf_counter()
            if self._introspection is not None:
                tables = self._adapter_call("block_tables", self._introspection.block_tables)
            try:
                # requests_done read after the snapshot: the index is never earlier than
                # the state it describes.
                self.allocator_health.observe(state, tables, self.requests_done,
                                              time.perf_counter() - started)
            except Exception:
                log.exception("allocator health check failed (poll skipped)")
            return state

    def _adapter_call(self, op: str, fn: Any) -> Any:
        try:
            return self.guard.call(op, fn)
        except Exception as exc:
            reason = "timeout" if isinstance(exc, TimeoutError) else "error"
            self.metrics.inc(S.ADAPTER_ERRORS, op=op, reason=reason)
            log.warning("adapter %s() failed: %s", op, exc)
            return None

    # ------------------------------------------------------------------ summaries
    def p99_latency(self) -> float | None:
        return p99(self._latencies)

    def summary(self) -> dict[str, Any]:
        """The demo's JSON summary and ``/status`` (see :func:`sidecar.summary.summarize`)."""
        return summarize(self)
