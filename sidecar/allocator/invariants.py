"""Allocator invariants, checked by the sidecar on a snapshot of the engine's block pool.

Pure functions: a :class:`~sidecar.core.protocol.BlockTableSnapshot` (or an
:class:`~sidecar.core.protocol.AllocatorState`) in, a list of :class:`Violation` out, each named by
an :class:`~sidecar.signals.InvariantKind`. Nothing here trusts the engine's own opinion of
who holds a block: *holders* are recomputed from the live sequences' block tables, which is
what the model actually reads through. One pass over the blocks, the block tables and the
hash map: O(blocks + table entries + index entries), a few milliseconds at 4096 blocks, run
on the poll thread, never the engine's.

The invariants of a paged, ref-counted prefix cache (seed 001 §3.3, §4.2, §6.3):

* ``free_while_held``: a block on the free list or the evictable (cached) list has a
  non-zero ref count or is named by a live sequence's block table. The next allocation
  hands it to another sequence while its holder still reads it.
* ``free_while_indexed``: a block on the free list (not the evictable list) is still
  pointed at by a prefix hash-map entry. Freed without unindexing: the boundary
  off-by-one of seed 001 §3.3.
* ``stale_index``: a hash-map entry names a block whose current content hash differs
  (the block was reallocated while indexed). A later prompt with that prefix hits the
  new owner's KV.
* ``ref_count_below_holders``: the ref count is lower than the number of live block-table
  references: a premature free or a lost reference (seed 001 §4.2).
* ``leaked_reference``: the ref count is higher than the number of live block-table
  references: a reference nobody alive holds, so the block never returns to the pool
  (allocated minus freed does not match the live holders: a leak, seed 001 §6.3).
* ``double_free``: a block listed twice on the free lists, a negative ref count, or the
  engine's own count of refused double releases going up.
* ``block_count_mismatch``: counts or lists that do not add up: free + cached + used !=
  total, a block on both lists, an unreferenced block on no list (lost), an evictable
  block no hash-map entry names, a block id out of range.

A block breaks at most one of the three reference invariants (``free_while_held`` first,
then the ref-count direction), so one bug is one violation per block, not three.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sidecar.core.protocol import AllocatorState, BlockTableSnapshot
from sidecar.signals import InvariantKind as K


@dataclass(frozen=True)
class Violation:
    """One broken invariant. ``block_id``/``generation`` identify it in logs and evidence
    (never in a label); ``key`` is what makes the same violation seen on two polls one."""

    kind: K
    group_id: int
    block_id: int | None
    detail: str
    generation: int = 0

    @property
    def key(self) -> tuple[str, int, int | None, int, str]:
        # Block-level violations are identified by block and generation (a new incarnation
        # of the block breaking it again counts again); pool-level ones by their detail.
        detail = "" if self.block_id is not None else self.detail
        return (self.kind.value, self.group_id, self.block_id, self.generation, detail)

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind.value, "group": self.group_id, "block_id": self.block_id,
                "generation": self.generation, "detail": self.detail}


def check_counts(state: AllocatorState, group_id: int = 0) -> list[Violation]:
    """Count-level invariant for engines that only report totals (skipped where any of the
    four counts is unknown)."""
    total, free, cached, used = (state.total_blocks, state.free_blocks, state.cached_blocks,
                                 state.used_blocks)
    if total is None or free is None or cached is None or used is None or total <= 0:
        return []
    if free + cached + used == total and min(free, cached, used) >= 0:
        return []
    return [Violation(K.BLOCK_COUNT_MISMATCH, group_id, None,
                      f"free {state.free_blocks} + cached {state.cached_blocks} + used "
                      f"{state.used_blocks} != total {state.total_blocks}")]


def check_snapshot(snap: BlockTableSnapshot) -> list[Violation]:
    """Every broken invariant of one group's block pool (empty when healthy)."""
    n = snap.num_blocks
    g = snap.group_id
    out: list[Violation] = []
    gens = snap.generations if len(snap.generations) == n else (0,) * n
    reserved = frozenset(snap.reserved)

    def add(kind: K, block: int | None, detail: str) -> None:
        gen = gens[block] if block is not None and 0 <= block < n else 0
        out.append(Violation(kind, g, block, detail, gen))

    if len(snap.ref_counts) != n or len(snap.block_hashes) != n:
        add(K.BLOCK_COUNT_MISMATCH, None,
            f"{len(snap.ref_counts)} ref counts / {len(snap.block_hashes)} hashes for "
            f"{n} blocks")
        return out

    # Holders, from the live block tables (what the model reads through).
    held = [0] * n
    who: dict[int, object] = {}
    for seq, table in snap.sequences.items():
        for b in table:
            if 0 <= b < n:
                held[b] += 1
                who[b] = seq
            else:
                add(K.BLOCK_COUNT_MISMATCH, None, f"sequence {seq} names block {b}, "
                    f"outside the pool of {n}")

    free_count = Counter(snap.free)
    cached_count = Counter(snap.cached)
    for listed in (free_count, cached_count):
        for b, c in listed.items():
            if not 0 <= b < n:
                add(K.BLOCK_COUNT_MISMATCH, None, f"block {b} on a free list, outside the pool")
            elif c > 1:
                add(K.DOUBLE_FREE, b, f"block {b} is on a free list {c} times")
    for b in free_count.keys() & cached_count.keys():
        if 0 <= b < n:
            add(K.BLOCK_COUNT_MISMATCH, b, f"block {b} is both free and evictable")

    indexed: Counter[int] = Counter()
    for h, b in snap.index:
        if not 0 <= b < n:
            add(K.BLOCK_COUNT_MISMATCH, None, f"a hash-map entry names block {b}, outside "
                "the pool")
            continue
        indexed[b] += 1
        if snap.block_hashes[b] != h:
            add(K.STALE_INDEX, b, f"a hash-map entry names block {b}, which now holds other "
                "content (reallocated while indexed)")

    ref_counts = snap.ref_counts
    for b in range(n):
        if b in reserved:
            continue
        rc = ref_counts[b]
        h = held[b]
        on_free = b in free_count
        on_list = on_free or b in cached_count
        if rc < 0:
            add(K.DOUBLE_FREE, b, f"block {b} has ref count {rc}: released more often "
                "than taken")
        elif on_list and (rc > 0 or h > 0):
            holder = f" (sequence {who.get(b)})" if h else ""
            add(K.FREE_WHILE_HELD, b, f"block {b} is {'free' if on_free else 'evictable'} "
                f"with ref count {rc} and {h} live holder(s){holder}")
        elif rc < h:
            add(K.REF_COUNT_BELOW_HOLDERS, b, f"block {b}: ref count {rc} < {h} live "
                f"holders (sequence {who.get(b)}): freed while still in use")
        elif rc > h:
            add(K.LEAKED_REFERENCE, b, f"block {b}: ref count {rc} > {h} live holders: "
                "a reference no live sequence holds")
        if on_free and indexed[b]:
            add(K.FREE_WHILE_INDEXED, b, f"block {b} is free but the hash map still names it")
        if not on_list and rc == 0 and h == 0:
            add(K.BLOCK_COUNT_MISMATCH, b, f"block {b} is unreferenced but on no free list "
                "(lost)")
        if b in cached_count and not indexed[b]:
            add(K.BLOCK_COUNT_MISMATCH, b, f"block {b} is evictable but no hash-map entry "
                "names it")
    return out


def unheld_references(snap: BlockTableSnapshot) -> int:
    """References the allocator counts that no live sequence holds: the sum over blocks of
    ref count minus live block-table references, where positive. What the leak trend test
    watches: a leaked reference never comes back, so this only grows under a leak, while a
    count of *blocks* held by nobody dips whenever a live sequence hits a leaked (still
    indexed) block."""
    held = [0] * snap.num_blocks
    for table in snap.sequences.values():
        for b in table:
            if 0 <= b < snap.num_blocks:
                held[b] += 1
    reserved = frozenset(snap.reserved)
    return sum(rc - h for b, (rc, h) in enumerate(zip(snap.ref_counts, held, strict=False))
               if rc > h and b not in reserved)
