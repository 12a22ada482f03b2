"""Leak detection: the trend test flags references that only go in, and nothing else; the
leak fault raises it through the Monitor, a clean engine never does."""

from __future__ import annotations

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.workload import ChatWorkload, drive
from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.allocator import LeakTrend, unheld_from_state
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import AllocatorState
from tests.reference_helpers import SMALL_POOL, SMALL_WORKLOAD


def feed(trend: LeakTrend, values: list[int | None]) -> list[bool]:
    return [trend.observe(v) for v in values]


def test_growth_that_never_falls_is_a_leak() -> None:
    got = feed(LeakTrend(window=4), [0, 1, 1, 2, 3, 3, 3])
    assert got == [False, False, False, False, True, True, True]


def test_transients_and_constant_offsets_are_not() -> None:
    # Blips that go back to zero (a snapshot between a count and a table update).
    assert not any(feed(LeakTrend(window=4), [0, 2, 0, 1, 0, 3, 0, 1, 2, 0, 1]))
    # Something that is held on purpose and stays constant.
    assert not any(feed(LeakTrend(window=4), [5] * 20))
    # Rising but falling back in between: blocks slow to return, not lost.
    assert not any(feed(LeakTrend(window=4), [1, 3, 2, 4, 3, 5, 4, 6, 5]))


def test_suspicion_clears_at_zero_and_unknown_polls_are_skipped() -> None:
    t = LeakTrend(window=3)
    assert feed(t, [1, None, 2, None, 3]) == [False, False, False, False, True]
    assert t.observe(2) is True  # still leaking: the floor is not gone
    assert t.observe(0) is False and t.unheld == 0
    with pytest.raises(ValueError):
        LeakTrend(window=1)


def test_unheld_from_counts_alone() -> None:
    base = AllocatorState(100, 50, 10, 40, 50, 0, 0)
    assert unheld_from_state(base) is None
    assert unheld_from_state(AllocatorState(100, 50, 10, 40, 50, 0, 0, held_blocks=36)) == 4
    assert unheld_from_state(AllocatorState(100, 50, 10, 40, 50, 0, 0, live_sequences=0)) == 40
    assert unheld_from_state(AllocatorState(100, 50, 10, 40, 50, 0, 0, live_sequences=3)) \
        is None


def run(fault: str) -> Monitor:
    """The small workload with a poll after every request, synchronously (no timing)."""
    engine = ReferenceEngine(EngineConfig(num_blocks=SMALL_POOL, fault=fault))
    monitor = Monitor(ReferenceAdapter(engine),
                      SidecarConfig(sample_every=10_000, allocator_check_min_interval_s=-1),
                      registry=CollectorRegistry())
    engine.sink = monitor
    drive(engine, ChatWorkload(SMALL_WORKLOAD), on_result=lambda _: monitor.poll_allocator())
    return monitor


def test_leak_fault_raises_the_leak_signal_and_clean_does_not() -> None:
    leaky = run("leak")
    s = leaky.summary()
    assert s["leak_suspected"] and s["leak_suspected_blocks"] > 0
    assert s["first_leak_suspected_request"] is not None
    assert s["first_invariant_violation_request"] <= s["first_leak_suspected_request"]
    m = leaky.metrics
    assert m.value(S.LEAK_SUSPECTED_FLAG.name) == 1
    assert m.value(S.LEAK_SUSPECTED.name) == s["leak_suspected_blocks"]
    clean = run("none").summary()
    assert not clean["leak_suspected"] and clean["leak_suspected_blocks"] == 0
    assert clean["invariant_violations"] == {} and clean["invariant_checks"] > 50


def test_thresholds_and_zero_series_are_exported_and_adapter_errors_are_counted() -> None:
    class BrokenTables(ReferenceAdapter):
        def block_tables(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("pool is being resized")

    engine = ReferenceEngine(EngineConfig(num_blocks=SMALL_POOL))
    monitor = Monitor(BrokenTables(engine), SidecarConfig(allocator_check_min_interval_s=-1),
                      registry=CollectorRegistry())
    m = monitor.metrics
    assert m.value(S.THRESHOLD.name, threshold="usage_ratio") == S.THRESHOLDS.usage_ratio
    assert m.value(S.THRESHOLD.name, threshold="allocation_failure_rate") == 0.001
    assert m.value(S.THRESHOLD.name, threshold="fragmentation_ratio") == 0.30
    body = "\n".join(f"{s.name}{s.labels}" for fam in m.registry.collect() for s in fam.samples)
    for kind in S.InvariantKind:
        assert f"'kind': '{kind.value}'" in body  # a clean zero before the first violation
    assert monitor.poll_allocator() is not None  # the counts still arrive
    assert m.value(S.ADAPTER_ERRORS.name, op="block_tables", reason="error") == 1
    assert monitor.summary()["invariant_checks"] == 0
