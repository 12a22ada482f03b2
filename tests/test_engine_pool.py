"""The reference engine's block pool: states, eviction order, hashing, accounting."""

from __future__ import annotations

import pytest
import torch
from kvtestbed.engines.pool import BlockPool, chain_hash

KEY = (("model_revision", "r1"), ("adapter", ""), ("cache_salt", ""))


def make_pool(num_blocks: int = 4, block_size: int = 4) -> BlockPool:
    return BlockPool(num_blocks, block_size, num_layers=2, num_kv_heads=2, head_dim=3)


def test_chain_hash_covers_parent_tokens_and_every_key_field() -> None:
    base = chain_hash(None, [1, 2, 3, 4], KEY)
    assert base == chain_hash(None, [1, 2, 3, 4], KEY)
    assert len(base) == 32
    variants = [
        chain_hash(base, [1, 2, 3, 4], KEY),  # same tokens after a parent
        chain_hash(None, [1, 2, 3, 5], KEY),
        chain_hash(None, [1, 2, 3, 4], (("model_revision", "r2"), *KEY[1:])),
        chain_hash(None, [1, 2, 3, 4], (KEY[0], ("adapter", "legal-v1"), KEY[2])),
        chain_hash(None, [1, 2, 3, 4], (*KEY[:2], ("cache_salt", "tenant-1"))),
        chain_hash(None, [1, 2, 3, 4], ()),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # The encoding is unambiguous: moving a character between name and value changes it.
    assert chain_hash(None, [1], (("ab", "c"),)) != chain_hash(None, [1], (("a", "bc"),))


def test_free_queue_first_then_lru_eviction_order() -> None:
    pool = make_pool(num_blocks=4)
    first = pool.allocate(2, holder=1)
    assert first.ok and first.block_ids == (0, 1) and first.evicted == ()
    for i, b in enumerate(first.block_ids):
        assert pool.cache(b, bytes([i]) * 32, [i] * 4, KEY, i * 4)
    pool.release(first.block_ids, holder=1)
    view = pool.view()
    # Released tail first: the sequence's last block is the least recently used.
    assert view.free == (2, 3) and view.cached == (1, 0)
    second = pool.allocate(3, holder=2)
    assert second.block_ids == (2, 3, 1) and second.evicted == (1,)
    assert pool.view().index == {bytes([0]) * 32: 0}
    assert pool.evictions == 1


def test_shared_blocks_are_counted_per_holder_and_only_cached_when_unreferenced() -> None:
    pool = make_pool()
    a = pool.allocate(1, holder=1)
    pool.cache(a.block_ids[0], b"h" * 32, [1, 2, 3, 4], KEY, 0)
    b = pool.allocate(1, holder=2, reserve=a.block_ids)
    assert b.ok
    view = pool.view()
    assert view.ref_counts[0] == 2 and view.holders[0] == (1, 2)
    pool.release(a.block_ids, holder=1)
    assert 0 not in pool.view().cached and pool.view().ref_counts[0] == 1
    pool.release((0, *b.block_ids), holder=2)
    view = pool.view()
    assert view.cached == (0,) and view.free[-1] == b.block_ids[0]
    assert view.violations(live_holders=()) == []


def test_lookup_hit_takes_a_cached_block_off_the_lru() -> None:
    pool = make_pool()
    a = pool.allocate(2, holder=1)
    hashes = [b"a" * 32, b"b" * 32]
    for i, (blk, h) in enumerate(zip(a.block_ids, hashes, strict=True)):
        pool.cache(blk, h, [i] * 4, KEY, i * 4)
    pool.release(a.block_ids, holder=1)
    assert pool.lookup([*hashes, b"c" * 32]) == [0, 1]
    assert pool.lookup([b"x" * 32, *hashes]) == []
    pool.allocate(1, holder=2, reserve=[0])
    assert pool.view().cached == (1,)


def test_generation_increments_on_every_allocation() -> None:
    pool = make_pool(num_blocks=2)
    for expected in (1, 2, 3):
        alloc = pool.allocate(2, holder=expected)
        assert [pool.blocks[b].generation for b in alloc.block_ids] == [expected, expected]
        pool.release(alloc.block_ids, holder=expected)


def test_allocation_failure_is_counted_and_changes_nothing() -> None:
    pool = make_pool(num_blocks=4)
    a = pool.allocate(3, holder=1)
    pool.cache(a.block_ids[0], b"p" * 32, [0] * 4, KEY, 0)
    pool.release(a.block_ids[:1], holder=1)  # block 0 is cached (evictable) now
    before = pool.view()
    # Two blocks are allocatable (free 3, cached 0), but a hit on block 0 pins it.
    failed = pool.allocate(2, holder=2, reserve=[0])
    assert not failed.ok and failed.block_ids == ()
    after = pool.view()
    assert (after.allocations, after.allocation_failures) == (2, 1)
    assert (after.free, after.cached, after.ref_counts, after.index) == (
        before.free, before.cached, before.ref_counts, before.index)
    assert pool.allocate(2, holder=2).ok


def test_double_free_is_counted_not_applied() -> None:
    pool = make_pool()
    a = pool.allocate(1, holder=1)
    pool.release(a.block_ids, holder=1)
    pool.release(a.block_ids, holder=1)
    view = pool.view()
    assert view.release_errors == 1 and view.ref_counts[0] == 0
    assert any("double free" in v for v in view.violations())


def test_violations_name_the_bug() -> None:
    pool = make_pool()
    a = pool.allocate(2, holder=1)
    pool.cache(a.block_ids[0], b"q" * 32, [0] * 4, KEY, 0)
    assert pool.view().violations(live_holders=[1]) == []
    assert any("finished sequences [1]" in v for v in pool.view().violations(live_holders=[]))
    # Freed without unindexing, then handed to someone else while the hash map points at it.
    pool.deref(a.block_ids[0], holder=1)
    pool.push_free(a.block_ids[0])
    assert any("free but still indexed" in v for v in pool.view().violations())
    while pool.num_free:
        pool.allocate(1, holder=2)
    assert any("reused while indexed" in v for v in pool.view().violations())
    # A reference dropped behind the pool's back.
    pool.blocks[a.block_ids[1]].ref_count = 0
    assert any("ref_count 0 != 1 holders" in v for v in pool.view().violations())


def test_write_and_gather_round_trip_across_blocks() -> None:
    pool = make_pool(num_blocks=4, block_size=4)
    table = list(pool.allocate(3, holder=1).block_ids)
    keys = torch.randn(2, 2, 10, 3)
    values = torch.randn(2, 2, 10, 3)
    pool.write(table, 0, keys[:, :, :6], values[:, :, :6])
    pool.write(table, 6, keys[:, :, 6:], values[:, :, 6:])
    k, v = pool.gather(table, 10)
    assert torch.equal(k, keys) and torch.equal(v, values)
    k_block, _ = pool.read_block(table[1])
    assert k_block.shape == (2, 2, 4, 3) and torch.equal(k_block, keys[:, :, 4:8])
    # A skipped block keeps its old content.
    pool.write(table, 0, torch.zeros(2, 2, 10, 3), torch.zeros(2, 2, 10, 3),
               skip=frozenset({table[1]}))
    assert torch.equal(pool.read_block(table[1])[0], keys[:, :, 4:8])
    assert not pool.read_block(table[0])[0].any()


def test_contiguous_allocation_fails_on_scattered_free_blocks() -> None:
    pool = make_pool(num_blocks=6)
    held = pool.allocate(6, holder=1).block_ids
    pool.release([held[0], held[2], held[4]], holder=1)  # free ids 0, 2, 4: no run of 2
    assert pool.largest_free_run() == 1 and pool.largest_usable_run() == 3
    paged = pool.allocate(2, holder=2)  # paged: any two free blocks do
    assert paged.ok
    pool.release(paged.block_ids, holder=2)
    pool.contiguous = True
    assert pool.largest_usable_run() == 1
    failed = pool.allocate(2, holder=3)
    assert not failed.ok and pool.allocation_failures == 1 and pool.num_free == 3


@pytest.mark.parametrize("bad", [0, -1])
def test_pool_rejects_empty_sizes(bad: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(bad, 4, 1, 1, 1)
