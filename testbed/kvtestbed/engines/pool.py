"""The paged KV block pool and its prefix-cache index.

A block holds ``block_size`` token slots of K and V for every layer of its cache group. A
block is in exactly one of three states, and the pool keeps one structure per state:

* **free**: unreferenced and not indexed; a FIFO queue, allocated first;
* **cached**: unreferenced but indexed by its chained block hash, so a later prompt with the
  same prefix can reuse it; an LRU, evicted (least recently released first) only when the
  free queue is empty;
* **used**: referenced by at least one live sequence (``ref_count`` = number of holders).

Every allocation bumps the block's ``generation``, so anything that remembers a block id and
its generation (the sidecar's store records, a hit) can tell a reused block from the one it
saw. The pool is deliberately *trusting*: it does exactly what its callers ask, so the fault
injector can reproduce real allocator bugs with the same primitives the clean path uses
(``deref`` / ``park`` / ``push_free``), and :meth:`BlockPool.view` exposes the state an
invariant checker needs to catch them.

Not thread-safe by itself: the engine serialises mutation and copies under its lock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from kvtestbed.engines.blocks import (
    ROOT_HASH,
    Allocation,
    BlockData,
    BlockHash,
    BlockMeta,
    KeyFields,
    chain_hash,
)
from kvtestbed.engines.config import DigestFn
from kvtestbed.engines.pool_view import PoolView
from kvtestbed.engines.quant import check_storage, dequantize, quantize

# The block types live in blocks.py and the snapshot in pool_view.py; re-exported here
# because the faults, the tier and the tests import them from the pool.
__all__ = ["ROOT_HASH", "Allocation", "BlockData", "BlockHash", "BlockMeta", "BlockPool",
           "KeyFields", "PoolView", "chain_hash"]


class BlockPool:
    """K/V storage of ``num_blocks`` blocks plus free queue, cached LRU and hash index.

    Storage is one tensor per K and V of shape
    ``(layers, num_blocks, kv_heads, block_size, head_dim)``: ``key[layer]`` is the
    per-layer ``(num_blocks, kv_heads, block_size, head_dim)`` cache a paged-attention
    kernel indexes, and ``key[:, b]`` is block ``b`` for every layer (what the sidecar reads).
    Storage starts zeroed, as uninitialised device memory often is.
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 kv_storage: str | None = None, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        check_storage(kv_storage)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype  # what reads return; the storage may be quantised (kv_storage)
        self.kv_storage = kv_storage
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        stored = torch.int8 if kv_storage == "int8" else dtype
        self.key = torch.zeros(shape, dtype=stored, device=device)
        self.value = torch.zeros(shape, dtype=stored, device=device)
        # Quantised storage: one float32 scale per (layer, block, head, slot) row (quant.py).
        scale_shape = (*shape[:-1], 1) if kv_storage else (0,)
        self.key_scale = torch.zeros(scale_shape, device=device)
        self.value_scale = torch.zeros(scale_shape, device=device)
        # block -> factor a buggy quantiser applies to the scale it should use (the
        # quantization-drift fault sets it; clean writes use 1.0).
        self.scale_error: dict[int, float] = {}
        # Called with a cached block's id just before eviction drops its index entry (the
        # engine's CPU offload tier copies it out here).
        self.on_evict: Callable[[int], None] | None = None
        self.blocks = [BlockMeta(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._index: dict[BlockHash, int] = {}
        self.allocations = 0
        self.allocation_failures = 0
        self.evictions = 0
        self.release_errors = 0
        # Paged allocation takes any free blocks; contiguity only matters when an allocator
        # insists on runs of consecutive ids (the fragmentation fault switches this on).
        self.contiguous = False

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return sum(1 for m in self.blocks if m.ref_count > 0)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest run of ``hashes`` found in the index, from the start."""
        found: list[int] = []
        for h in hashes:
            b = self._index.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def find(self, block_hash: BlockHash) -> int | None:
        """The block indexed under ``block_hash`` (a hybrid group checks single positions)."""
        return self._index.get(block_hash)

    def reserve(self, block_id: int) -> None:
        """Take a free block out of circulation for good: a hybrid group's null block,
        which pads block-table positions the group holds no state for."""
        self._free.pop(block_id, None)

    def largest_free_run(self) -> int:
        """Longest run of consecutive block ids on the free queue."""
        best = run = 0
        prev = -2
        for b in sorted(self._free):
            run = run + 1 if b == prev + 1 else 1
            best = max(best, run)
            prev = b
        return best

    def largest_usable_run(self) -> int:
        """The most free blocks one allocation can take: all of them for a paged
        allocator, the longest consecutive run when allocation needs contiguity."""
        return self.largest_free_run() if self.contiguous else self.num_free

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int, holder: int, reserve: Sequence[int] = ()) -> Allocation:
        """Take ``reserve`` (hit blocks, by reference) and ``n`` fresh blocks for ``holder``.

        One call is one allocation attempt. It fails (``ok`` false, nothing handed out) when
        fewer than ``n`` blocks are free or evictable once the reserved blocks are taken or,
        with ``contiguous`` set, when no run of ``n`` consecutive free ids could be made;
        ``evicted`` lists what left the index either way.
        """
        self.allocations += 1
        reserved_evictable = sum(1 for b in set(reserve) if b in self._cached)
        if n > len(self._free) + len(self._cached) - reserved_evictable:
            self.allocation_failures += 1
            return Allocation((), (), ok=False)
        self.touch(reserve, holder)
        evicted: list[int] = []
        if self.contiguous:
            ids = self._contiguous_run(n, evicted)
            if ids is None:
                self.release(reserve, holder)
                self.allocation_failures += 1
                return Allocation((), tuple(evicted), ok=False)
            for b in ids:
                del self._free[b]
        else:
            ids = []
            for _ in range(n):
                if not self._free:
                    self._evict_one(evicted)
                b, _ = self._free.popitem(last=False)
                ids.append(b)
        for b in ids:
            meta = self.blocks[b]
            meta.generation += 1
            meta.ref_count = 1
            meta.holders = Counter({holder: 1})
            # The metadata describes the new owner's (not yet hashed) content. The index
            # is deliberately not consulted: a clean pool never has a free block indexed.
            meta.block_hash = None
            meta.tokens, meta.key_fields, meta.prefix_tokens = (), (), 0
        return Allocation(tuple(ids), tuple(evicted))

    def _evict_one(self, evicted: list[int]) -> None:
        """Move the least recently released cached block to the free queue's head."""
        b, _ = self._cached.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(b)
        self.uncache(b)
        self.evictions += 1
        evicted.append(b)
        self._free[b] = None
        self._free.move_to_end(b, last=False)

    def _contiguous_run(self, n: int, evicted: list[int]) -> list[int] | None:
        """The lowest run of ``n`` consecutive free ids, evicting LRU blocks into the free
        queue (at most ``2n``) while none exists: the allocator of the fragmentation fault."""
        budget = 2 * n
        while True:
            ids = sorted(self._free)
            start = 0
            for i in range(len(ids)):
                if i and ids[i] != ids[i - 1] + 1:
                    start = i
                if i - start + 1 == n:
                    return ids[start:i + 1]
            if not self._cached or budget == 0:
                return None
            self._evict_one(evicted)
            budget -= 1

    def touch(self, block_ids: Iterable[int], holder: int) -> None:
        """Add ``holder`` as a reference to blocks found by a lookup."""
        for b in block_ids:
            meta = self.blocks[b]
            if meta.ref_count == 0:
                self._cached.pop(b, None)
                self._free.pop(b, None)  # only reachable when a fault left it indexed
            meta.ref_count += 1
            meta.holders[holder] += 1

    # ------------------------------------------------------------------ indexing
    def cache(self, block_id: int, block_hash: BlockHash, tokens: Sequence[int],
              key_fields: KeyFields, prefix_tokens: int) -> bool:
        """Index a full block under ``block_hash``; ``False`` when the hash is already
        indexed (the engine recomputed a block it could not reuse): the block stays private.
        """
        if block_hash in self._index:
            return False
        meta = self.blocks[block_id]
        self._index[block_hash] = block_id
        meta.block_hash = block_hash
        meta.tokens = tuple(tokens)
        meta.key_fields = key_fields
        meta.prefix_tokens = prefix_tokens
        return True

    def uncache(self, block_id: int) -> bool:
        """Remove the block's index entry (if the index still points at it)."""
        meta = self.blocks[block_id]
        h = meta.block_hash
        if h is None:
            return False
        if self._index.get(h) == block_id:
            del self._index[h]
        meta.block_hash = None
        return True

    # ------------------------------------------------------------------ release
    def deref(self, block_id: int, holder: int) -> int | None:
        """Drop ``holder``'s reference; the new ref count, or ``None`` (counted as a release
        error) when ``holder`` does not hold the block: a double free, never applied."""
        meta = self.blocks[block_id]
        if meta.holders[holder] <= 0 or meta.ref_count <= 0:
            self.release_errors += 1
            return None
        meta.holders[holder] -= 1
        if meta.holders[holder] == 0:
            del meta.holders[holder]
        meta.ref_count -= 1
        return meta.ref_count

    def park(self, block_id: int) -> None:
        """Put an unreferenced block where it belongs: indexed -> cached LRU (most recent
        end), otherwise -> free queue (tail)."""
        if self.blocks[block_id].block_hash is not None:
            self._cached[block_id] = None
            self._cached.move_to_end(block_id)
        else:
            self.push_free(block_id)

    def push_free(self, block_id: int) -> None:
        """Append the block to the free queue as is. The clean path only does this for
        unindexed blocks; a fault may call it on an indexed one."""
        self._cached.pop(block_id, None)
        self._free[block_id] = None

    def release(self, block_ids: Sequence[int], holder: int) -> None:
        """Release a finished sequence's blocks, tail first, so a shared prefix outlives
        the sequence-specific blocks after it in the LRU (as vLLM does)."""
        for b in reversed(block_ids):
            if self.deref(b, holder) == 0:
                self.park(b)

    # ------------------------------------------------------------------ KV storage
    def write(self, block_ids: Sequence[int], start: int, keys: torch.Tensor,
              values: torch.Tensor, skip: frozenset[int] = frozenset()) -> None:
        """Write KV of positions ``start..start+n`` (shape (layers, heads, n, dim)) into the
        sequence's blocks; blocks in ``skip`` are left untouched."""
        bs = self.block_size
        n = int(keys.shape[2])
        pos = start
        while pos < start + n:
            bi, off = divmod(pos, bs)
            take = min(bs - off, start + n - pos)
            b = block_ids[bi]
            if b not in skip:
                src = slice(pos - start, pos - start + take)
                self._store(b, slice(off, off + take), keys[:, :, src], values[:, :, src])
            pos += take

    def _store(self, block_id: int, slots: slice, keys: torch.Tensor,
               values: torch.Tensor) -> None:
        if self.kv_storage is None:
            self.key[:, block_id, :, slots] = keys
            self.value[:, block_id, :, slots] = values
            return
        factor = self.scale_error.get(block_id, 1.0)
        for store, scales, x in ((self.key, self.key_scale, keys),
                                 (self.value, self.value_scale, values)):
            q, scale = quantize(x, factor)
            store[:, block_id, :, slots] = q
            scales[:, block_id, :, slots] = scale

    def gather(self, block_ids: Sequence[int], num_tokens: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        """KV of the first ``num_tokens`` positions of a block table, as contiguous
        ``(layers, kv_heads, num_tokens, head_dim)`` tensors (what attention reads)."""
        nb = -(-num_tokens // self.block_size)
        idx = torch.tensor(list(block_ids[:nb]), dtype=torch.long, device=self.key.device)
        out = []
        for store, scales in ((self.key, self.key_scale), (self.value, self.value_scale)):
            t = store.index_select(1, idx)  # (L, nb, H, bs, D)
            if self.kv_storage is not None:
                t = dequantize(t, scales.index_select(1, idx), self.dtype)
            layers, _, heads, _, dim = t.shape
            t = t.permute(0, 2, 1, 3, 4).reshape(layers, heads, nb * self.block_size, dim)
            out.append(t[:, :, :num_tokens].contiguous())
        return out[0], out[1]

    def digester(self, digest: DigestFn | None = None) -> Callable[[int], str]:
        """A block's write-time digest: ``digest`` (default
        :func:`sidecar.checks.fingerprint.kv_digest`) of what :meth:`read_block` returns; the
        default read in place where the pool holds exactly those bytes (host memory, not
        quantised; :class:`~sidecar.checks.fingerprint.PoolDigests`)."""
        from sidecar.checks.fingerprint import PoolDigests, kv_digest

        if digest is None and self.kv_storage is None and self.key.device.type == "cpu":
            return PoolDigests(self.key, self.value)
        fn = digest or kv_digest
        return lambda block_id: fn(*self.read_block(block_id))

    def read_block(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one block's K and V, ``(layers, kv_heads, block_size, head_dim)``, in
        the model dtype (dequantised when the storage is quantised)."""
        if self.kv_storage is not None:
            return (dequantize(self.key[:, block_id], self.key_scale[:, block_id], self.dtype),
                    dequantize(self.value[:, block_id], self.value_scale[:, block_id],
                               self.dtype))
        return self.key[:, block_id].clone(), self.value[:, block_id].clone()

    def export_block(self, block_id: int) -> BlockData:
        """The block's stored bytes as they are (quantised values and scales included): what
        an offload tier copies out, or a reader compares bit for bit."""
        if self.kv_storage is None:
            return BlockData(self.key[:, block_id].clone(), self.value[:, block_id].clone())
        return BlockData(self.key[:, block_id].clone(), self.value[:, block_id].clone(),
                         self.key_scale[:, block_id].clone(),
                         self.value_scale[:, block_id].clone())

    def import_block(self, block_id: int, data: BlockData) -> None:
        """Overwrite the block's stored bytes with ``data`` (from :meth:`export_block`)."""
        self.key[:, block_id] = data.key
        self.value[:, block_id] = data.value
        if self.kv_storage is not None and data.key_scale is not None \
                and data.value_scale is not None:
            self.key_scale[:, block_id] = data.key_scale
            self.value_scale[:, block_id] = data.value_scale

    # ------------------------------------------------------------------ introspection
    def lists(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[BlockHash, int],
                                                                      ...]]:
        """(free queue, cached LRU, index entries) as they are: the cheap part of
        :meth:`view` an outside invariant checker needs (call under the engine's lock)."""
        return tuple(self._free), tuple(self._cached), tuple(self._index.items())

    def view(self) -> PoolView:
        return PoolView(
            num_blocks=self.num_blocks,
            free=tuple(self._free),
            cached=tuple(self._cached),
            ref_counts=tuple(m.ref_count for m in self.blocks),
            holders=tuple(tuple(sorted(m.holders.elements())) for m in self.blocks),
            generations=tuple(m.generation for m in self.blocks),
            block_hashes=tuple(m.block_hash for m in self.blocks),
            index=dict(self._index),
            allocations=self.allocations,
            allocation_failures=self.allocation_failures,
            evictions=self.evictions,
            release_errors=self.release_errors,
        )
