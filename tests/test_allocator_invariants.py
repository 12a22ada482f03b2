"""Allocator invariants: each kind on a crafted snapshot, one violation per bug, counting once
per violation across polls, and the real reference engine's faults seen through its adapter."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.allocator import (
    AllocatorHealth,
    LeakTrend,
    LifecycleLog,
    check_counts,
    check_snapshot,
    unheld_references,
)
from sidecar.core.protocol import AllocatorState, BlockTableSnapshot
from sidecar.evidence.record import EvidenceLog
from sidecar.export.metrics import Metrics
from sidecar.signals import InvariantKind as K
from tests.reference_helpers import run_small


def snap(*, free: Sequence[int] = (2, 3), cached: Sequence[int] = (1,),
         ref_counts: Sequence[int] = (1, 0, 0, 0),
         hashes: Sequence[str | None] = (None, "h1", None, None),
         index: Sequence[tuple[str, int]] = (("h1", 1),),
         sequences: dict[int | str, tuple[int, ...]] | None = None,
         generations: Sequence[int] = (1, 1, 0, 0), double_frees: int = 0,
         reserved: Sequence[int] = ()) -> BlockTableSnapshot:
    """A healthy 4-block pool by default: block 0 held by sequence 7, block 1 evictable and
    indexed under h1, blocks 2 and 3 free. Each test breaks one thing."""
    return BlockTableSnapshot(
        group_id=0, num_blocks=len(ref_counts), free=tuple(free), cached=tuple(cached),
        ref_counts=tuple(ref_counts), block_hashes=tuple(hashes), index=tuple(index),
        sequences={7: (0,)} if sequences is None else sequences,
        generations=tuple(generations), double_frees=double_frees, reserved=tuple(reserved))


def kinds(s: BlockTableSnapshot) -> list[tuple[K, int | None]]:
    return [(v.kind, v.block_id) for v in check_snapshot(s)]


def test_healthy_snapshot_has_no_violation() -> None:
    assert check_snapshot(snap()) == []
    assert unheld_references(snap()) == 0
    # A block shared by two live sequences with ref count 2 is healthy too.
    assert check_snapshot(snap(ref_counts=(2, 0, 0, 0), sequences={7: (0,), "req-b": (0,)})) \
        == []


def test_free_block_still_referenced_or_held() -> None:
    # Premature free: block 0 pushed to the free list while sequence 7 still reads it.
    assert kinds(snap(free=(2, 3, 0), ref_counts=(0, 0, 0, 0))) == [(K.FREE_WHILE_HELD, 0)]
    # A referenced block on the evictable list, no live holder: still one violation.
    assert kinds(snap(cached=(1,), ref_counts=(1, 1, 0, 0))) == [(K.FREE_WHILE_HELD, 1)]


def test_free_block_still_indexed() -> None:
    # Boundary off-by-one: the indexed block went to the free list, not the evictable one.
    assert kinds(snap(free=(2, 3, 1), cached=())) == [(K.FREE_WHILE_INDEXED, 1)]


def test_index_entry_pointing_at_a_reallocated_block() -> None:
    # Block 1 was reallocated and re-indexed under h2; the old entry h1 still names it.
    got = kinds(snap(hashes=(None, "h2", None, None), index=(("h1", 1), ("h2", 1))))
    assert got == [(K.STALE_INDEX, 1)]


def test_ref_count_below_holders() -> None:
    got = check_snapshot(snap(sequences={7: (0,), 8: (0,)}))
    assert [(v.kind, v.block_id) for v in got] == [(K.REF_COUNT_BELOW_HOLDERS, 0)]
    assert "freed while still in use" in got[0].detail and got[0].generation == 1


def test_leaked_reference_is_counted_per_reference() -> None:
    # Sequence 7 finished without releasing block 0; another block shared by a leaked and
    # a live holder leaks one reference.
    s = snap(ref_counts=(1, 0, 2, 0), free=(3,), sequences={9: (2,)},
             generations=(1, 1, 1, 0))
    assert kinds(s) == [(K.LEAKED_REFERENCE, 0), (K.LEAKED_REFERENCE, 2)]
    assert unheld_references(s) == 2


def test_double_free_and_lost_block_and_counts() -> None:
    assert kinds(snap(free=(2, 3, 3))) == [(K.DOUBLE_FREE, 3)]
    assert (K.DOUBLE_FREE, 3) in kinds(snap(free=(2,), ref_counts=(1, 0, 0, -1)))
    assert kinds(snap(free=(2,))) == [(K.BLOCK_COUNT_MISMATCH, 3)]  # lost: on no list
    both = check_snapshot(snap(free=(1, 2, 3), hashes=(None,) * 4, index=()))
    assert {(v.kind, v.block_id) for v in both} == {(K.BLOCK_COUNT_MISMATCH, 1)}
    assert any("both free and evictable" in v.detail for v in both)
    assert kinds(snap(index=())) == [(K.BLOCK_COUNT_MISMATCH, 1)]  # evictable, not indexed
    assert kinds(snap(sequences={7: (0, 9)}))[0] == (K.BLOCK_COUNT_MISMATCH, None)
    ok = AllocatorState(10, 4, 2, 4, 4, 0, 0)
    assert check_counts(ok) == []
    bad = check_counts(AllocatorState(10, 4, 2, 3, 4, 0, 0))
    assert [v.kind for v in bad] == [K.BLOCK_COUNT_MISMATCH] and "!= total 10" in bad[0].detail


def test_reserved_blocks_are_skipped() -> None:
    # vLLM's null block: never on a list, never referenced.
    assert check_snapshot(snap(free=(2,), reserved=(3,))) == []


def health() -> tuple[AllocatorHealth, Metrics]:
    metrics = Metrics("e", "m", CollectorRegistry())
    return AllocatorHealth(metrics, EvidenceLog(10), LifecycleLog(0.0), LeakTrend(3)), metrics


def test_a_persisting_violation_counts_once_and_a_new_incarnation_again() -> None:
    h, m = health()
    broken = snap(free=(2, 3, 1), cached=())  # free_while_indexed on block 1, gen 1
    for i in range(3):
        h.observe(None, [broken], request_index=i)
    h.observe(None, None, request_index=3)  # a failed snapshot forgets nothing
    h.observe(None, [broken], request_index=4)
    count = m.value(S.INVARIANT_VIOLATIONS.name, kind=K.FREE_WHILE_INDEXED.value)
    assert count == 1 and h.first_violation_request == 0
    h.observe(None, [snap(free=(2, 3, 1), cached=(), generations=(1, 2, 0, 0))], 5)
    assert m.value(S.INVARIANT_VIOLATIONS.name, kind=K.FREE_WHILE_INDEXED.value) == 2
    assert m.value(S.INVARIANT_CHECKS.name) == 5
    rec = h.evidence.recent(1)[0]
    assert rec["type"] == "invariant_violation" and rec["request"] == 5
    assert rec["violations"][0]["block_id"] == 1 and rec["violations"][0]["generation"] == 2
    # Block ids live in evidence and logs, never in labels.
    labels = {tuple(sorted(s.labels)) for fam in m.registry.collect() for s in fam.samples
              if s.name == S.INVARIANT_VIOLATIONS.name}
    assert labels == {("engine", "kind", "model")}


def test_engine_counted_double_frees_are_counted_by_their_increase() -> None:
    h, m = health()
    h.observe(None, [snap(double_frees=2)], 0)
    h.observe(None, [snap(double_frees=2)], 1)
    h.observe(None, [snap(double_frees=5)], 2)
    assert m.value(S.INVARIANT_VIOLATIONS.name, kind=K.DOUBLE_FREE.value) == 5


@pytest.mark.parametrize(("fault", "expected"), [
    ("none", set()),
    ("boundary-off-by-one", {K.FREE_WHILE_INDEXED, K.STALE_INDEX}),
    ("premature-free", {K.FREE_WHILE_HELD, K.REF_COUNT_BELOW_HOLDERS, K.STALE_INDEX,
                        K.FREE_WHILE_INDEXED}),
    ("leak", {K.LEAKED_REFERENCE}),
])
def test_reference_engine_faults_through_the_adapter(fault: str, expected: set[K]) -> None:
    """Each allocator fault leaves its own kinds of violation in the real pool; the sidecar
    sees them through the engine-agnostic snapshot only (checked after every request)."""
    from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
    from kvtestbed.workload import ChatWorkload, drive

    from tests.reference_helpers import SMALL_POOL, SMALL_WORKLOAD

    engine = ReferenceEngine(EngineConfig(num_blocks=SMALL_POOL, fault=fault))
    adapter = ReferenceAdapter(engine)
    seen: set[K] = set()

    def after(_: object) -> None:
        for s in adapter.block_tables():
            seen.update(v.kind for v in check_snapshot(s))
        seen.update(v.kind for v in check_counts(adapter.allocator()))

    drive(engine, ChatWorkload(SMALL_WORKLOAD), on_result=after)
    if expected:
        assert engine.fault.injections
        assert seen & expected and seen <= expected | {K.BLOCK_COUNT_MISMATCH}, seen
        assert K.BLOCK_COUNT_MISMATCH not in seen
    else:
        assert seen == set()


def test_engine_counted_double_free_reaches_the_snapshot() -> None:
    engine, _ = run_small("premature-free")
    (s,) = ReferenceAdapter(engine).block_tables()
    assert s.double_frees == engine.pool.release_errors > 0
