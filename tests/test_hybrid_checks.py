"""Per-group verification of hybrid caches (issue 11, sidecar side) on the synthetic hybrid
toy (tests/hybrid_toy.py): block choice per group, coverage (completeness, null blocks,
tier state), window / stale-recurrent / partial-load explanations, per-group layout, and
the per-group-kind signals. Each fault is named with its kind and its group only."""

from __future__ import annotations

import pytest
import torch

from sidecar import signals as S
from sidecar.checks.verifier import Sample
from sidecar.core.monitor import Monitor
from sidecar.core.protocol import Hit, TierState
from sidecar.core.sampling import UniformSampler, choose_blocks
from sidecar.signals import AnomalyKind as K
from tests.hybrid_toy import (
    BS,
    FULL,
    NULL,
    PROMPT,
    RECURRENT,
    SLIDING,
    HybridToyEngine,
    groups,
    make,
    model_kv,
)

DTYPES = [torch.float32, torch.bfloat16]
KIND_OF = {FULL: "full_attention", SLIDING: "sliding_window", RECURRENT: "recurrent_state"}
LABEL = {FULL: "full", SLIDING: "swa", RECURRENT: "conv"}


def served(engine: HybridToyEngine, monitor: Monitor, prompt=PROMPT, edit=None,
           store: bool = True):
    """Store ``prompt`` (unless stored already), then serve it again as a hit and return
    that hit's verdict."""
    if store:
        engine.serve(prompt)
    verdicts: list = []
    apply = monitor.apply
    monitor.apply = lambda v: (verdicts.append(v), apply(v))[-1]  # type: ignore[method-assign]
    engine.serve(prompt + [7, 8, 9, 10], edit)
    monitor.apply = apply  # type: ignore[method-assign]
    assert len(verdicts) == 1
    return verdicts[0]


def findings(verdict) -> set[tuple[K, int]]:
    return {(f.kind, f.group_id) for f in verdict.findings}


# --------------------------------------------------------------------------- block choice
def test_block_choice_is_per_group_and_never_a_null_block():
    hit = Hit(tuple(range(24)), 24, {FULL: [1, 2, 3, 4, 5, 6], SLIDING: [0, 0, 0, 0, 5, 6],
                                     RECURRENT: [0, 0, 0, 0, 0, 6]})
    for seed in range(20):
        refs = choose_blocks(hit, BS, 3, __import__("random").Random(seed), groups=groups())
        by_group: dict[int, set[int]] = {}
        for r in refs:
            assert r.block_id != NULL, r
            by_group.setdefault(r.group_id, set()).add(r.index)
        assert 5 in by_group[FULL] and len(by_group[FULL]) == 3
        assert by_group[SLIDING] == {4, 5}  # the window only (the last 2 blocks)
        assert by_group[RECURRENT] == {5}  # the last boundary only
    # Without the engine's groups every listed block may be chosen (the old behaviour).
    refs = UniformSampler(1).choose(hit, BS, 6)
    assert any(r.block_id == NULL for r in refs)


# --------------------------------------------------------------------------- clean runs
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clean_hybrid_traffic_is_quiet_and_every_group_is_verified(dtype):
    engine, _, monitor = make(dtype)
    prompts = [PROMPT[:BS * n] + [n] * (BS * 2) for n in range(2, 7)]
    for _ in range(3):
        for p in prompts:
            engine.serve(p)
    m = monitor.metrics
    assert m.value_sum(S.ANOMALIES.name) == 0
    for g in (FULL, SLIDING, RECURRENT):
        assert m.value(S.VERIFIED.name, group=LABEL[g]) > 0, LABEL[g]
        assert m.value(S.GROUP_HITS.name, group=LABEL[g], group_kind=KIND_OF[g]) == \
            m.value(S.HITS.name)
    assert m.value_sum(S.SAMPLES_DROPPED.name) == 0


