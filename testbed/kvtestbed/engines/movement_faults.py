"""Faults in moving KV: torn writes, failed loads served as hits, a wrong layout, the CPU
tier's partial and unawaited async loads, and a tier key missing the namespace. The base
class and how to add a fault: :mod:`kvtestbed.engines.fault_base`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtestbed.engines.pool import BlockData, KeyFields

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvtestbed.engines.sequence import EngineView as ReferenceEngine
    from kvtestbed.engines.sequence import RunningSequence

from kvtestbed.engines.fault_base import Fault


# ---------------------------------------------------------------------- data-movement faults
class TornWrite(Fault):
    name = "torn-write"
    description = ("a block's asynchronous write is not awaited: readers see its trailing "
                   "part still holding the previous owner's bytes")
    corrupts_kv = True
    default_probability = 0.1

    def __init__(self, seed: int = 0, start_after: int | None = None,
                 probability: float | None = None) -> None:
        super().__init__(seed, start_after, probability)
        self._before: dict[int, BlockData] = {}  # block -> bytes before its new owner wrote

    def on_allocate(self, engine: ReferenceEngine, seq: RunningSequence,
                    block_ids: Sequence[int]) -> None:
        for b in block_ids:  # one entry per block at most: bounded by the pool size
            if self.active(seq.seq_id):
                self._before[b] = engine.pool.export_block(b)
            else:
                self._before.pop(b, None)

    def on_block_stored(self, engine: ReferenceEngine, seq: RunningSequence,
                        block_id: int) -> None:
        before = self._before.pop(block_id, None)
        if before is None or not self.chance():
            return
        pool = engine.pool
        # The copy runs K layer by layer, then V; it was cut somewhere in the middle.
        regions = [(store, old, layer) for store, old in ((pool.key, before.key),
                                                          (pool.value, before.value))
                   for layer in range(store.shape[0])]
        per = pool.key[0, block_id].numel()
        cut = self.rng.randrange(per * len(regions) // 4, 3 * per * len(regions) // 4)
        changed = False
        for j, (store, old, layer) in enumerate(regions):
            start = max(0, cut - j * per)
            if start >= per:
                continue
            now = store[layer, block_id].view(-1)[start:]
            stale = old[layer].reshape(-1)[start:]
            changed = changed or not torch.equal(now, stale)
            now.copy_(stale)
        if changed:
            self.record(seq.seq_id, block_id, f"write torn at element {cut} of "
                        f"{per * len(regions)}: the rest holds the previous bytes")


class FailedLoadAsHit(Fault):
    name = "failed-load-as-hit"
    description = ("a load from the CPU offload tier fails (the tier marks the entry failed) "
                   "but the engine treats it as done: the block is indexed and served as a "
                   "hit holding its previous owner's KV (or zeros)")
    corrupts_kv = True
    default_probability = 1.0  # a broken tier backend fails every load, not one in a few
    engine_needs = {"cpu_offload_blocks": 512}

    def load_fails(self, engine: ReferenceEngine, request_index: int, block_id: int) -> bool:
        if self.active(request_index) and self.chance():
            self.record(request_index, block_id, "tier load failed, reported as loaded")
            return True
        return False


class LayoutMismatch(Fault):
    name = "layout-mismatch"
    description = ("a block is written in the wrong layout (token-major bytes into a "
                   "head-major block, or K and V swapped) and read in the engine's layout")
    corrupts_kv = True
    default_probability = 0.1

    def on_block_full(self, engine: ReferenceEngine, seq: RunningSequence,
                      block_id: int) -> None:
        if not (self.active(seq.seq_id) and self.chance()):
            return
        pool = engine.pool
        pairs = [(pool.key, pool.value)]
        if pool.kv_storage is not None:
            pairs.append((pool.key_scale, pool.value_scale))
        before = pool.export_block(block_id)
        if self.rng.random() < 0.5:
            detail = "token-major (slot, head, dim) bytes in a head-major block"
            for store in (t for pair in pairs for t in pair):
                blk = store[:, block_id]  # (layers, heads, slots, dim)
                store[:, block_id] = blk.transpose(1, 2).contiguous().view(blk.shape)
        else:
            detail = "K and V swapped"
            for k, v in pairs:
                k_copy = k[:, block_id].clone()
                k[:, block_id] = v[:, block_id]
                v[:, block_id] = k_copy
        after = pool.export_block(block_id)
        if any(not torch.equal(a, b) for a, b in zip(before.tensors(), after.tensors(),
                                                     strict=True)):
            self.record(seq.seq_id, block_id, detail)


# ---------------------------------------------------------------------- offload-tier faults
# (the CPU tier's state machine and async loads: tier.py; failed-load-as-hit is above)
class PartialLoad(Fault):
    name = "partial-load"
    description = ("a CPU-tier load copies back only its first layers and reports the block "
                   "loaded: the other layers keep the destination's previous bytes")
    corrupts_kv = True
    default_probability = 0.5
    engine_needs = {"cpu_offload_blocks": 512}

    def load_layers(self, engine: ReferenceEngine, request_index: int, block_id: int,
                    num_layers: int) -> Sequence[int] | None:
        if num_layers < 2 or not (self.active(request_index) and self.chance()):
            return None
        copied = self.rng.randrange(1, num_layers)
        self.record(request_index, block_id, f"load copied layers 0..{copied - 1} of "
                                             f"{num_layers}, reported loaded")
        return range(copied)


class TornAsyncCopy(Fault):
    name = "torn-async-copy"
    description = ("the engine serves a CPU-tier block without awaiting its async load: the "
                   "request (and a capture at match time) reads it while still loading, its "
                   "later layers holding the previous bytes; the copy completes afterwards")
    corrupts_kv = True
    default_probability = 1.0  # a scheduler that skips the wait skips it on every load
    engine_needs = {"cpu_offload_blocks": 512}

    def unawaited_layers(self, engine: ReferenceEngine, request_index: int, block_id: int,
                         num_layers: int) -> int | None:
        if not (self.active(request_index) and self.chance()):
            return None
        copied = self.rng.randrange(num_layers)
        self.record(request_index, block_id, f"served while loading, {copied} of "
                                             f"{num_layers} layers copied")
        return copied


NAMESPACE_FIELDS = ("adapter", "cache_salt")  # what isolates one tenant's / adapter's entries


class NamespaceMissingAtTier(Fault):
    name = "namespace-missing-at-tier"
    description = ("the CPU tier's key drops the cache namespace (adapter and cache_salt) "
                   "that the device index keeps: a request misses on the device and loads "
                   "another namespace's block of the same tokens from the tier (SGLang 26747)")
    corrupts_kv = True
    engine_needs = {"cpu_offload_blocks": 512}

    def tier_key_fields(self, request_index: int, key_fields: KeyFields) -> KeyFields | None:
        if not self.active(request_index):
            return None
        return tuple((k, "" if k in NAMESPACE_FIELDS else v) for k, v in key_fields)

    def on_hit(self, engine: ReferenceEngine, seq: RunningSequence,
               block_ids: Sequence[int]) -> None:
        for b in block_ids:
            stored = engine.pool.blocks[b].key_fields
            if stored and stored != seq.key_fields:
                self.record(seq.seq_id, b, f"tier hit stored under {dict(stored)}")
