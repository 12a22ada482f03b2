"""The cache-event journal applies events in one batched pass (issue 22: its per-event CPU
is the engine process's cost); the batch must leave exactly the state that one
``record``/``forget`` per event leaves: same index, same lifecycle window, same 1-in-N log
and burst, same rejections."""

from __future__ import annotations

import random

from sidecar.allocator import LifecycleLog, LifecycleOp
from sidecar.core.journal import CacheEventJournal
from sidecar.core.journal_hooks import free_event, lifecycle_event, store_event
from sidecar.core.protocol import BlockRef, StoredBlock
from sidecar.core.store_index import StoreIndex


def _block(i: int, gen: int = 1) -> StoredBlock:
    return StoredBlock(group_id=0, block_id=i % 40, generation=gen,
                       tokens=list(range(i, i + 4)), prefix_tokens=4 * (i % 3),
                       parent_block_id=(i - 1) % 40 if i % 3 else None,
                       key_fields={"adapter": ""}, seq_id=i)


def _events(log: LifecycleLog) -> list[tuple[object, ...]]:
    return [(e["op"], e["group"], e["seq"], tuple(e["blocks"]), tuple(e["generations"]),
             e["length"]) for e in log.recent(10_000)]


def test_batched_extend_keeps_the_sampled_log_and_the_burst_of_one_record_each() -> None:
    rng = random.Random(3)
    for every_rate, burst in ((0.1, 0), (0.25, 7), (1.0, 3), (0.0, 5), (0.3, 0)):
        one, many = (LifecycleLog(sample_rate=every_rate, window=64, kept=10_000,
                                  burst=burst) for _ in range(2))
        n = 0
        for _ in range(30):
            if rng.random() < 0.2:
                one.trigger()
                many.trigger()
            batch = []
            for _ in range(rng.randrange(0, 25)):
                n += 1
                ev = (LifecycleOp.ALLOCATE, 0, n, (n % 50,), (1,), None)
                one.record(*ev, at=float(n))
                batch.append((many.events + len(batch) + 1, float(n), *ev))
            many.extend(batch)
        assert many.events == one.events == n
        assert _events(many) == _events(one), (every_rate, burst)
        assert many.path(0, range(50), limit=10_000) == one.path(0, range(50), limit=10_000)


