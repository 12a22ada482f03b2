"""A read-only snapshot of the block pool and the invariants a healthy pool keeps.

Separate from the pool so that checking state (tests, the allocator demo) reads a plain
value, never the live structures the engine mutates under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtestbed.engines.blocks import BlockHash


@dataclass(frozen=True)
class PoolView:
    """A read-only snapshot of the pool's state for invariant checks and tests.

    ``free`` is in allocation order, ``cached`` in eviction order (oldest first);
    ``holders[b]`` are the sequence ids holding block ``b``, one entry per reference (a
    sequence whose block table names a block twice holds it twice); ``index`` maps each
    block hash to the block id the hash map points at.
    """

    num_blocks: int
    free: tuple[int, ...]
    cached: tuple[int, ...]
    ref_counts: tuple[int, ...]
    holders: tuple[tuple[int, ...], ...]
    generations: tuple[int, ...]
    block_hashes: tuple[BlockHash | None, ...]
    index: dict[BlockHash, int]
    allocations: int
    allocation_failures: int
    evictions: int
    release_errors: int

    def violations(self, live_holders: Iterable[int] | None = None) -> list[str]:
        """Broken invariants, each named after the bug it reveals (empty when healthy)."""
        out: list[str] = []
        free, cached = set(self.free), set(self.cached)
        indexed = set(self.index.values())
        for b in sorted(free & cached):
            out.append(f"block {b} is both free and cached")
        for b in range(self.num_blocks):
            refs = self.ref_counts[b]
            if refs != len(self.holders[b]):
                out.append(f"block {b}: ref_count {refs} != {len(self.holders[b])} holders "
                           "(premature free or lost reference)")
            if (b in free or b in cached) and refs > 0:
                out.append(f"block {b} is on a free list but referenced ({refs})")
            if refs == 0 and b not in free and b not in cached:
                out.append(f"block {b} is unreferenced but on no free list (leaked)")
            if b in free and b in indexed:
                out.append(f"block {b} is free but still indexed (freed without unindexing)")
            if b in cached and self.block_hashes[b] is None:
                out.append(f"block {b} is cached but has no hash")
        for h, b in self.index.items():
            if self.block_hashes[b] != h:
                out.append(f"index entry {h.hex()[:12]} points at block {b}, which holds "
                           "other content (reused while indexed)")
        if live_holders is not None:
            live = set(live_holders)
            for b in range(self.num_blocks):
                dead = set(self.holders[b]) - live
                if dead:
                    out.append(f"block {b} held by finished sequences {sorted(dead)} (leak)")
        if self.release_errors:
            out.append(f"{self.release_errors} releases by a sequence that did not hold the "
                       "block (double free)")
        return out
