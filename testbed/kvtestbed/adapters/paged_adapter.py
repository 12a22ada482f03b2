"""Adapter for the reference paged engine (:mod:`kvtestbed.engines`).

In-process placement: ``read`` copies blocks straight out of the engine's pool tensors and
``recompute`` runs the engine's own model from scratch (no cache) with the hit's key fields.
Both are called from the sidecar's worker thread while the engine runs in its own; the
engine's lock is held only for the copies and the allocator snapshot, never for a forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from kvtestbed.engines.blocks import chain_hash
from kvtestbed.engines.engine import GROUP_ID, KEY_FIELD_NAMES, ReferenceEngine
from kvtestbed.engines.model import ModelConfig, TinyLlama
from sidecar.core.capture_buffer import CaptureBuffer
from sidecar.core.protocol import (
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
    """Implements :class:`sidecar.core.protocol.Adapter` and
    :class:`sidecar.core.protocol.AllocatorIntrospection` for a :class:`ReferenceEngine`."""

    # The recompute runs through the engine's own model object (``engine.model.prefill``):
    # an error in that model is shared by cache and reference (REFERENCE_KINDS).
    reference_kind = "engine"

    def __init__(self, engine: ReferenceEngine, capture_slots: int | None = None) -> None:
        self.engine = engine
        # Match-time captures go to a bounded buffer on the pool's device (async on CUDA,
        # see sidecar.core.capture_buffer): by default on a device pool only; ``capture_slots``
        # sets its size (and turns it on for a CPU pool). Quantised pools keep read_block.
        self.capture_buffer = _capture_buffer(engine, capture_slots)
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
        if self.capture_buffer is not None:
            return self._capture_to_buffer(self.capture_buffer, refs)
        pool = self.engine.pool
        out: list[BlockKV] = []
        with self.engine.lock:
            for ref in refs:
                self._check(ref)
                key, value = pool.read_block(ref.block_id)
                out.append(BlockKV(ref, key, value, generation=pool.blocks[ref.block_id]
                                   .generation))
        return out

    def _capture_to_buffer(self, buffer: CaptureBuffer,
                           refs: Sequence[BlockRef]) -> list[BlockKV]:
        """The capture into buffer slots; none when the buffer is full (the sample is then
        verified from a later read, and the refusal counted in ``buffer.refused``)."""
        pool = self.engine.pool
        with self.engine.lock:
            for ref in refs:
                self._check(ref)
            copies = buffer.capture([(pool.key[:, r.block_id], pool.value[:, r.block_id])
                                     for r in refs])
            generations = [pool.blocks[r.block_id].generation for r in refs]
        if copies is None:
            return []
        return [BlockKV(ref, k, v, generation=g)
                for ref, (k, v), g in zip(refs, copies, generations, strict=True)]

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """KV of ``hit.tokens`` up to the end of the last ref's block, computed from
        scratch with the hit's own adapter: what the cache should have held."""
        for ref in refs:
            self._check(ref)
        return recompute_blocks(self.engine.model, self._info, hit, refs)

    def remote_reference(self) -> Callable[[], ModelReference]:
        """Optional capability (``dispatch = "process"``): the sidecar process builds the
        same seeded model (same weights, same kernels) and recomputes with it."""
        return functools.partial(ModelReference, self.engine.config.model, self._info)

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
                hit_tokens=engine.hit_metric,
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

    # ------------------------------------------------------------------ scrub and actions
    # Optional capabilities (sidecar.core.protocol.ScrubSource, Evictor; sidecar/checks/scrub.py and
    # sidecar/protect/actions.py), plus busy() for the scrub's load check.
    def scrub_hit(self, group_id: int, block_id: int) -> Hit | None:
        """A hit ending with ``block_id``, rebuilt from the pool's own index: each block's
        parent is the indexed block one block earlier whose chained hash, extended by this
        block's tokens and key fields, gives this block's hash. ``None`` when the block is
        not indexed, is held by a live sequence (being hit now), or a parent is gone."""
        if group_id != GROUP_ID:
            return None
        bs = self._info.block_size
        engine = self.engine
        with engine.lock:
            pool = engine.pool
            if not 0 <= block_id < pool.num_blocks:
                return None
            meta = pool.blocks[block_id]
            index = pool.lists()[2]
            if meta.block_hash is None or meta.ref_count > 0 \
                    or dict(index).get(meta.block_hash) != block_id:
                return None
            by_depth: dict[int, list[tuple[bytes, int]]] = {}
            for h, b in index:
                by_depth.setdefault(pool.blocks[b].prefix_tokens, []).append((h, b))
            chain = [block_id]
            cur = meta
            while cur.prefix_tokens > 0:
                parent = next((b for h, b in by_depth.get(cur.prefix_tokens - bs, ())
                               if chain_hash(h, cur.tokens, cur.key_fields) == cur.block_hash),
                              None)
                if parent is None:
                    return None
                chain.append(parent)
                cur = pool.blocks[parent]
            chain.reverse()
            tokens = tuple(t for b in chain for t in pool.blocks[b].tokens)
            generations = tuple(pool.blocks[b].generation for b in chain)
            key_fields = dict(meta.key_fields)
        return Hit(tokens=tokens, hit_tokens=len(tokens), blocks={GROUP_ID: tuple(chain)},
                   generations={GROUP_ID: generations}, key_fields=key_fields)

    def evict(self, group_id: int, block_ids: Sequence[int]) -> int:
        """Quarantine: the engine drops the blocks from its index (and reports them freed)."""
        if group_id != GROUP_ID:
            raise AdapterError(f"reference engine has no cache group {group_id}")
        return len(self.engine.evict([int(b) for b in block_ids]))

    def busy(self) -> bool:
        """A full batch of requests is waiting for a slot: the scrub stays out of the way."""
        stats = self.engine.stats
        waiting = stats["submitted"] - stats["admitted"] - stats["rejected"]
        return waiting >= self.engine.config.max_running