def test_journal_drain_matches_one_record_per_event() -> None:
    direct_index, direct_log = StoreIndex(1000), LifecycleLog(1.0, window=4096, kept=4096)
    index, log = StoreIndex(1000), LifecycleLog(1.0, window=4096, kept=4096)
    journal = CacheEventJournal(index, log)
    for i in range(300):
        b = _block(i, gen=i // 40 + 1)
        journal.append(store_event(b))
        direct_index.record(b)
        direct_log.record(LifecycleOp.STORE, 0, i, (b.block_id,), (b.generation,),
                          b.prefix_tokens + 4)
        if i % 5 == 4:
            journal.append(free_event(0, [i % 40, (i + 7) % 40]))
            direct_index.forget(0, [i % 40, (i + 7) % 40])
            direct_log.record(LifecycleOp.EVICT, 0, None, (i % 40, (i + 7) % 40))
        if i % 9 == 0:
            journal.append(lifecycle_event(LifecycleOp.ALLOCATE, 0, i, [i % 40], [2]))
            direct_log.record(LifecycleOp.ALLOCATE, 0, i, (i % 40,), (2,))
    assert journal.drain() == 300 + 60 + 34
    assert index._records == direct_index._records
    assert index._epochs == direct_index._epochs
    assert _events(log) == _events(direct_log)


def test_journal_drain_rejects_out_of_range_stores_and_applies_the_rest() -> None:
    rejected: list[tuple[str, object]] = []
    index = StoreIndex(100)
    journal = CacheEventJournal(index, LifecycleLog(0.0),
                                reject=lambda hook, why: rejected.append((hook, why)) or
                                why is not None)
    for block_id, generation in ((-1, 1), (3, True), (4, 1)):
        journal.append(store_event(StoredBlock(group_id=0, block_id=block_id,
                                               generation=generation, tokens=[1, 2],
                                               prefix_tokens=0)))
    journal.append(free_event(1 << 20, [4]))
    assert journal.drain() == 4
    assert [(h, w is not None) for h, w in rejected] == [("on_store", True)] * 2 + [
        ("on_free", True)]
    assert index.epoch(0, 4) == 1 and index.epoch(0, 3) == 0 and len(index) == 1


def test_a_hit_event_is_applied_as_it_is_and_read_back_only_when_its_ids_are_ids() -> None:
    """A sampled hit's lifecycle event is applied as it is (the verifier checks its ids, off
    the engine's thread); the lifecycle's readers leave out one whose ids are not ids. The
    same bad ids in an ordinary lifecycle event are refused when applied, as before."""
    rejected: list[tuple[str, object]] = []
    log = LifecycleLog(1.0, window=64, kept=64)
    journal = CacheEventJournal(StoreIndex(100), log,
                                reject=lambda hook, why: rejected.append((hook, why)) or
                                why is not None)
    journal.append(lifecycle_event(LifecycleOp.HIT, 0, 1, [1, 2], [1, 1], 32, as_is=True))
    journal.append(lifecycle_event(LifecycleOp.HIT, 0, 2, [3, -4], [1, 1], 32, as_is=True))
    journal.append(lifecycle_event(LifecycleOp.HIT, 0, 3, [1, "x"], [1, 1], 32, as_is=True))
    journal.append(lifecycle_event(LifecycleOp.HIT, 0, 4, [3, -4], [1, 1], 32))
    assert journal.drain() == 4
    assert log.events == 3  # the three as-is events applied, the ordinary bad one not
    assert [e[2] for e in _events(log)] == [1]  # read back: the good one only
    assert [e["seq"] for e in log.path(0, [1, 3])] == [1]
    assert [hook for hook, _ in rejected] == ["on_lookup"]  # the ordinary bad one refused


def test_the_monitor_journals_a_sampled_hit_as_it_is() -> None:
    from kvtestbed.bench.perf_hooks import hit_lookup, monitor_for

    from sidecar.core.journal_hooks import AS_IS_LIFECYCLE_EVENT

    mon = monitor_for(1, queue_size=4)
    mon.journal.drain()
    seen: list[tuple[object, ...]] = []
    append = mon.journal.append
    mon.journal.append = lambda ev: (seen.append(ev), append(ev))[1]  # type: ignore[method-assign]
    mon.on_lookup(hit_lookup(0, blocks=4))
    assert [ev[0] for ev in seen] == [AS_IS_LIFECYCLE_EVENT]


def test_applied_records_and_lifecycle_events_leave_the_collectors_tracking() -> None:
    """What the journal keeps per applied event (a store's record, its lifecycle tuple)
    outlives the young generations; were it tracked by the garbage collector, every store
    would count toward the next full collection of the engine's whole heap (~2 us per
    store in ``bench perf``). A plain tuple of ints and strings stops being tracked at the
    first collection it survives, one holding such tuples at the second (the young and the
    middle generation's): the records and the lifecycle window must be such."""
    import gc

    index, log = StoreIndex(1000), LifecycleLog(1.0, window=4096, kept=4096)
    journal = CacheEventJournal(index, log)
    for i in range(200):
        journal.append(store_event(_block(i, gen=i // 40 + 1)))
        journal.append(lifecycle_event(LifecycleOp.ALLOCATE, 0, i, [i % 40], [2]))
        if i % 5 == 4:
            journal.append(free_event(0, [i % 40]))
    journal.drain()
    gc.collect(0)  # the young generation's collection, then the middle one's
    gc.collect(1)
    records = list(index._records.values())
    window = list(log._window)
    assert len(records) > 20 and len(window) == 200 + 200 + 40
    assert not [r for r in records if gc.is_tracked(r)]
    assert not [e for e in window if gc.is_tracked(e)]
    # ...and read back as before: the op an enum, the record a StoreRecord
    snap, _ = index.snapshot([_ref(index)])
    (rec,) = snap.values()
    assert rec is not None and rec.key_fields == {"adapter": ""}
    assert {e["op"] for e in log.recent(10_000)} == {"store", "allocate", "evict"}
    assert log.path(0, [3])[0]["op"] in ("store", "allocate", "evict")


def _ref(index: StoreIndex) -> BlockRef:
    g, b, _ = index.resident()[0]
    return BlockRef(g, 0, b)


def test_key_fields_of_any_mapping_read_back_as_they_were_stored() -> None:
    from types import MappingProxyType

    index = StoreIndex(10)
    fields = [{"adapter": "x", "lora": "7"}, MappingProxyType({"ns": "a", "salt": ""}), {}]
    for i, kf in enumerate(fields):
        index.record(StoredBlock(group_id=0, block_id=i, generation=1, tokens=[1, 2],
                                 prefix_tokens=0, key_fields=kf))
    snap, _ = index.snapshot([BlockRef(0, 0, i) for i in range(3)])
    assert [dict(r.key_fields) for r in snap.values() if r is not None] == \
        [dict(f) for f in fields]


def test_a_parent_id_that_is_not_one_chains_nothing_and_never_another_groups_block() -> None:
    """The parent id is not checked before the index keys it (group and id in one int): a
    numpy id still chains; one past the id bits must not reach another group's block, and
    a float or a string must not raise."""
    import numpy as np

    for pid, chains in ((3, True), (np.int64(3), True), ((1 << 41) | 3, False), (-1, False),
                        (1.5, False), ("x", False)):
        index = StoreIndex(100)
        index.record(StoredBlock(0, 3, 1, [1, 2], 0))
        index.record(StoredBlock(1, 3, 1, [1, 2], 0))  # what (1 << 41) | 3 would name
        index.record(StoredBlock(0, 4, 1, [5, 6], 2, parent_block_id=pid))  # type: ignore[arg-type]
        (rec,) = index.snapshot([BlockRef(0, 1, 4)])[0].values()
        assert rec is not None and rec.chained is chains, pid
