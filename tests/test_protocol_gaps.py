"""The protocol gaps two outside adapters hit (issue 20, finding 10), each closed and held
to its documented behaviour: ``read`` of a block that is gone, per-block "absent =
resident" tier states, the missing-recurrent-state convention."""

from __future__ import annotations

from collections.abc import Sequence

from kvtestbed.engines.tier import hit_tier_states

from sidecar import signals as S
from sidecar.checks.coverage import check_coverage
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, EngineInfo, Hit, Lookup
from sidecar.core.protocol import TierState as T
from sidecar.signals import AnomalyKind as K
from sidecar.signals import DropReason
from tests.hybrid_toy import BS, FULL, RECURRENT, SLIDING, groups
from tests.toy import BS as TOY_BS
from tests.toy import ToyAdapter, ToyEngine

DEFERRED = SidecarConfig(sample_every=1, dispatch="deferred", allocator_every_s=0,
                         burst_hits=0, blocks_per_sample=2)


class LeavesOutEverything(ToyAdapter):
    """``read`` answers nothing: what an adapter does for blocks that are gone."""

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return []


def _sampled(free_first: bool) -> list:
    engine = ToyEngine(sink=None)
    monitor = Monitor(LeavesOutEverything(engine), DEFERRED)
    engine.sink = monitor
    prompt = list(range(2 * TOY_BS))
    engine.serve(prompt)
    hit = engine.serve(prompt)  # sampled, kept for later
    assert hit is not None
    if free_first:
        monitor.on_free(0, list(hit.blocks[0]))  # gone before the verifier reads
    return monitor.verify_pending()


def test_a_block_freed_since_the_match_and_left_out_of_read_is_dropped_as_evicted() -> None:
    [verdict] = _sampled(free_first=True)
    assert DropReason.EVICTED_BEFORE_READ in verdict.dropped
    assert verdict.adapter_errors == [] and DropReason.ADAPTER_ERROR not in verdict.dropped


def test_a_live_block_left_out_of_read_is_an_adapter_error() -> None:
    [verdict] = _sampled(free_first=False)
    assert ("read", "missing_block") in verdict.adapter_errors
    assert DropReason.ADAPTER_ERROR in verdict.dropped
    assert DropReason.EVICTED_BEFORE_READ not in verdict.dropped


INFO = EngineInfo("t", "m", "r", "float32", BS, 2, 8, groups())
BLOCKS = {FULL: [1, 2], SLIDING: [3, 4], RECURRENT: [0, 5]}


def _kinds(hit: Hit) -> list[tuple[K, int, int]]:
    return [(f.kind, f.group_id, f.block_index) for f in check_coverage(hit, INFO)]


def test_tier_states_absent_means_resident_per_block() -> None:
    for states in ({}, {FULL: []}, {FULL: [None]}, {FULL: [None, T.LOADED]},
                   {FULL: [T.LOADED]}):  # no padding with RESIDENT needed
        assert _kinds(Hit((), 8, BLOCKS, tier_states=states)) == [], states
    assert _kinds(Hit((), 8, BLOCKS, tier_states={FULL: [None, T.OFFLOADED]})) == [
        (K.TIER_NOT_LOADED, FULL, 1)]


def test_a_missing_recurrent_state_is_a_shorter_list_and_a_null_id_is_a_null_read() -> None:
    assert _kinds(Hit((), 8, {**BLOCKS, RECURRENT: [0]})) == [
        (K.MISSING_GROUP_STATE, RECURRENT, 1)]
    assert _kinds(Hit((), 8, {**BLOCKS, RECURRENT: [0, 0]})) == [
        (K.NULL_BLOCK_READ, RECURRENT, 1)]
    assert _kinds(Hit((), 8, {**BLOCKS, RECURRENT: [0, 5]})) == []  # earlier: null is fine



def test_the_reference_engine_does_not_pad_resident_blocks() -> None:
    assert hit_tier_states(FULL, 3, [T.LOADED]) == {FULL: (None, None, T.LOADED)}
    assert hit_tier_states(FULL, 3, []) == {}  # nothing came through the tier: no entry
    hit = Hit((), 8, BLOCKS, tier_states=hit_tier_states(FULL, 2, [T.LOADING]))
    assert _kinds(hit) == [(K.TIER_NOT_LOADED, FULL, 1)]  # the None before it: resident


def test_a_hit_that_lists_no_block_is_judged_like_one_whose_list_stops_short() -> None:
    """A sampled hit claiming full blocks with none listed (``{}`` or an empty list) was
    dropped without a word, while one listing fewer than it claims was flagged: both now
    reach the coverage check, which names the group that cannot serve the hit. A hit
    shorter than one block has nothing to check."""
    for blocks in ({}, {0: []}, {0: [1]}):
        monitor = Monitor(ToyAdapter(ToyEngine(sink=None)), DEFERRED)
        monitor.on_lookup(Lookup(4 * TOY_BS, 4 * TOY_BS,
                                 Hit(list(range(4 * TOY_BS)), 4 * TOY_BS, blocks), seq_id=1))
        verdicts = monitor.verify_pending()
        assert [f.kind for v in verdicts for f in v.findings] == [K.MISSING_GROUP_STATE], blocks
        assert monitor.metrics.by_label(S.ANOMALIES.name, "kind") == {
            K.MISSING_GROUP_STATE.value: 1}, blocks
    short = Monitor(ToyAdapter(ToyEngine(sink=None)), DEFERRED)
    short.on_lookup(Lookup(TOY_BS, TOY_BS - 1, Hit(list(range(TOY_BS)), TOY_BS - 1, {}),
                           seq_id=1))
    assert short.verify_pending() == [] and short.summary()["sampled"] == 0


def test_a_hit_that_lists_no_block_is_judged_in_the_sidecar_process_too() -> None:
    """The same in ``dispatch = "process"``: the engine-side front shipped such a hit as a
    bare lookup, unjudged; it now ships it for the sidecar process's coverage check."""
    import dataclasses

    from kvtestbed.adapters.paged_adapter import ReferenceAdapter
    from kvtestbed.demo import DemoOptions, sidecar_config
    from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
    from kvtestbed.engines.model import ModelConfig

    from sidecar.adapters.remote.process import SidecarProcess

    engine = ReferenceEngine(EngineConfig(model=ModelConfig(seed=0), num_blocks=64))
    cfg = sidecar_config(DemoOptions(fault="none", sidecar={"dispatch": "process"}))
    sidecar = SidecarProcess(ReferenceAdapter(engine), dataclasses.replace(
        cfg, sample_every=1, burst_hits=0), port=0).start()
    try:
        n = 4 * engine.block_size
        sidecar.front.on_lookup(Lookup(n, n, Hit(list(range(n)), n, {}), seq_id=1))
        assert sidecar.drain(60)
        assert sidecar.summary()["anomalies"] == {"missing_group_state": 1}
    finally:
        sidecar.stop()
