"""Fault injection: real cache-manager bugs, reproduced on demand, by name, under a seed.

Each fault is one small class that overrides one or two engine hooks; the engine calls every
hook on every request and a clean :class:`Fault` does nothing. Hooks run in the engine
thread, with the engine's lock held where they touch the pool. A fault stays dormant until
request index ``start_after`` (so dashboards show a clean start), draws every random choice
from its own seeded RNG (so a run is reproducible), and records each injection as ground
truth for the detection benchmark. See ``/FAULTS.md`` for the catalogue and who should
catch each one.

Adding a fault: subclass :class:`Fault`, set ``name`` and ``description``, override hooks,
declare in ``engine_needs`` any engine setting it cannot act without (a CPU tier, int8
storage), and add it to :data:`FAULTS`; ``kv-sidecar bench detection`` then scores it
against the engine's ground truth without further code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sidecar.engines.reference.model import derive_seed
from sidecar.engines.reference.pool import BlockData, BlockHash, KeyFields, chain_hash

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sidecar.engines.reference.sequence import EngineView as ReferenceEngine
    from sidecar.engines.reference.sequence import RunningSequence

MAX_INJECTIONS = 10_000  # ground-truth records kept (bounded memory on long runs)


@dataclass(frozen=True)
class Injection:
    """One place a fault acted: which request, which block, what it did."""

    request_index: int
    block_id: int | None
    detail: str


class Fault:
    """No fault: the clean engine. Base class of every fault; each hook is a no-op.

    ``corrupts_kv``: the fault changes KV the model decodes over (the others break the
    allocator's accounting instead).
    """

    name: ClassVar[str] = "none"
    description: ClassVar[str] = "no fault: the clean engine"
    corrupts_kv: ClassVar[bool] = False
    default_probability: ClassVar[float] = 1.0
    default_start_after: ClassVar[int] = 20
    # Engine settings the fault needs to act at all (a CPU tier, quantised storage); the
    # engine turns them on where its config left them at their defaults.
    engine_needs: ClassVar[dict[str, Any]] = {}
    # Cache-group kinds (GroupKind values) a hybrid fault acts on; empty: a fault of the
    # plain reference engine (one full-attention group). See applies_to.
    needs_groups: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, seed: int = 0, start_after: int | None = None,
                 probability: float | None = None) -> None:
        self.seed = seed
        self.start_after = self.default_start_after if start_after is None else start_after
        self.probability = self.default_probability if probability is None else probability
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability}")
        self.rng = random.Random(derive_seed("fault", self.name, seed))
        self.injections: list[Injection] = []

    def active(self, request_index: int) -> bool:
        return request_index >= self.start_after

    def chance(self) -> bool:
        return self.rng.random() < self.probability

    def record(self, request_index: int, block_id: int | None, detail: str) -> None:
        if len(self.injections) < MAX_INJECTIONS:
            self.injections.append(Injection(request_index, block_id, detail))

    # ------------------------------------------------------------------ hooks
    def block_hash(self, request_index: int, parent: BlockHash | None, tokens: Sequence[int],
                   key_fields: KeyFields) -> BlockHash | None:
        """Replace the block hash; ``None`` keeps the engine's strong chained hash."""
        return None

    def before_allocate(self, engine: ReferenceEngine, request_index: int) -> None:
        """Before the blocks of request ``request_index`` are allocated."""

    def on_hit(self, engine: ReferenceEngine, seq: RunningSequence,
               block_ids: Sequence[int]) -> None:
        """After a lookup found ``block_ids`` for ``seq`` (ground truth for key faults)."""

    def on_allocate(self, engine: ReferenceEngine, seq: RunningSequence,
                    block_ids: Sequence[int]) -> None:
        """After fresh blocks were allocated for ``seq`` (before anything is written)."""

    def on_block_full(self, engine: ReferenceEngine, seq: RunningSequence,
                      block_id: int) -> None:
        """A block of ``seq`` became full, before it is indexed, digested and reported:
        write-path bugs act here (the write-time digest then certifies the wrong bytes, as
        a real engine's would)."""

    def on_block_stored(self, engine: ReferenceEngine, seq: RunningSequence,
                        block_id: int) -> None:
        """After a full block was indexed and reported (its write-time digest taken)."""

    def load_fails(self, engine: ReferenceEngine, request_index: int, block_id: int) -> bool:
        """Whether the CPU-tier load into ``block_id`` silently fails (the engine reports it
        loaded, indexes it and serves it as a hit either way)."""
        return False

    def load_layers(self, engine: ReferenceEngine, request_index: int, block_id: int,
                    num_layers: int) -> Sequence[int] | None:
        """The layers the CPU-tier load into ``block_id`` copies back; ``None`` = all."""
        return None

    def unawaited_layers(self, engine: ReferenceEngine, request_index: int, block_id: int,
                         num_layers: int) -> int | None:
        """``None``: the engine waits for the CPU-tier load into ``block_id`` before using
        it. A count ``k``: the engine serves the block once ``k`` layers are copied, while
        the load is still in flight (the copy completes after the prefill)."""
        return None

    def release(self, engine: ReferenceEngine, seq: RunningSequence) -> list[int] | None:
        """Release ``seq``'s blocks instead of the engine; ``None`` = the clean release.
        Returns the blocks that left the index (the engine reports them freed)."""
        return None

    # ------------------------------------------------------------------ hybrid hooks
    # Called by HybridEngine only (hybrid_engine.py), with its lock held.
    @classmethod
    def applies_to(cls, group_kinds: frozenset[str]) -> bool:
        """Whether the fault can act on an engine whose groups have ``group_kinds``: plain
        faults on the one-group reference engine, hybrid faults where their groups are."""
        if cls.name == "none":
            return True
        if not cls.needs_groups:
            return group_kinds == frozenset({"full_attention"})
        return bool(cls.needs_groups & group_kinds)

    def on_hybrid_hit(self, engine: Any, seq: RunningSequence, hit_blocks: int) -> None:
        """After a hybrid hit of ``hit_blocks`` blocks was matched and allocated, before
        it is reported and read: block-table bugs rewrite ``seq.block_table`` here
        (through ``engine.swap``)."""

    def state_to_store(self, engine: Any, seq: RunningSequence, index: int,
                       state: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """The recurrent state the engine stores for boundary block ``index`` (``previous``:
        the state it stored for the boundary before, if any)."""
        return state

    def on_group_block_full(self, engine: Any, seq: RunningSequence, group_id: int,
                            block_id: int) -> None:
        """A block of a hybrid group became full, before it is indexed and reported."""


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


class Fragmentation(Fault):
    name = "fragmentation"
    description = ("the allocator insists on runs of consecutive free blocks: allocations "
                   "fail (and evict) while plenty of scattered blocks are free")

    def before_allocate(self, engine: ReferenceEngine, request_index: int) -> None:
        if self.active(request_index) and not engine.pool.contiguous:
            engine.pool.contiguous = True
            self.record(request_index, None, "allocator switched to contiguous runs")


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


# ---------------------------------------------------------------------- registry
FAULTS: dict[str, type[Fault]] = {
    cls.name: cls
    for cls in (Fault, ZeroBlock, NonFinite, BoundaryOffByOne, StaleReuse, KeyMissingField,
                HashCollision, PrematureFree, Leak, BitFlip, Fragmentation, TornWrite,
                FailedLoadAsHit, LayoutMismatch, QuantizationDrift, StorageDowncast)
}


def make_fault(name: str, seed: int = 0, start_after: int | None = None,
               probability: float | None = None, **params: Any) -> Fault:
    """Instantiate a fault by name (``kv-sidecar faults`` lists them); ``params`` are the
    fault's own knobs (e.g. ``buckets`` for hash-collision)."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    return FAULTS[name](seed=seed, start_after=start_after, probability=probability, **params)


def describe_faults() -> list[tuple[str, str]]:
    """(name, one-line description) of every fault, in registry order."""
    return [(name, cls.description) for name, cls in FAULTS.items()]


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


FAULTS.update({cls.name: cls for cls in (PartialLoad, TornAsyncCopy)})
