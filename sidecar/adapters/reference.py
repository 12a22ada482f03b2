"""Adapter for the reference paged engine (:mod:`sidecar.engines.reference`).

In-process placement: ``read`` copies blocks straight out of the engine's pool tensors and
``recompute`` runs the engine's own model from scratch (no cache) with the hit's key fields.
Both are called from the sidecar's worker thread while the engine runs in its own; the
engine's lock is held only for the copies and the allocator snapshot, never for a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.engines.reference.engine import GROUP_ID, KEY_FIELD_NAMES, ReferenceEngine
from sidecar.protocol import (
    AdapterError,
    AllocatorState,
    BlockKV,
    BlockRef,
    BlockTableSnapshot,
    CacheGroup,
    EngineInfo,
    GroupKind,
    Hit,
    SequenceId,
)


class ReferenceAdapter:
    """Implements :class:`sidecar.protocol.Adapter` and
    :class:`sidecar.protocol.AllocatorIntrospection` for a :class:`ReferenceEngine`."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine
        mc = engine.config.model
        self._info = EngineInfo(
            engine="reference",
            model=mc.name,
            revision=mc.revision,
            dtype=mc.dtype,
            block_size=engine.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            groups=(CacheGroup(GROUP_ID, GroupKind.FULL_ATTENTION,
                               tuple(range(mc.num_layers)), name="full"),),
            key_fields=KEY_FIELD_NAMES,
            kv_storage=engine.config.kv_storage,  # int8 storage widens the tolerance
        )

    def describe(self) -> EngineInfo:
        return self._info

    def _check(self, ref: BlockRef) -> None:
        if ref.group_id != GROUP_ID:
            raise AdapterError(f"reference engine has no cache group {ref.group_id}")
        if not 0 <= ref.block_id < self.engine.pool.num_blocks:
            raise AdapterError(f"block id {ref.block_id} outside the pool")

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """Copies of the blocks as the pool holds them now, with the generation seen while
        copying: read before and after, and the later one returned, so a block reused
        during the copy is reported as reused (the verifier then drops the sample)."""
        pool = self.engine.pool
        out: list[BlockKV] = []
        for ref in refs:
            self._check(ref)
            with self.engine.lock:
                before = pool.blocks[ref.block_id].generation
                key, value = pool.read_block(ref.block_id)
                after = pool.blocks[ref.block_id].generation
            out.append(BlockKV(ref, key, value, generation=max(before, after)))
        return out

    def capture(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """Copies of the blocks as the request is served them (optional capability: the
        Monitor calls it on the engine's thread, inside ``on_lookup``, for sampled hits
        only, before the engine's prefill gathers these blocks)."""
        pool = self.engine.pool
        out: list[BlockKV] = []
        with self.engine.lock:
            for ref in refs:
                self._check(ref)
                key, value = pool.read_block(ref.block_id)
                out.append(BlockKV(ref, key, value, generation=pool.blocks[ref.block_id]
                                   .generation))
        return out

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """KV of ``hit.tokens`` up to the end of the last ref's block, computed from
        scratch with the hit's own adapter: what the cache should have held."""
        if not refs:
            return []
        for ref in refs:
            self._check(ref)
        revision = hit.key_fields.get("model_revision", self._info.revision)
        if revision != self._info.revision:
            raise AdapterError(f"model revision {revision!r} is not loaded "
                               f"(engine runs {self._info.revision!r})")
        bs = self._info.block_size
        end = max(ref.token_range(bs)[1] for ref in refs)
        if end > len(hit.tokens):
            raise AdapterError(f"block ends at token {end} but the hit has "
                               f"{len(hit.tokens)} tokens")
        kv = self.engine.model.prefill(list(hit.tokens[:end]), hit.key_fields.get("adapter", ""))
        out: list[BlockKV] = []
        for ref in refs:
            start, stop = ref.token_range(bs)
            out.append(BlockKV(ref, kv.keys[:, :, start:stop].clone(),
                               kv.values[:, :, start:stop].clone()))
        return out

    def allocator(self) -> AllocatorState:
        engine = self.engine
        pool = engine.pool
        with engine.lock:
            allocated, filled = engine.slot_usage()
            tables = engine.live_block_tables()
            return AllocatorState(
                total_blocks=pool.num_blocks,
                free_blocks=pool.num_free,
                cached_blocks=pool.num_cached,
                used_blocks=pool.num_used,
                largest_free_run=pool.largest_usable_run(),
                allocations=pool.allocations,
                allocation_failures=pool.allocation_failures,
                allocated_slots=allocated,
                filled_slots=filled,
                live_sequences=len(tables),
                held_blocks=len({b for t in tables.values() for b in t}),
            )

    def block_tables(self) -> tuple[BlockTableSnapshot, ...]:
        """The pool's lists, per-block ref counts, hashes and generations, the hash map and
        the live block tables, copied in one hold of the engine's lock (so the snapshot is
        consistent; the checks run on it afterwards, off the lock)."""
        engine = self.engine
        pool = engine.pool
        with engine.lock:
            free, cached, index = pool.lists()
            metas = pool.blocks
            sequences: dict[SequenceId, tuple[int, ...]] = {
                seq: table for seq, table in engine.live_block_tables().items()}
            return (BlockTableSnapshot(
                group_id=GROUP_ID,
                num_blocks=pool.num_blocks,
                free=free,
                cached=cached,
                ref_counts=tuple([m.ref_count for m in metas]),
                block_hashes=tuple([m.block_hash for m in metas]),
                index=index,
                sequences=sequences,
                generations=tuple([m.generation for m in metas]),
                double_frees=pool.release_errors,
            ),)
