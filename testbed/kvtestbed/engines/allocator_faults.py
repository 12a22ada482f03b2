"""Faults in the cache manager's bookkeeping: block-table boundaries, premature frees,
leaks, stale reuse, and prefix keys that miss a field or collide. The base class and how to
add a fault: :mod:`kvtestbed.engines.fault_base`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtestbed.engines.pool import BlockHash, KeyFields, chain_hash

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvtestbed.engines.sequence import EngineView as ReferenceEngine
    from kvtestbed.engines.sequence import RunningSequence

from kvtestbed.engines.fault_base import Fault


# ---------------------------------------------------------------------- allocator faults
class BoundaryOffByOne(Fault):
    name = "boundary-off-by-one"
    description = ("a sequence ending exactly on a block boundary frees its last full block "
                   "straight to the free queue while the hash map still points at it")
    corrupts_kv = True

    def release(self, engine: ReferenceEngine, seq: RunningSequence) -> list[int] | None:
        bs = engine.block_size
        if not self.active(seq.seq_id) or seq.num_computed % bs or not self.chance():
            return None
        pool = engine.pool
        # The bug: the partial-tail index is computed as (n - 1) // bs, so on an exact
        # multiple the last *full* block is treated as the private partial tail.
        tail = (seq.num_computed - 1) // bs
        for i in reversed(range(len(seq.blocks))):
            b = seq.blocks[i]
            if pool.deref(b, seq.seq_id) != 0:
                continue
            if i >= tail:
                if pool.blocks[b].block_hash is not None:
                    self.record(seq.seq_id, b, "indexed full block pushed to the free queue")
                pool.push_free(b)
            else:
                pool.park(b)
        return []


class PrematureFree(Fault):
    name = "premature-free"
    description = ("releasing a shared block drops every reference, so it is reused while "
                   "another live sequence (and the hash map) still point at it")
    corrupts_kv = True
    default_probability = 0.5

    def release(self, engine: ReferenceEngine, seq: RunningSequence) -> list[int] | None:
        if not self.active(seq.seq_id):
            return None
        pool = engine.pool
        for b in reversed(seq.blocks):
            shared = pool.blocks[b].ref_count > 1
            left = pool.deref(b, seq.seq_id)
            if shared and self.chance():
                pool.blocks[b].ref_count = 0  # the other holders keep using it
                pool.push_free(b)
                self.record(seq.seq_id, b, "shared block freed while still held")
            elif left == 0:
                pool.park(b)
        return []


class Leak(Fault):
    name = "leak"
    description = "a finished sequence's blocks are never released (free count drifts down)"
    default_probability = 0.3

    def release(self, engine: ReferenceEngine, seq: RunningSequence) -> list[int] | None:
        if self.active(seq.seq_id) and self.chance():
            self.record(seq.seq_id, None, f"{len(seq.blocks)} blocks leaked")
            return []
        return None


class StaleReuse(Fault):
    name = "stale-reuse"
    description = ("a reused block is never written for its new owner: it keeps the previous "
                   "owner's KV and is indexed under the new owner's hash")
    corrupts_kv = True
    default_probability = 0.3

    def on_allocate(self, engine: ReferenceEngine, seq: RunningSequence,
                    block_ids: Sequence[int]) -> None:
        if not block_ids or not self.active(seq.seq_id):
            return
        b = block_ids[0]
        first_new = len(seq.blocks) - len(block_ids)
        span = seq.prompt_len + seq.request.max_new_tokens - 1
        # Only a block that had an owner before and that this sequence fills completely:
        # the stale content then gets indexed, which is the bug's harm beyond one request.
        if (engine.pool.blocks[b].generation > 1 and span >= (first_new + 1)
                * engine.block_size and self.chance()):
            seq.skip_write.add(b)
            self.record(seq.seq_id, b, "first new block left with the previous owner's KV")


# ---------------------------------------------------------------------- key faults
class KeyMissingField(Fault):
    name = "key-missing-field"
    description = ("the block hash drops the adapter: requests with different adapters "
                   "share entries")
    corrupts_kv = True

    def block_hash(self, request_index: int, parent: BlockHash | None, tokens: Sequence[int],
                   key_fields: KeyFields) -> BlockHash | None:
        if not self.active(request_index):
            return None
        # Hashing the adapter as "" keeps every adapter-less entry valid (no hit-rate dip
        # when the bug ships) while named adapters collide with the plain model's entries.
        blanked = tuple((k, "" if k == "adapter" else v) for k, v in key_fields)
        return chain_hash(parent, tokens, blanked)

    def on_hit(self, engine: ReferenceEngine, seq: RunningSequence,
               block_ids: Sequence[int]) -> None:
        for b in block_ids:
            stored = engine.pool.blocks[b].key_fields
            if stored and stored != seq.key_fields:
                self.record(seq.seq_id, b, f"hit stored with {dict(stored)}")


class HashCollision(Fault):
    name = "hash-collision"
    description = ("a weak block hash (a few thousand buckets) maps different token "
                   "sequences to one entry")
    corrupts_kv = True

    def __init__(self, seed: int = 0, start_after: int | None = None,
                 probability: float | None = None, buckets: int = 2048) -> None:
        super().__init__(seed, start_after, probability)
        self.buckets = buckets

    def block_hash(self, request_index: int, parent: BlockHash | None, tokens: Sequence[int],
                   key_fields: KeyFields) -> BlockHash | None:
        if not self.active(request_index):
            return None
        strong = chain_hash(parent, tokens, key_fields)
        return (int.from_bytes(strong[:8], "little") % self.buckets).to_bytes(8, "little")

    def on_hit(self, engine: ReferenceEngine, seq: RunningSequence,
               block_ids: Sequence[int]) -> None:
        bs = engine.block_size
        for i, b in enumerate(block_ids):
            meta = engine.pool.blocks[b]
            if (meta.tokens != tuple(seq.tokens[i * bs:(i + 1) * bs])
                    or meta.key_fields != seq.key_fields or meta.prefix_tokens != i * bs):
                self.record(seq.seq_id, b, f"block {i} of the hit holds other tokens")
                return  # every later block of this hit is out of context as well


class GaugeNotARate(Fault):
    name = "gauge-not-a-rate"
    description = ("the engine's prefix-cache hit metric is a gauge overwritten with each "
                   "batch's hit tokens instead of a counter: the KV is right, the published "
                   "hit rate is not (SGLang 26608)")

    def published_hit_tokens(self, request_index: int, total: int, batch: int) -> int:
        if not self.active(request_index):
            return total
        if not self.injections:
            self.record(request_index, None, "hit metric overwritten per batch from here on")
        return batch


class Fragmentation(Fault):
    name = "fragmentation"
    description = ("the allocator insists on runs of consecutive free blocks: allocations "
                   "fail (and evict) while plenty of scattered blocks are free")

    def before_allocate(self, engine: ReferenceEngine, request_index: int) -> None:
        if self.active(request_index) and not engine.pool.contiguous:
            engine.pool.contiguous = True
            self.record(request_index, None, "allocator switched to contiguous runs")
