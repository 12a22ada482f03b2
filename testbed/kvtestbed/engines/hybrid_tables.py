"""The hybrid engine's block-table operations on its groups: the hybrid intersection, and
the moves its faults make (point a table at another block, serve a fresh block, let another
request take a matched block). Kept apart from the request lifecycle (hybrid_engine.py),
which mixes this in; every method runs with the engine's lock held.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from kvtestbed.engines.blocks import BlockHash
from kvtestbed.engines.pool import BlockPool
from kvtestbed.engines.sequence import RunningSequence
from sidecar.checks.group_coverage import required_blocks
from sidecar.core.protocol import CacheGroup

NULL_BLOCK = 0  # group 1's padding block


class GroupTables:
    """Per-group block tables of a hybrid engine (group 0 full attention, group 1 the
    sliding-window or recurrent group, whose block 0 is the null block)."""

    pools: dict[int, BlockPool]
    groups: tuple[CacheGroup, ...]
    block_size: int
    truth: Any
    fault: Any
    lock: Any
    _pending_free: list[tuple[int, int]]

    def _emit(self, hook: str, *args: Any) -> None: ...

    def required(self, group_id: int, hit_tokens: int) -> range:
        """Block indices group ``group_id`` must hold real state for, for ``hit_tokens``."""
        return required_blocks(self.groups[group_id], hit_tokens, self.block_size)

    def null_block(self, group_id: int) -> int:
        return NULL_BLOCK if group_id else -1

    def table(self, seq: RunningSequence, group_id: int) -> list[int]:
        return seq.block_table[group_id]

    def swap(self, seq: RunningSequence, group_id: int, index: int, block_id: int) -> None:
        """Point ``seq``'s table at ``block_id`` for ``index``, moving the references."""
        pool = self.pools[group_id]
        table = seq.block_table[group_id]
        old = table[index]
        if block_id != NULL_BLOCK or group_id == 0:
            pool.touch([block_id], seq.seq_id)
        table[index] = block_id
        if (old != NULL_BLOCK or group_id == 0) and pool.deref(old, seq.seq_id) == 0:
            pool.park(old)

    def fresh_block(self, seq: RunningSequence, group_id: int) -> int | None:
        """One more fresh block for ``seq`` (what a missing state gets served from)."""
        alloc = self.pools[group_id].allocate(1, holder=seq.seq_id)
        if not alloc.ok:
            return None
        self._pending_free.extend((group_id, b) for b in alloc.evicted)
        b = alloc.block_ids[0]
        if self.truth is not None:
            self.truth.allocated(group_id, seq.seq_id, [b])
        # Held once by the allocation; swap() takes the table's reference.
        self.pools[group_id].deref(b, seq.seq_id)
        return b

    def clobber(self, group_id: int, block_id: int, rng: random.Random) -> int | None:
        """Another request took ``block_id`` (evicted from the index, new generation) and
        wrote its own content there: a random other stored block's."""
        pool = self.pools[group_id]
        donors = [m.block_id for m in pool.blocks if m.block_hash is not None
                  and m.block_id not in (block_id, NULL_BLOCK)]
        if not donors:
            return None
        donor = rng.choice(donors)
        pool.uncache(block_id)
        pool.blocks[block_id].generation += 1
        pool.import_block(block_id, pool.export_block(donor))
        self._pending_free.append((group_id, block_id))
        if self.truth is not None:
            self.truth.clobbered(group_id, block_id)
        return donor

    def _intersect(self, hashes: Sequence[BlockHash]) -> tuple[int, list[int]]:
        """The hybrid hit: (blocks, group 1's table for them, null-padded)."""
        full = self.pools[0].lookup(hashes)
        other = self.pools[1]
        for n in range(len(full), 0, -1):
            req = self.required(1, n * self.block_size)
            found = [other.find(hashes[i]) for i in req]
            if all(b is not None for b in found):
                return n, [NULL_BLOCK] * req.start + [int(b) for b in found if b is not None]
        return 0, []

    def _store_state(self, seq: RunningSequence, index: int,
                     state: dict[int, torch.Tensor]) -> None:
        layers = self.groups[1].layers
        stacked = torch.stack([state[i] for i in layers])
        previous = None
        if index:
            prev_b = seq.block_table[1][index - 1]
            if prev_b != NULL_BLOCK:
                previous = self.pools[1].key[:, prev_b, :, :, 0].clone()
        b = seq.block_table[1][index]
        if self.truth is not None:
            self.truth.state_written(b, stacked)
        stacked = self.fault.state_to_store(self, seq, index, stacked, previous)
        self.pools[1].key[:, b, :, :, 0] = stacked

    def _read_state(self, block_id: int) -> dict[int, torch.Tensor]:
        data = self.pools[1].key[:, block_id, :, :, 0].clone()
        return {layer: data[j] for j, layer in enumerate(self.groups[1].layers)}

    def _trim(self, seq: RunningSequence) -> None:
        """Release group 1's blocks the group no longer covers; the null block takes their
        place in the table (they stay indexed, evictable, for later hits)."""
        keep_from = self.required(1, seq.num_computed).start
        table = seq.block_table[1]
        released = []
        with self.lock:
            for i in range(keep_from):
                b = table[i]
                if b == NULL_BLOCK:
                    continue
                if self.pools[1].deref(b, seq.seq_id) == 0:
                    self.pools[1].park(b)
                table[i] = NULL_BLOCK
                released.append(b)
        if released:
            self._emit("on_release", 1, seq.seq_id, tuple(released))