def recompute_blocks(model: TinyLlama, info: EngineInfo, hit: Hit,
                     refs: Sequence[BlockRef]) -> list[BlockKV]:
    """The recompute of the reference engines' paged adapters, on ``model``."""
    if not refs:
        return []
    bs = info.block_size
    end = recompute_end(info, hit, refs)
    kv = model.prefill(list(hit.tokens[:end]), hit.key_fields.get("adapter", ""))
    out: list[BlockKV] = []
    for ref in refs:
        start, stop = ref.token_range(bs)
        out.append(BlockKV(ref, kv.keys[:, :, start:stop].clone(),
                           kv.values[:, :, start:stop].clone()))
    return out


class ModelReference:
    """The reference engine's recompute in another process (``dispatch = "process"``): its
    model built again from the config and seed (on the CPU), nothing else of the engine."""

    reference_kind = "engine"  # the engine's own model code, weights and kernels

    def __init__(self, model: ModelConfig, info: EngineInfo) -> None:
        self.model = TinyLlama(model)
        self.info = info

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return recompute_blocks(self.model, self.info, hit, refs)


def recompute_end(info: EngineInfo, hit: Hit, refs: Sequence[BlockRef]) -> int:
    """The token a recompute of ``refs`` runs to (the last ref's block end), after checking
    the hit can be recomputed here: the loaded model revision, tokens up to that end."""
    revision = hit.key_fields.get("model_revision", info.revision)
    if revision != info.revision:
        raise AdapterError(f"model revision {revision!r} is not loaded "
                           f"(engine runs {info.revision!r})")
    end = max(ref.token_range(info.block_size)[1] for ref in refs)
    if end > len(hit.tokens):
        raise AdapterError(f"block ends at token {end} but the hit has "
                           f"{len(hit.tokens)} tokens")
    return end


DEVICE_CAPTURE_SLOTS = 64  # blocks in flight between capture and verdict on a device pool


def _capture_buffer(engine: ReferenceEngine, slots: int | None) -> CaptureBuffer | None:
    pool = engine.pool
    if pool.kv_storage is not None:
        return None
    if slots is None:
        if pool.key.device.type == "cpu":
            return None
        slots = DEVICE_CAPTURE_SLOTS
    shape = (pool.key.shape[0], *pool.key.shape[2:])  # (layers, kv_heads, block_size, dim)
    return CaptureBuffer(shape, pool.key.dtype, pool.key.device, slots)
