"""The reference engine's CPU offload tier: the per-entry state machine, asynchronous loads
on a bounded copy worker, recovery (wait for the load, recompute a failed one), the events
it reports (``on_tier``, ``Hit.tier_states``), and the tier faults checked against the
ground truth and the current verifier."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.blocks import BlockData
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request
from kvtestbed.engines.faults import FAULTS
from kvtestbed.engines.pool import BlockPool
from kvtestbed.engines.tier import (
    CpuTier,
    IllegalTierTransition,
    TierEntry,
)
from kvtestbed.engines.tier_worker import CopyWorker
from prometheus_client import CollectorRegistry

from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import Hit, Lookup, StoredBlock, TierState
from sidecar.signals import AnomalyKind
from tests.limits import DETECTION_TIMEOUT_S
from tests.reference_helpers import greedy_without_cache

S = TierState
BS = 16
TIMEOUT = 10.0


# ---------------------------------------------------------------------- state machine
def entry(h: bytes = b"h", group_id: int = 0, layers: int = 2) -> TierEntry:
    data = BlockData(torch.full((layers, 1, BS, 4), 1.0), torch.full((layers, 1, BS, 4), 2.0))
    return TierEntry(h, data, (1,) * BS, (), 0, group_id=group_id, block_id=3)


def test_an_entry_goes_offloaded_then_loading_then_loaded() -> None:
    tier = CpuTier(4)
    e = entry(group_id=2)
    assert tier.put(e) and e.state is S.OFFLOADED
    assert tier.match(2, [b"h"]) == [e] and tier.match(0, [b"h"]) == []  # keyed by group
    pool = BlockPool(4, BS, 2, 1, 4)
    load = tier.load(e, pool, 1)
    assert load.wait(TIMEOUT) and e.state is S.LOADED and load.outcome is S.LOADED
    assert torch.equal(pool.key[:, 1], e.data.key) and torch.equal(pool.value[:, 1], e.data.value)
    events = tier.drain_events()
    assert [(ev.group_id, ev.state) for ev in events] == [
        (2, S.RESIDENT), (2, S.OFFLOADING), (2, S.OFFLOADED), (2, S.LOADING), (2, S.LOADED)]
    assert [ev.block_id for ev in events] == [3, 3, 3, 1, 1]  # from block 3, into block 1
    assert all(ev.seconds is None for ev in events[:-1])
    assert events[-1].seconds is not None and events[-1].seconds > 0  # recovery latency
    assert tier.match(2, [b"h"]) == []  # loaded: back in the pool, not loadable again


@pytest.mark.parametrize(("path", "illegal"), [
    ((), S.OFFLOADED),  # a new entry starts resident
    ((S.RESIDENT,), S.LOADING),  # nothing to load before it was offloaded
    ((S.RESIDENT, S.OFFLOADING, S.OFFLOADED), S.LOADED),  # loaded without a load
    ((S.RESIDENT, S.OFFLOADING, S.OFFLOADED, S.LOADING, S.LOADED), S.LOADING),
    ((S.RESIDENT, S.OFFLOADING, S.OFFLOADED, S.LOADING, S.FAILED), S.LOADING),  # terminal
])
def test_illegal_transitions_raise_and_are_counted(path: tuple[TierState, ...],
                                                   illegal: TierState) -> None:
    tier = CpuTier(4)
    e = entry()
    for state in path:
        tier.transition(e, state)
    with pytest.raises(IllegalTierTransition, match=f"{e.state} -> {illegal}"):
        tier.transition(e, illegal)
    assert tier.illegal_transitions == 1
    assert e.state is (path[-1] if path else None)  # the entry did not move


def test_a_load_of_an_entry_not_offloaded_fails_instead_of_copying() -> None:
    tier = CpuTier(4)
    e = entry()
    pool = BlockPool(4, BS, 2, 1, 4)
    load = tier.load(e, pool, 0)  # never offloaded: offloaded -> loading is the only way
    assert load.wait(TIMEOUT) and load.outcome is S.FAILED
    assert isinstance(load.error, IllegalTierTransition) and tier.illegal_transitions == 1
    assert not pool.key.any()


def test_a_damaged_tier_copy_fails_the_load_and_leaves_the_tier() -> None:
    tier = CpuTier(4)
    e = entry()
    tier.put(e)
    e.data = BlockData(torch.zeros(1), torch.zeros(1))  # truncated bytes
    load = tier.load(e, BlockPool(4, BS, 2, 1, 4), 0)
    assert load.wait(TIMEOUT) and load.outcome is S.FAILED and e.state is S.FAILED
    assert tier.failed_loads == 1 and len(tier) == 0 and tier.match(0, [b"h"]) == []
    assert tier.drain_events()[-1].seconds is not None


def test_lru_bound_never_drops_an_entry_with_a_copy_in_flight() -> None:
    tier = CpuTier(2)
    first = entry(b"a")
    tier.put(first)
    held = tier.load(first, BlockPool(4, BS, 2, 1, 4), 0, hold_after=1)
    assert held.wait(TIMEOUT) and first.state is S.LOADING
    tier.put(entry(b"b"))
    tier.put(entry(b"c"))  # over capacity: "b" goes, the loading "a" stays
    assert len(tier) == 2 and tier.dropped == 1
    assert [e.block_hash for e in tier._entries.values()] == [b"a", b"c"]
    held.resume()
    assert held.done.wait(TIMEOUT) and first.state is S.LOADED


# ---------------------------------------------------------------------- the copy worker
def until(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` until it holds or TIMEOUT passes (threads on a loaded machine)."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_loads_complete_in_submission_order_behind_a_copy_in_flight() -> None:
    tier = CpuTier(8, queue_depth=8)
    pool = BlockPool(8, BS, 2, 1, 4)
    entries = [entry(bytes([i])) for i in range(4)]
    for e in entries:
        tier.put(e)
    tier.drain_events()
    gate = threading.Event()

    class SlowCopy:  # an earlier copy still running (a large block, a slow link)
        def run(self) -> None:
            gate.wait()

    tier.worker.submit(SlowCopy())
    loads = [tier.load(e, pool, i) for i, e in enumerate(entries)]
    assert not any(load.done.wait(0.05) for load in loads)  # queued behind it
    assert all(e.state is S.OFFLOADED for e in entries)  # not even loading yet: unservable
    gate.set()
    assert all(load.done.wait(TIMEOUT) for load in loads)
    loaded = [ev.block_id for ev in tier.drain_events() if ev.state is S.LOADED]
    assert loaded == [0, 1, 2, 3]


def test_a_full_queue_makes_submit_wait() -> None:
    worker = CopyWorker(depth=1)
    gate = threading.Event()
    ran: list[int] = []

    class Job:
        def __init__(self, n: int) -> None:
            self.n = n

        def run(self) -> None:
            if self.n == 0:
                gate.wait()
            ran.append(self.n)

    worker.submit(Job(0))  # taken by the thread, blocked on the gate
    assert until(lambda: worker._queue.qsize() == 0)
    worker.submit(Job(1))  # fills the one queue slot
    third = threading.Thread(target=worker.submit, args=(Job(2),))
    third.start()
    assert until(lambda: worker.backpressure_waits == 1)  # bounded: the third one waits
    assert third.is_alive() and ran == []
    gate.set()
    third.join(TIMEOUT)
    assert not third.is_alive()
    assert until(lambda: len(ran) == 3)
    assert ran == [0, 1, 2] and worker.submitted == 3


def test_the_worker_thread_exits_when_idle_and_restarts() -> None:
    worker = CopyWorker(depth=2, idle_exit_s=0.05)
    done = threading.Event()

    class Job:
        def run(self) -> None:
            done.set()

    worker.submit(Job())
    assert done.wait(TIMEOUT)
    thread = worker._thread
    assert thread is not None
    thread.join(TIMEOUT)
    assert not worker.alive
    done.clear()
    worker.submit(Job())
    assert done.wait(TIMEOUT)


# ---------------------------------------------------------------------- the engine
class TierSink:
    """Records every event (on_tier included); with a Monitor, verifies each hit at lookup
    (while the request is served) and forwards stores, so the verifier is the real one."""

    def __init__(self, engine: ReferenceEngine, monitor: Monitor | None = None) -> None:
        self.engine = engine
        self.monitor = monitor
        self.events: list[tuple[str, object]] = []
        self.verdicts: list[tuple[Hit, set[AnomalyKind]]] = []
        self.at_lookup: list[tuple[Hit, list[bool]]] = []  # per loading block: layers right

    def on_tier(self, group_id: int, block_id: int, state: TierState,
                seconds: float | None = None) -> None:
        self.events.append(("tier", (group_id, block_id, state, seconds)))

    def on_lookup(self, lookup: Lookup) -> None:
        self.events.append(("lookup", lookup))
        hit, truth = lookup.hit, self.engine.truth
        if hit is None:
            return
        if truth is not None:
            for b, state in zip(hit.blocks[0], hit.tier_states.get(0, ()), strict=True):
                if state is S.LOADING:
                    self.at_lookup.append((hit, [
                        bool(torch.equal(self.engine.pool.key[layer, b],
                                         truth.shadow.key[layer, b]))
                        for layer in range(self.engine.pool.key.shape[0])]))
        if self.monitor is not None:
            self.verdicts.append((hit, self.monitor.verify(hit).kinds()))

    def on_store(self, block: StoredBlock) -> None:
        if self.monitor is not None:
            self.monitor.on_store(block)

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        if self.monitor is not None:
            self.monitor.on_free(group_id, block_ids)

    def on_request_done(self, latency_seconds: float) -> None:
        pass

    def tier(self) -> list[tuple[int, int, TierState, float | None]]:
        return [e for k, e in self.events if k == "tier"]  # type: ignore[misc]

    def hits(self) -> list[Hit]:
        return [e.hit for k, e in self.events
                if k == "lookup" and e.hit is not None]  # type: ignore[attr-defined]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(3 * BS + 1)]  # 3 full blocks + 1 token


def tier_run(fault: str = "none", verify: bool = False, **config: object
             ) -> tuple[ReferenceEngine, TierSink, list[tuple[int, ...]]]:
    """A's three blocks evicted to the tier by B, C, D, then A again: three tier loads."""
    cfg = EngineConfig(**{"num_blocks": 8, "block_size": BS, "cpu_offload_blocks": 64,
                          "fault": fault, "fault_start_after": 0, "fault_probability": 1.0,
                          "kv_digest": True, "track_truth": True,
                          **config})  # type: ignore[arg-type]
    engine = ReferenceEngine(cfg)
    monitor = None
    if verify:
        monitor = Monitor(ReferenceAdapter(engine),
                          SidecarConfig(sample_every=1, blocks_per_sample=1 << 20,
                                        recompute_tokens_per_s=0,
                                        adapter_timeout_s=DETECTION_TIMEOUT_S,
                                        allocator_check_min_interval_s=-1),
                          registry=CollectorRegistry())
    sink = TierSink(engine, monitor)
    engine.sink = sink  # type: ignore[assignment]
    outputs = [engine.serve(Request(prompt(s), max_new_tokens=2)).output_tokens
               for s in (0, 1, 2, 3, 0)]
    return engine, sink, outputs


