"""Core v2: what is verified is what was served (capture at match time), and reuse between
match and read is the sidecar's to see (its own block epochs), stamps or no stamps."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.faults import Fault
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, Hit, Lookup, StoredBlock
from sidecar.signals import AnomalyKind, DropReason
from tests.limits import DETECTION_TIMEOUT_S


class ServedThenRepaired(Fault):
    """A racing write: the last hit block is wrong while the request reads it (zeroed at
    the hit, before prefill gathers it) and repaired right after (when the sequence's own
    next block is stored): by the time anyone re-reads the cache it looks right."""

    name = "served-then-repaired"
    corrupts_kv = True

    def __init__(self) -> None:
        super().__init__(seed=0, start_after=0, probability=1.0)
        self._saved: dict[int, tuple[int, object, object]] = {}
        self._lock = threading.Lock()

    def unrepaired(self) -> set[int]:
        """Blocks zeroed and not yet put back (a test's "read after the repair" waits on it)."""
        with self._lock:
            return {b for b, _, _ in self._saved.values()}

    def on_hit(self, engine, seq, block_ids) -> None:
        if block_ids and seq.seq_id not in self._saved:
            b = block_ids[-1]
            pool = engine.pool
            with self._lock:
                self._saved[seq.seq_id] = (b, pool.key[:, b].clone(),
                                           pool.value[:, b].clone())
            pool.key[:, b].zero_()
            pool.value[:, b].zero_()
            self.record(seq.seq_id, b, "zeroed while served")

    def on_block_full(self, engine, seq, block_id) -> None:
        self._repair(engine, seq)

    def release(self, engine, seq):
        # A request that never filled another block is repaired when it finishes.
        self._repair(engine, seq)
        return None

    def _repair(self, engine, seq) -> None:
        with self._lock:
            saved = self._saved.pop(seq.seq_id, None)
        if saved is not None:
            b, key, value = saved
            engine.pool.key[:, b] = key
            engine.pool.value[:, b] = value


class ChurnWatch:
    """Sits between the engine and its sink and counts the blocks the engine frees, so a
    test's "slow" read can wait for the pool to really turn over under it (rather than
    trusting a sleep to be long enough on a loaded 2-core machine)."""

    def __init__(self, sink: object) -> None:
        self._sink = sink
        self._cond = threading.Condition()
        self.freed = 0
        self.done = False
        self.waiting = False  # a slow read waits for the engine to churn the pool

    def __getattr__(self, name: str) -> object:  # every other hook and attribute
        return getattr(self._sink, name)

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        self._sink.on_free(group_id, block_ids)  # type: ignore[attr-defined]
        with self._cond:
            self.freed += len(block_ids)
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self.done = True
            self._cond.notify_all()

    def wait_turnover(self, blocks: int, timeout_s: float = 5.0) -> None:
        """Until ``blocks`` more blocks were freed, the engine finished, or the timeout."""
        with self._cond:
            target = self.freed + blocks
            self.waiting = True
            self._cond.wait_for(lambda: self.freed >= target or self.done, timeout_s)
            self.waiting = False


class SlowReads(ReferenceAdapter):
    """The verifier's later read arrives late (a busy sidecar): the cache has moved on."""

    def __init__(self, engine: ReferenceEngine, delay_s: float, capture: bool = True,
                 stamps: bool = True, slow_every: int = 1,
                 after_repair: ServedThenRepaired | None = None) -> None:
        super().__init__(engine)
        self.delay_s = delay_s
        # Blind runs: the late read lands after the racing write was repaired (waiting for
        # it, rather than trusting a sleep to be long enough on a loaded 2-core machine).
        self.after_repair = after_repair
        self.watch: ChurnWatch | None = None  # slow reads also wait for a pool turnover
        self.turnover = 0
        self.stamps = stamps
        self.slow_every = slow_every  # 1 in this many reads is slow
        self.reads = 0
        if not capture:
            self.capture = None  # type: ignore[assignment]

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        self.reads += 1
        if self.reads % self.slow_every == 0:
            time.sleep(self.delay_s)
            if self.watch is not None and self.turnover:
                self.watch.wait_turnover(self.turnover)
        if self.after_repair is not None:
            deadline = time.monotonic() + 30.0
            wanted = {r.block_id for r in refs}
            while wanted & self.after_repair.unrepaired() and time.monotonic() < deadline:
                time.sleep(0.002)
        out = super().read(hit, refs)
        if not self.stamps:
            for b in out:
                b.generation = None
        return out


class StampStripper:
    """Sits between the engine and the Monitor: the engine keeps no generation stamps."""

    def __init__(self, monitor: Monitor, pace_s: float = 0.0) -> None:
        self.monitor = monitor
        self.pace_s = pace_s  # the engine waits this long per request (the verifier keeps up)
        self.watch: ChurnWatch | None = None

    def on_lookup(self, lookup: Lookup) -> None:
        hit = lookup.hit
        if hit is not None:
            hit = dataclasses.replace(hit, generations={})
        self.monitor.on_lookup(dataclasses.replace(lookup, hit=hit))

    def on_store(self, block: StoredBlock) -> None:
        self.monitor.on_store(dataclasses.replace(block, generation=0))

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        self.monitor.on_free(group_id, block_ids)

    def on_request_done(self, latency_seconds: float) -> None:
        self.monitor.on_request_done(latency_seconds)
        time.sleep(self.pace_s)
        # ... and lets the verifier keep up: at most a few samples wait in its queue, unless
        # the one being read waits for the pool to churn under it.
        deadline = time.monotonic() + 5.0
        while (self.monitor.dispatcher.queued > 2 and time.monotonic() < deadline
               and not (self.watch is not None and self.watch.waiting)):
            time.sleep(0.001)


def _run(fault: Fault | None, capture: bool, delay_s: float, stamps: bool = True,
         requests: int = 60, num_blocks: int = 256, blocks_per_sample: int = 2,
         workload: WorkloadConfig | None = None, slow_every: int = 1,
         pace_s: float = 0.0, turnover: int = 0) -> Monitor:
    engine = ReferenceEngine(EngineConfig(num_blocks=num_blocks, kv_digest=True))
    if fault is not None:
        engine.fault = fault
    adapter = SlowReads(engine, delay_s, capture=capture, stamps=stamps,
                        slow_every=slow_every,
                        after_repair=fault if (not capture
                                               and isinstance(fault, ServedThenRepaired))
                        else None)
    mon = Monitor(adapter, SidecarConfig(sample_every=1, recompute_tokens_per_s=0,
                                         queue_size=10_000, capture=capture,
                                         blocks_per_sample=blocks_per_sample,
                                         adapter_timeout_s=DETECTION_TIMEOUT_S,
                                         allocator_check_min_interval_s=-1),
                  registry=CollectorRegistry())
    inner = mon if stamps else StampStripper(mon, pace_s)
    watch = ChurnWatch(inner)
    if isinstance(inner, StampStripper):
        inner.watch = watch
    if turnover:
        adapter.watch, adapter.turnover = watch, turnover
    engine.sink = watch
    mon.start()
    drive(engine, ChatWorkload(workload or WorkloadConfig(conversations=12, max_turns=5,
                                                          seed=3)),
          max_requests=requests)
    watch.finish()
    assert mon.drain(timeout_s=300)
    mon.stop()
    return mon


def _anomalies(mon: Monitor) -> dict[str, float]:
    return mon.metrics.by_label(S.ANOMALIES.name, "kind")


def test_a_write_repaired_after_serving_is_caught_from_the_capture() -> None:
    caught = _run(ServedThenRepaired(), capture=True, delay_s=0.05)
    kinds = _anomalies(caught)
    assert kinds.get(AnomalyKind.ZEROS.value, 0) > 0, kinds
    # The later read sees the repaired block: it changed in place after serving.
    assert kinds.get(AnomalyKind.CHANGED_AFTER_SERVING.value, 0) > 0, kinds

    # Without the capture the repaired block itself looks right by the time it is read
    # (only KV computed over it while it was wrong may still show up, downstream).
    blind = _run(ServedThenRepaired(), capture=False, delay_s=0.05)
    assert blind.metrics.value_sum(S.VERIFIED.name) > 0
    seen = _anomalies(blind)
    assert AnomalyKind.ZEROS.value not in seen, seen
    assert AnomalyKind.CHANGED_AFTER_SERVING.value not in seen, seen


def test_a_block_stored_again_after_serving_is_dropped_as_reused_not_flagged() -> None:
    """Small pool, slow reads: blocks are evicted and re-stored before the verifier reads
    them. The capture is still judged (what was served); the stale read is dropped with its
    own reason, never compared."""
    mon = _run(None, capture=True, delay_s=0.02, num_blocks=40, requests=80, turnover=40)
    assert _anomalies(mon) == {}
    value = mon.metrics.value
    assert value(S.SAMPLES_DROPPED.name, reason=DropReason.REUSED_AFTER_SERVING.value) > 0
    assert value(S.SAMPLES_DROPPED.name, reason=DropReason.EVICTED_BEFORE_READ.value) == 0
    assert mon.metrics.value_sum(S.VERIFIED.name) > 20


def test_clean_engine_without_stamps_under_eviction_pressure_gives_no_false_alarm() -> None:
    """No generation stamps at all, no capture, a verifier whose reads are sometimes slow
    (1 in 4 waits 40 ms) and a pool small enough that blocks are reused under it: the
    sidecar's epochs drop the reused reads. >= 2,000 verified blocks, zero anomalies."""
    mon = _run(None, capture=False, delay_s=0.04, stamps=False, num_blocks=40,
               requests=900, blocks_per_sample=16, slow_every=4, pace_s=0.004, turnover=6,
               workload=WorkloadConfig(conversations=180, max_turns=6, seed=5))
    verified = mon.metrics.value_sum(S.VERIFIED.name)
    dropped = mon.metrics.value(S.SAMPLES_DROPPED.name,
                                reason=DropReason.EVICTED_BEFORE_READ.value)
    assert _anomalies(mon) == {}
    assert verified >= 2000, (verified, dropped)
    assert dropped > 0, "the pool must actually be reused under the verifier"