def test_real_blocks_left_before_the_window_are_not_flagged():
    """Out-of-window positions are legitimately null (the clean test) or still real (an
    engine that frees lazily): neither is judged, and neither is read."""
    engine, _, monitor = make()

    def keep_all(blocks, states):
        blocks[SLIDING] = [engine.block(SLIDING, PROMPT, i) for i in range(len(blocks[FULL]))]
        for i in range(len(blocks[SLIDING]) - 2):  # out of window: garbage, never read
            engine.pool[(SLIDING, blocks[SLIDING][i])] = (torch.zeros(2, 2, 4, 8),) * 2

    v = served(engine, monitor, edit=keep_all)
    assert not v.findings
    assert {r.index for r in v.verified if r.group_id == SLIDING} == {4, 5}


# --------------------------------------------------------------------------- faults
def _shift_window(engine, dtype):
    b = engine.block(SLIDING, PROMPT, 5)  # block #5 restored with position #4's KV
    engine.pool[(SLIDING, b)] = model_kv(SLIDING, PROMPT, 4, dtype=dtype)


def _stale_state(engine, dtype):
    b = engine.block(RECURRENT, PROMPT, 5)  # the state of boundary #3 stored at #5
    engine.pool[(RECURRENT, b)] = model_kv(RECURRENT, PROMPT, 3, dtype=dtype)


def _wrong_state(engine, dtype):
    b = engine.block(RECURRENT, PROMPT, 5)
    k, v = engine.pool[(RECURRENT, b)]
    engine.pool[(RECURRENT, b)] = (k + 3 * torch.randn(k.shape).to(dtype), v)


def _partial(zero: bool):
    def fault(engine, dtype):
        b = engine.block(FULL, PROMPT, 5)
        engine.tier[(FULL, b)] = TierState.LOADED
        k, v = (t.clone() for t in engine.pool[(FULL, b)])
        if zero:
            k[1], v[1] = 0, 0
        else:
            k[1] = torch.randn(k[1].shape).to(dtype)
        engine.pool[(FULL, b)] = (k, v)
    return fault


def _tier(state):
    def fault(engine, dtype):
        engine.tier[(SLIDING, engine.block(SLIDING, PROMPT, 4))] = state
    return fault


