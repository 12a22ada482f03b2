"""The shared adapter helpers the protocol documents: slot-engine block names and
whole-table store de-duplication (issue 20, finding 10)."""

from __future__ import annotations

import pytest

from sidecar.adapters.slot_blocks import SlotBlocks
from sidecar.adapters.store_dedup import StoreDedup
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import StoredBlock
from tests.toy import BS, ToyAdapter, ToyEngine


def test_slot_blocks_are_named_by_their_last_slot_and_forgotten_on_free() -> None:
    names = SlotBlocks(4)
    a = [10, 11, 12, 13, 20, 21, 22, 23]
    b = [10, 11, 12, 13, 20, 21, 30, 31]  # parts from a inside block 1
    assert names.name_all(a) == [13, 23] and names.name_all(b, first=1) == [31]
    assert names.slots(23) == (20, 21, 22, 23) and names.slots(31) == (20, 21, 30, 31)
    names.forget([23])
    assert names.slots(23) is None and len(names) == 2
    with pytest.raises(ValueError, match="no full block"):
        names.name(a, 6)


def _monitor() -> Monitor:
    return Monitor(ToyAdapter(ToyEngine(sink=None)),
                   SidecarConfig(dispatch="inline", allocator_every_s=0, burst_hits=0))


def _table(n: int, gen: int = 1) -> list[StoredBlock]:
    return [StoredBlock(0, b, gen, list(range(b * BS, (b + 1) * BS)), b * BS,
                        parent_block_id=b - 1 if b else None) for b in range(n)]


def test_a_re_reported_table_bumps_no_epoch_and_a_changed_block_does() -> None:
    monitor = _monitor()
    dedup = StoreDedup(monitor)
    dedup.on_store_table(_table(3))
    monitor.journal.drain()
    before = [monitor.stored.epoch(0, b) for b in range(3)]
    for _ in range(5):  # the engine re-reports the whole table on every store
        dedup.on_store_table(_table(4))
    monitor.journal.drain()
    assert [monitor.stored.epoch(0, b) for b in range(3)] == before
    assert dedup.repeats == 3 + 4 * 4  # block 3 was new the first time
    dedup.on_store(_table(3, gen=2)[1])  # reallocated: a real new store
    dedup.on_free(0, [2])
    dedup.on_store(_table(3)[2])  # stored again after a free: forwarded
    monitor.journal.drain()
    assert monitor.stored.epoch(0, 1) != before[1] and monitor.stored.epoch(0, 2) != before[2]


def test_without_the_helper_each_re_report_is_a_new_epoch() -> None:
    monitor = _monitor()
    epochs = []
    for _ in range(2):
        for block in _table(2):
            monitor.on_store(block)
        monitor.journal.drain()
        epochs.append(monitor.stored.epoch(0, 1))
    assert epochs[0] != epochs[1]  # what the helper is for
