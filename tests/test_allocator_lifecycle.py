"""The block lifecycle log: bounded, sampled, full rate around an anomaly, and readable back
per block from a real engine run with the Monitor attached."""

from __future__ import annotations

import logging

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.workload import ChatWorkload, drive
from prometheus_client import CollectorRegistry

from sidecar.allocator import LifecycleLog, LifecycleOp
from sidecar.core.monitor import Monitor, SidecarConfig
from tests.reference_helpers import SMALL_POOL, SMALL_WORKLOAD


def test_window_is_bounded_and_the_log_is_sampled() -> None:
    lc = LifecycleLog(sample_rate=0.1, window=16, kept=1000, burst=0)
    for i in range(200):
        lc.record(LifecycleOp.ALLOCATE, 0, i, (i,), (1,))
    assert lc.events == 200
    assert len(lc.path(0, range(200), limit=1000)) == 16 + 20 - 2  # window + sampled, deduped
    kept = lc.recent(1000)
    assert [e["seq"] for e in kept] == list(range(9, 200, 10))  # exactly 1 in 10
    none = LifecycleLog(sample_rate=0.0, window=4, burst=0)
    for i in range(50):
        none.record(LifecycleOp.FREE, 0, i, (i,))
    assert none.recent() == []
    with pytest.raises(ValueError):
        LifecycleLog(sample_rate=1.5)


def test_burst_logs_every_event_after_an_anomaly(caplog: pytest.LogCaptureFixture) -> None:
    lc = LifecycleLog(sample_rate=0.0, window=8, burst=5)
    lc.record(LifecycleOp.STORE, 0, 1, (3,), (2,), 32)
    lc.trigger()
    with caplog.at_level(logging.INFO, logger="sidecar.allocator.lifecycle"):
        for i in range(10):
            lc.record(LifecycleOp.HIT, 0, 100 + i, (3, 4), (2, 1), 48)
    assert [e["seq"] for e in lc.recent()] == [100, 101, 102, 103, 104]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and "hit group=0 seq=100 blocks=[3, 4] gen=[2, 1] len=48" in lines[0]


def test_path_reads_one_block_back_in_order() -> None:
    lc = LifecycleLog(sample_rate=0.0, window=64)
    lc.record(LifecycleOp.ALLOCATE, 0, 1, (5, 6), (1, 1))
    lc.record(LifecycleOp.STORE, 0, 1, (5,), (1,), 16)
    lc.record(LifecycleOp.ALLOCATE, 1, 1, (5,), (1,))  # another group: not this block
    lc.record(LifecycleOp.HIT, 0, 2, (5,), (1,), 16)
    lc.record(LifecycleOp.FREE, 0, 1, (5, 6))
    lc.record(LifecycleOp.ALLOCATE, 0, 3, (5,), (2,))
    path = lc.path(0, [5])
    assert [(e["op"], e["seq"]) for e in path] == [("allocate", 1), ("store", 1), ("hit", 2),
                                                   ("free", 1), ("allocate", 3)]
    assert path[-1]["generations"] == [2] and path[1]["length"] == 16


def test_monitor_records_the_lifecycle_of_a_real_engine() -> None:
    """allocate / store / hit / free / evict all arrive from the reference engine, with the
    sequence ids, lengths and generations a post-mortem needs. Hits are logged for sampled
    hits only (the hot path stays O(1) for the others), so sample some."""
    engine = ReferenceEngine(EngineConfig(num_blocks=SMALL_POOL))
    monitor = Monitor(ReferenceAdapter(engine),
                      SidecarConfig(sample_every=3, lifecycle_sample_rate=1.0,
                                    lifecycle_window=100_000),
                      registry=CollectorRegistry())
    engine.sink = monitor
    drive(engine, ChatWorkload(SMALL_WORKLOAD))
    assert engine.sink_errors == {}
    events = monitor.lifecycle.recent(100_000)
    ops = {e["op"] for e in events}
    assert ops == {op.value for op in LifecycleOp}
    hits = [e for e in events if e["op"] == "hit"]
    assert 0 < len(hits) <= monitor.metrics.value("kvsidecar_hits_total") / 3 + 1
    allocs = [e for e in events if e["op"] == "allocate"]
    frees = [e for e in events if e["op"] == "free"]
    assert len(allocs) == len(frees) == engine.stats["finished"]  # clean: all released
    first = allocs[0]
    path = monitor.lifecycle.path(0, [first["blocks"][0]], limit=100_000)
    assert path[0] == first and set(first["generations"]) == {1}  # fresh pool: generation 1
    stores = [e for e in events if e["op"] == "store"]
    assert all(e["seq"] is not None and e["length"] % engine.block_size == 0 for e in stores)
    hits = [e for e in events if e["op"] == "hit"]
    assert hits and all(len(e["blocks"]) == len(e["generations"]) for e in hits)


def test_leaking_release_reports_no_free() -> None:
    engine = ReferenceEngine(EngineConfig(num_blocks=SMALL_POOL, fault="leak"))
    monitor = Monitor(ReferenceAdapter(engine),
                      SidecarConfig(sample_every=10_000, lifecycle_sample_rate=1.0,
                                    lifecycle_window=100_000),
                      registry=CollectorRegistry())
    engine.sink = monitor
    drive(engine, ChatWorkload(SMALL_WORKLOAD))
    events = monitor.lifecycle.recent(100_000)
    leaked = {i.request_index for i in engine.fault.injections}
    freed = {e["seq"] for e in events if e["op"] == "free"}
    allocated = {e["seq"] for e in events if e["op"] == "allocate"}
    assert leaked and leaked <= allocated and not leaked & freed


def test_a_cut_path_says_how_many_older_events_it_left_out() -> None:
    """Evidence keeps a block's last 32 events: a path cut so can start at a free (outside
    check: 44 of 173 paths did, with nothing saying there was more)."""
    log = LifecycleLog(sample_rate=0.0, window=4096)
    log.record(LifecycleOp.ALLOCATE, 0, 1, [7], [1])
    log.record(LifecycleOp.STORE, 0, 1, [7], [1], 16)
    for seq in range(2, 22):
        log.record(LifecycleOp.HIT, 0, seq, [7], [1], 16)
        log.record(LifecycleOp.FREE, 0, seq, [7])
        log.record(LifecycleOp.ALLOCATE, 0, seq, [8], [1])  # another block's
    events, left_out = log.path_and_cut(0, [7], 32)
    assert len(events) == 32 and left_out == 42 - 32
    assert events[0]["op"] == "hit" and log.path(0, [7], 32) == events
    assert log.path_and_cut(0, [7], 64) == (log.path(0, [7], 64), 0)
    assert [e["op"] for e in log.path(0, [7], 64)[:2]] == ["allocate", "store"]