def test_clean_tier_hit_waits_for_its_loads_and_reports_every_transition() -> None:
    engine, sink, outputs = tier_run(verify=True)
    assert outputs[4] == outputs[0] == greedy_without_cache(engine.model, prompt(0), "", 2)
    hit = sink.hits()[-1]
    assert hit.hit_tokens == 3 * BS and hit.tier_states == {0: (S.LOADED,) * 3}
    assert engine.tier is not None and engine.tier.loads == 3
    # Every spill went resident -> offloading -> offloaded; every load ended loaded, with
    # its recovery latency, and all of it was reported before the hit's lookup.
    lookup_at = max(i for i, (k, _) in enumerate(sink.events) if k == "lookup")
    assert all(i < lookup_at for i, (k, _) in enumerate(sink.events) if k == "tier")
    loads = [(b, st, sec) for _, b, st, sec in sink.tier() if st in (S.LOADING, S.LOADED)]
    assert [st for _, st, _ in loads] == [S.LOADING, S.LOADED] * 3
    assert {b for b, _, _ in loads} == set(hit.blocks[0])
    assert all(sec is not None and sec > 0 for _, st, sec in loads if st is S.LOADED)
    spills = [st for _, _, st, _ in sink.tier() if st not in (S.LOADING, S.LOADED)]
    assert spills == [S.RESIDENT, S.OFFLOADING, S.OFFLOADED] * (len(spills) // 3)
    assert len(spills) >= 9
    assert sink.verdicts and all(not kinds for _, kinds in sink.verdicts)  # verified quiet
    assert engine.sink_errors == {}


def test_a_failed_load_is_not_served_but_recomputed() -> None:
    engine, sink, _ = tier_run()  # warm: A's blocks are back in the pool now
    tier = engine.tier
    assert tier is not None
    for s in (1, 2, 3):  # push A out to the tier again
        engine.serve(Request(prompt(s), max_new_tokens=2))
    damaged = [e for e in tier._entries.values()
               if e.state is S.OFFLOADED and e.prefix_tokens == BS]
    assert damaged
    for e in damaged:  # the tier's copy of A's second block is truncated
        e.data = BlockData(torch.zeros(1), torch.zeros(1))
    result = engine.serve(Request(prompt(0), max_new_tokens=2))
    assert result.output_tokens == greedy_without_cache(engine.model, prompt(0), "", 2)
    hit = sink.hits()[-1]
    assert hit.hit_tokens == BS and hit.tier_states == {0: (S.LOADED,)}  # stops there
    failed = [e for e in sink.tier() if e[2] is S.FAILED]
    assert len(failed) == 1 and failed[0][3] is not None
    assert engine.stats["tier_loads_recomputed"] == 2  # the failed block and the one after
    assert engine.truth is not None and not engine.truth.bad_blocks(hit)


def test_a_raising_on_tier_hook_is_counted_and_never_reaches_the_engine() -> None:
    class Broken(TierSink):
        def on_tier(self, group_id: int, block_id: int, state: TierState,
                    seconds: float | None = None) -> None:
            raise RuntimeError("sidecar bug")

    engine = ReferenceEngine(EngineConfig(num_blocks=8, block_size=BS, cpu_offload_blocks=64))
    engine.sink = Broken(engine)  # type: ignore[assignment]
    outputs = [engine.serve(Request(prompt(s), max_new_tokens=2)).output_tokens
               for s in (0, 1, 2, 3, 0)]
    assert outputs[4] == outputs[0]
    assert engine.tier is not None and engine.tier.loads == 3
    assert engine.sink_errors["on_tier"] >= 9 + 6  # three spills and three loads at least


# ---------------------------------------------------------------------- the tier faults
@pytest.mark.parametrize("digests", [False, True])
def test_failed_load_as_hit_serves_a_failed_entry_and_the_verifier_flags_it(
        digests: bool) -> None:
    engine, sink, _ = tier_run("failed-load-as-hit", verify=True, kv_digest=digests)
    hit = sink.hits()[-1]
    assert hit.tier_states == {0: (S.FAILED,) * 3}  # what TIER_NOT_LOADED is for
    assert [e[2] for e in sink.tier()].count(S.FAILED) == 3
    assert len(engine.fault.injections) == 3
    assert engine.truth is not None and engine.truth.bad_blocks(hit) == [0, 1, 2]
    # Served from entries the tier marked failed: named from the state alone, before (and
    # whatever) the content shows (the previous owner's KV, zeros, a stale digest).
    assert sink.verdicts[-1][1] == {AnomalyKind.TIER_NOT_LOADED}


def test_partial_load_copies_only_the_first_layers_and_reports_loaded() -> None:
    engine, sink, _ = tier_run("partial-load", verify=True, kv_digest=False, model=replace(
        EngineConfig().model, num_layers=3))
    hit = sink.hits()[-1]
    assert hit.tier_states == {0: (S.LOADED,) * 3}  # the tier believes the copy finished
    truth = engine.truth
    assert truth is not None and truth.bad_blocks(hit) == [0, 1, 2]
    for inj in engine.fault.injections:
        b = inj.block_id
        copied = int(inj.detail.split("..")[1].split(" ")[0]) + 1
        same = [bool(torch.equal(engine.pool.key[layer, b], truth.shadow.key[layer, b]))
                for layer in range(3)]
        assert same == [True] * copied + [False] * (3 - copied)  # still wrong afterwards
    assert sink.verdicts[-1][1] == {AnomalyKind.PARTIAL_LOAD}  # some layers only


def test_torn_async_copy_is_served_while_loading_then_completes() -> None:
    engine, sink, _ = tier_run("torn-async-copy", verify=True, kv_digest=False)
    hit = sink.hits()[-1]
    assert hit.tier_states == {0: (S.LOADING,) * 3}
    # At lookup (what the request and a capture saw): a prefix of layers, never all.
    assert len(sink.at_lookup) == 3
    for _, same in sink.at_lookup:
        copied = same.index(False)
        assert not any(same[copied:])
    # Served while still loading: the state names it (a later read finds the right bytes).
    assert sink.verdicts[-1][1] == {AnomalyKind.TIER_NOT_LOADED}
    # The copy completed after the prefill: loaded is reported after the lookup, and the
    # block now holds the right bytes (a later read sees nothing: only the state tells).
    lookup_at = max(i for i, (k, _) in enumerate(sink.events) if k == "lookup")
    late = [e for k, e in sink.events[lookup_at:] if k == "tier"]
    assert [e[2] for e in late] == [S.LOADED] * 3  # type: ignore[index]
    truth = engine.truth
    assert truth is not None and truth.bad_blocks(hit) == []


def test_tier_faults_are_registered_with_their_needs() -> None:
    for name in ("failed-load-as-hit", "partial-load", "torn-async-copy"):
        assert FAULTS[name].corrupts_kv
        assert FAULTS[name].engine_needs == {"cpu_offload_blocks": 512}
    assert ReferenceEngine(EngineConfig(fault="torn-async-copy")).tier is not None