FAULTS = {
    "window_mismatch": (_shift_window, (K.WINDOW_MISMATCH, SLIDING)),
    "stale_recurrent_state": (_stale_state, (K.STALE_RECURRENT_STATE, RECURRENT)),
    "recurrent_corrupted": (_wrong_state, (K.RECOMPUTE_MISMATCH, RECURRENT)),
    "partial_load_zero": (_partial(True), (K.PARTIAL_LOAD, FULL)),
    "partial_load_wrong": (_partial(False), (K.PARTIAL_LOAD, FULL)),
    "tier_still_loading": (_tier(TierState.LOADING), (K.TIER_NOT_LOADED, SLIDING)),
    "failed_load_as_hit": (_tier(TierState.FAILED), (K.TIER_NOT_LOADED, SLIDING)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_content_fault_is_named_with_its_kind_and_group_only(name, dtype):
    engine, _, monitor = make(dtype)
    fault, expected = FAULTS[name]
    engine.serve(PROMPT)
    fault(engine, dtype)
    v = served(engine, monitor, PROMPT, store=False)
    assert findings(v) == {expected}, v.findings
    kind, group = expected
    m = monitor.metrics
    assert m.value(S.ANOMALIES.name, group=LABEL[group], kind=kind.value) == 1
    assert m.value(S.GROUP_KIND_ANOMALIES.name, group_kind=KIND_OF[group],
                   kind=kind.value) == 1
    assert m.value_sum(S.GROUP_KIND_ANOMALIES.name) == 1


def _drop_group(blocks, states):
    del blocks[RECURRENT]


def _short_group(blocks, states):
    blocks[SLIDING] = blocks[SLIDING][:-1]


def _null_in_window(blocks, states):
    blocks[SLIDING][-1] = NULL


def _window_table_off_by_one(blocks, states):
    blocks[SLIDING][-1] = blocks[SLIDING][-2]  # #5 mapped to the block stored for #4


def _recurrent_table_stale(blocks, states):
    blocks[RECURRENT][-1] = 4  # ids 1..6 were stored for boundaries #0..#5: this is #3


@pytest.mark.parametrize(("edit", "expected"), [
    (_drop_group, {(K.MISSING_GROUP_STATE, RECURRENT)}),
    (_short_group, {(K.MISSING_GROUP_STATE, SLIDING)}),
    (_null_in_window, {(K.NULL_BLOCK_READ, SLIDING)}),
    (_window_table_off_by_one, {(K.WINDOW_MISMATCH, SLIDING)}),
    (_recurrent_table_stale, {(K.STALE_RECURRENT_STATE, RECURRENT)}),
], ids=["group_evicted", "group_short", "null_in_window", "window_table_off_by_one",
        "recurrent_table_stale"])
def test_table_faults_are_found_from_the_block_tables(edit, expected):
    engine, _, monitor = make()
    v = served(engine, monitor, edit=edit)
    assert findings(v) == expected, v.findings
    assert all(f.detail and f.group_id in (SLIDING, RECURRENT) for f in v.findings)


@pytest.mark.parametrize("group", [SLIDING, RECURRENT])
def test_layout_wrong_in_one_group_is_a_structure_anomaly_of_that_group(group):
    engine, adapter, monitor = make()
    adapter.bad_layout = group
    v = served(engine, monitor)
    assert findings(v) == {(K.STRUCTURE, group)}, v.findings
    others = {r.group_id for r in v.verified} - {group}
    assert others == {FULL, SLIDING, RECURRENT} - {group}


def test_a_half_zeroed_block_without_a_tier_load_is_not_a_partial_load():
    engine, _, monitor = make()
    engine.serve(PROMPT)
    b = engine.block(FULL, PROMPT, 5)
    k, v = (t.clone() for t in engine.pool[(FULL, b)])
    k[1] = 0
    engine.pool[(FULL, b)] = (k, v)
    assert findings(served(engine, monitor, store=False)) == {(K.ZEROS, FULL)}


def test_a_null_block_chosen_by_another_sampler_is_never_read_as_kv():
    """A probe with its own sampler (no groups) may pick a null block: not read, not a
    false ``zeros``; the verdict only holds what the groups must cover."""
    engine, adapter, monitor = make()
    engine.serve(PROMPT)
    reads: list = []
    read = adapter.read
    adapter.read = lambda hit, refs: (reads.extend(refs), read(hit, refs))[-1]  # type: ignore
    hit = engine.serve(PROMPT, edit=None)
    refs = tuple(UniformSampler(1).choose(hit, BS, 6))  # no groups: nulls included
    assert any(r.block_id == NULL for r in refs)
    v = monitor.verify_sample(Sample(hit, refs, {}, 0.0))
    assert not v.findings
    assert reads and all(r.block_id != NULL for r in reads)


def test_coverage_check_on_odd_tables():
    from sidecar.checks.coverage import check_coverage
    from sidecar.core.protocol import CacheGroup, EngineInfo, GroupKind

    tier = CacheGroup(9, GroupKind.OFFLOADED_TIER, (0,), name="cpu")
    info = EngineInfo("t", "m", "r", "float32", BS, 2, 8, (*groups(), tier))
    blocks = {FULL: [1, 2], SLIDING: [3, 4], RECURRENT: [0, 5]}
    assert check_coverage(Hit((), 8, blocks), info) == []  # the tier group: not required
    assert [(f.kind, f.group_id, f.block_index) for f in check_coverage(
        Hit((), 8, {**blocks, 9: [7]}), info)] == [(K.MISSING_GROUP_STATE, 9, 1)]
    odd = check_coverage(Hit((), 8, {**blocks, FULL: "ab", SLIDING: [3, None]}), info)
    assert {(f.kind, f.group_id) for f in odd} == {(K.MISSING_GROUP_STATE, FULL)}
    assert check_coverage(Hit((), 3, {}), info) == []  # no full block: nothing required
    for junk in (None, "loaded", {FULL: 5}):  # an engine bug in tier_states: no verdict
        assert check_coverage(Hit((), 8, blocks, tier_states=junk), info) == []  # type: ignore
    states = {SLIDING: ["resident", "loading"]}  # plain strings are states too
    assert [(f.kind, f.group_id, f.block_index) for f in check_coverage(
        Hit((), 8, blocks, tier_states=states), info)] == [(K.TIER_NOT_LOADED, SLIDING, 1)]
