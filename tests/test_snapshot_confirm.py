"""Snapshot consistency: an invariant violation is reported only when a second snapshot
shows it again, so an engine that updates ref counts under its lock but calls its hooks
after releasing it (the radix engine: 128 false ``leaked_reference`` in one clean run) is not
reported, while a real leak still is."""

from __future__ import annotations

from collections.abc import Sequence

from sidecar import signals as S
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockTableSnapshot
from tests.toy import ToyAdapter, ToyEngine

CONFIG = SidecarConfig(sample_every=10**6, dispatch="inline", allocator_every_s=0,
                       burst_hits=0)


def _snap(leaked: bool) -> BlockTableSnapshot:
    """Two blocks: block 0 held by sequence 1; block 1 free, or (leaked) referenced once
    by no live sequence."""
    if leaked:
        return BlockTableSnapshot(0, 2, free=(), cached=(), ref_counts=(1, 1),
                                  block_hashes=(None, None), index=(), sequences={1: (0,)})
    return BlockTableSnapshot(0, 2, free=(1,), cached=(), ref_counts=(1, 0),
                              block_hashes=(None, None), index=(), sequences={1: (0,)})


class Scripted(ToyAdapter):
    """Block tables from a script, one snapshot per call (the last one repeats)."""

    def __init__(self, engine: ToyEngine, script: Sequence[bool]) -> None:
        super().__init__(engine)
        self.script = list(script)
        self.calls = 0

    def block_tables(self) -> Sequence[BlockTableSnapshot]:
        leaked = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return [_snap(leaked)]


def _leaks(script: Sequence[bool], polls: int = 1) -> tuple[float, Scripted]:
    adapter = Scripted(ToyEngine(sink=None), script)
    monitor = Monitor(adapter, CONFIG)
    for _ in range(polls):
        monitor.poll_allocator()
    return monitor.metrics.value(S.INVARIANT_VIOLATIONS.name, kind="leaked_reference"), adapter


def test_a_violation_one_snapshot_shows_and_the_next_does_not_is_not_reported() -> None:
    leaks, adapter = _leaks([True, False])
    assert leaks == 0
    assert adapter.calls == 2  # the first snapshot's violation was checked again


def test_a_violation_two_snapshots_show_is_reported_once() -> None:
    leaks, adapter = _leaks([True], polls=3)
    assert leaks == 1 and adapter.calls == 6


def test_a_clean_snapshot_is_taken_once() -> None:
    leaks, adapter = _leaks([False], polls=2)
    assert leaks == 0 and adapter.calls == 2
