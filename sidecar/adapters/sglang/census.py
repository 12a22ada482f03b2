"""Allocator invariants of SGLang's token-slot pool, checked on the tap's census.

A census is the pool as SGLang's own structures have it at one instant on the scheduler's
thread: the allocator's free list (``free_pages`` + ``release_pages`` + frees it is still
grouping), the radix tree's device slots (``all_values_flatten``), the tree's evictable and
protected (lock-referenced) sizes, and the slots the tap saw handed out by ``alloc`` and not
given back by ``free`` (the only view that is not SGLang's own bookkeeping). Slots are
shipped as bitmaps (``slots / 8`` bytes each), so the checks run here, in the sidecar:

* ``double_free``: the free list names a slot twice;
* ``free_while_indexed``: a slot on the free list is still in the tree (freed while a node
  holds it: the next allocation hands cached KV to another request);
* ``free_while_held``: a slot on the free list was handed out and never freed (the list
  was edited behind the allocator's back, or a free was lost from the tap's view);
* ``block_count_mismatch``: free + handed out != total (a slot on neither side is lost); a
  tree slot never handed out; tree slots != evictable + protected; protected < 0 (a lock
  reference taken back twice) or > the tree; and, when SGLang is idle (no request holds a
  row), free + tree != total (slots held by nobody: a leak).

Nothing here trusts SGLang's verdict (it has none): each invariant compares two of its
structures, or one of them with the tap's own record of allocations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.adapters.vllm.wire import WireError
from sidecar.allocator.invariants import Violation
from sidecar.core.protocol import AllocatorState
from sidecar.signals import InvariantKind as K

MAX_SLOTS = 1 << 26  # 64M slots: an 8 MiB bitmap
LISTED = 8  # slots named per violation kind (the count says how many)


@dataclass(frozen=True)
class Census:
    total: int
    free_len: int
    free: np.ndarray  # bool per slot id (0..total)
    tree_len: int
    tree: np.ndarray
    allocated: np.ndarray
    evictable: int
    protected: int
    idle: bool

    def state(self) -> AllocatorState:
        """Counts for the sidecar's allocator signals, in slots (SGLang's unit)."""
        free = int(self.free.sum())
        return AllocatorState(total_blocks=self.total, free_blocks=free,
                              cached_blocks=self.evictable,
                              used_blocks=self.total - free - self.evictable,
                              largest_free_run=free)


def _bits(raw: Any, size: int, what: str) -> np.ndarray:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != (size + 7) // 8:
        raise WireError(f"census {what} is not a bitmap of {size} slots")
    return np.unpackbits(np.frombuffer(bytes(raw), dtype=np.uint8))[:size].astype(bool)


def decode_census(msg: dict[str, Any]) -> Census:
    def num(key: str, lo: int = 0) -> int:
        v = msg.get(key)
        if type(v) is not int or not lo <= v <= MAX_SLOTS:
            raise WireError(f"census {key} is not an int in [{lo}, {MAX_SLOTS}]")
        return v

    total = num("total", 1)
    size = total + 1  # slot 0 is SGLang's padding slot, never allocated
    protected = msg.get("protected")
    if type(protected) is not int or abs(protected) > MAX_SLOTS:
        raise WireError("census protected is not an int")
    return Census(total, num("free_len"), _bits(msg.get("free"), size, "free"),
                  num("tree_len"), _bits(msg.get("tree"), size, "tree"),
                  _bits(msg.get("allocated"), size, "allocated"), num("evictable"),
                  protected, bool(msg.get("idle")))


def _slots(mask: np.ndarray) -> str:
    ids = np.flatnonzero(mask)
    more = f" (+{len(ids) - LISTED} more)" if len(ids) > LISTED else ""
    return ", ".join(str(int(i)) for i in ids[:LISTED]) + more


def check_census(c: Census, group_id: int = 0) -> list[Violation]:
    out: list[Violation] = []

    def add(kind: K, mask: np.ndarray | None, detail: str) -> None:
        if mask is None:
            out.append(Violation(kind, group_id, None, detail))
            return
        for slot in np.flatnonzero(mask)[:LISTED]:
            out.append(Violation(kind, group_id, int(slot), detail))

    free, tree, allocated = c.free, c.tree, c.allocated
    n_free, n_tree = int(free.sum()), int(tree.sum())
    if c.free_len != n_free:
        add(K.DOUBLE_FREE, None, f"the free list has {c.free_len} entries for {n_free} "
                                 "distinct slots: a slot freed twice")
    both = free & tree
    if both.any():
        add(K.FREE_WHILE_INDEXED, both, f"{int(both.sum())} slot(s) on the free list are "
                                        f"still in the radix tree: {_slots(both)}")
    held = free & allocated & ~tree
    if held.any():
        add(K.FREE_WHILE_HELD, held, f"{int(held.sum())} slot(s) on the free list were "
                                     f"handed out and never freed: {_slots(held)}")
    lost = ~free & ~allocated
    lost[0] = False  # the padding slot
    if lost.any():
        add(K.BLOCK_COUNT_MISMATCH, None, f"{int(lost.sum())} slot(s) neither free nor "
                                          f"handed out: {_slots(lost)}")
    stray = tree & ~allocated & ~free
    if stray.any():
        add(K.BLOCK_COUNT_MISMATCH, None, f"{int(stray.sum())} tree slot(s) were never "
                                          f"handed out: {_slots(stray)}")
    if c.tree_len != n_tree:
        add(K.BLOCK_COUNT_MISMATCH, None, f"the tree names {c.tree_len} slots, "
                                          f"{n_tree} distinct: a slot in two nodes")
    if c.protected < 0 or c.protected > c.tree_len:
        add(K.BLOCK_COUNT_MISMATCH, None, f"protected (locked) size {c.protected} outside "
                                          f"[0, {c.tree_len}]: a lock reference below zero")
    elif c.evictable + c.protected != c.tree_len:
        add(K.BLOCK_COUNT_MISMATCH, None, f"evictable {c.evictable} + protected "
                                          f"{c.protected} != {c.tree_len} tree slots")
    if c.idle and n_free + n_tree != c.total:
        add(K.LEAKED_REFERENCE, None, f"idle, yet free {n_free} + tree {n_tree} != total "
                                      f"{c.total}: slots held by no request")
    return out
