"""Faults that corrupt the stored KV bytes in place: zeroed, non-finite, flipped bits, and
storage that loses precision (quantisation drift, a downcast). The base class and how to
add a fault: :mod:`kvtestbed.engines.fault_base`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvtestbed.engines.sequence import EngineView as ReferenceEngine
    from kvtestbed.engines.sequence import RunningSequence

from kvtestbed.engines.fault_base import Fault


# ---------------------------------------------------------------------- content faults
class ZeroBlock(Fault):
    name = "zero-block"
    description = "a stored block's K/V is zeroed in place after the write (memset after free)"
    corrupts_kv = True
    default_probability = 0.1

    def on_block_stored(self, engine: ReferenceEngine, seq: RunningSequence,
                        block_id: int) -> None:
        if self.active(seq.seq_id) and self.chance():
            engine.pool.key[:, block_id].zero_()
            engine.pool.value[:, block_id].zero_()
            self.record(seq.seq_id, block_id, "K and V zeroed")


class NonFinite(Fault):
    name = "nonfinite"
    description = "NaN written into one token row of a stored block (overflow, bad scale)"
    corrupts_kv = True
    default_probability = 0.05

    def on_block_stored(self, engine: ReferenceEngine, seq: RunningSequence,
                        block_id: int) -> None:
        if self.active(seq.seq_id) and self.chance():
            pool = engine.pool
            layer = self.rng.randrange(pool.key.shape[0])
            head = self.rng.randrange(pool.key.shape[2])
            slot = self.rng.randrange(pool.block_size)
            pool.key[layer, block_id, head, slot] = float("nan")
            self.record(seq.seq_id, block_id, f"NaN in K layer {layer} head {head} slot {slot}")


class BitFlip(Fault):
    name = "bit-flip"
    description = "one bit of one K/V element flips after the write (memory/transfer fault)"
    corrupts_kv = True
    default_probability = 0.05

    def on_block_stored(self, engine: ReferenceEngine, seq: RunningSequence,
                        block_id: int) -> None:
        if not (self.active(seq.seq_id) and self.chance()):
            return
        pool = engine.pool
        store = pool.key if self.rng.random() < 0.5 else pool.value
        layers, _, heads, slots, dim = store.shape
        where = (self.rng.randrange(layers), block_id, self.rng.randrange(heads),
                 self.rng.randrange(slots), self.rng.randrange(dim))
        element = store[where[0], where[1], where[2], where[3], where[4]:where[4] + 1]
        bits = element.element_size() * 8
        bit = self.rng.randrange(bits)
        mask = 1 << bit
        if mask >= 1 << (bits - 1):  # as a signed integer of the element's width
            mask -= 1 << bits
        as_int = element.view({1: torch.int8, 2: torch.int16,
                               4: torch.int32}[element.element_size()])
        as_int ^= mask  # in place: the view shares the pool's storage
        self.record(seq.seq_id, block_id, f"bit {bit} flipped at {where}")


# ---------------------------------------------------------------------- storage faults
class QuantizationDrift(Fault):
    name = "quantization-drift"
    description = ("int8 KV quantised with a stale scale (a fraction of what the values "
                   "need): most elements saturate, far beyond int8 rounding")
    corrupts_kv = True
    default_probability = 0.1
    engine_needs = {"kv_storage": "int8"}

    def __init__(self, seed: int = 0, start_after: int | None = None,
                 probability: float | None = None, factor: float = 0.25) -> None:
        super().__init__(seed, start_after, probability)
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor}")
        self.factor = factor

    def on_allocate(self, engine: ReferenceEngine, seq: RunningSequence,
                    block_ids: Sequence[int]) -> None:
        errors = engine.pool.scale_error
        for b in block_ids:
            errors.pop(b, None)
            if self.active(seq.seq_id) and self.chance():
                errors[b] = self.factor
                self.record(seq.seq_id, b, f"quantised with {self.factor:g}x the scale "
                                           "its values need")


class StorageDowncast(Fault):
    name = "storage-downcast"
    description = ("a full block's K/V silently round-trips through fp8 (e4m3, no scale) "
                   "on store: plausible values, a few percent off, digest taken after")
    corrupts_kv = True
    default_probability = 0.1

    def on_block_full(self, engine: ReferenceEngine, seq: RunningSequence,
                      block_id: int) -> None:
        pool = engine.pool
        if pool.kv_storage is not None or not (self.active(seq.seq_id) and self.chance()):
            return  # quantised storage has its own format (quantization-drift)
        for store in (pool.key, pool.value):
            blk = store[:, block_id]
            blk.copy_(blk.to(torch.float8_e4m3fn).to(blk.dtype))
        self.record(seq.seq_id, block_id, "K and V round-tripped through float8_e4m3fn")
