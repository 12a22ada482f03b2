"""Adapter for the reference engine's hybrid models (:mod:`.hybrid_engine`).

Describes both cache groups as the contract has them (kind, layers, sliding window, the
null block), reads each group's blocks out of its own pool, and recomputes each group from
the HF model from scratch, never through the cache: attention K/V of the positions a block
covers for the full and sliding groups, and for the recurrent group the conv state a fresh
prefill reaches at the block's boundary (``BlockKV.key`` = ``(layers, channels, conv_L)``,
``value`` empty). A read of a null block raises nothing: it returns what the null block
holds (zeros), and the sidecar decides what a null block at that position means.

What the protocol now gives it (issue 20), so it needs no workaround: ``capture`` and
``block_tables`` are declared capabilities (:mod:`sidecar.core.capabilities`), checked when
the Monitor attaches; block-table snapshots are confirmed on a second one; ``Hit.tier_states``
lists only blocks that came through a tier (absent or ``None`` = resident, no padding); a
missing recurrent state is a shorter block list (``missing_group_state``), a null id before
the last boundary is fine; tier loads are ``on_tier`` events of their own with a duration
(the recovery histogram), never a faked ``StoredBlock``; an engine that re-reports whole
tables can put :class:`sidecar.adapters.store_dedup.StoreDedup` before the Monitor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from kvtestbed.adapters.paged_adapter import recompute_end
from kvtestbed.engines.hybrid_engine import HybridEngine
from kvtestbed.engines.hybrid_model import HybridLM
from kvtestbed.engines.model import ModelConfig
from kvtestbed.engines.sequence import KEY_FIELD_NAMES
from sidecar.core.protocol import (
    AdapterError,
    AllocatorState,
    BlockKV,
    BlockRef,
    BlockTableSnapshot,
    EngineInfo,
    GroupKind,
    Hit,
    SequenceId,
)


class HybridReferenceAdapter:
    """Implements :class:`sidecar.core.protocol.Adapter` and
    :class:`sidecar.core.protocol.AllocatorIntrospection` for a :class:`HybridEngine`."""

    # The recompute runs through the engine's own model object (``engine.model.forward``),
    # never through the cache, but an error in that model is shared (REFERENCE_KINDS).
    reference_kind = "engine"

    def __init__(self, engine: HybridEngine) -> None:
        self.engine = engine
        mc = engine.config.model
        self._info = EngineInfo(
            engine="reference", model=mc.name, revision=mc.revision, dtype=mc.dtype,
            block_size=engine.block_size, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            groups=engine.groups, key_fields=KEY_FIELD_NAMES)

    def describe(self) -> EngineInfo:
        return self._info

    def _recurrent(self, group_id: int) -> bool:
        return self.engine.groups[group_id].kind is GroupKind.RECURRENT_STATE

    def _check(self, ref: BlockRef) -> None:
        if ref.group_id not in self.engine.pools:
            raise AdapterError(f"reference engine has no cache group {ref.group_id}")
        if not 0 <= ref.block_id < self.engine.pools[ref.group_id].num_blocks:
            raise AdapterError(f"block id {ref.block_id} outside group {ref.group_id}'s pool")

    def _copy(self, ref: BlockRef) -> BlockKV:
        pool = self.engine.pools[ref.group_id]
        if self._recurrent(ref.group_id):
            key = pool.key[:, ref.block_id, :, :, 0].clone()
            value = torch.empty(0, dtype=key.dtype)
        else:
            key, value = pool.read_block(ref.block_id)
        return BlockKV(ref, key, value, generation=pool.blocks[ref.block_id].generation)

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """Copies of the blocks as each group's pool holds them now (under the lock)."""
        out: list[BlockKV] = []
        for ref in refs:
            self._check(ref)
            with self.engine.lock:
                out.append(self._copy(ref))
        return out

    def capture(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """The blocks as the request is served them (called inside ``on_lookup``)."""
        with self.engine.lock:
            for ref in refs:
                self._check(ref)
            return [self._copy(ref) for ref in refs]

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """One fresh forward of ``hit.tokens`` up to the last ref's block end, cut at the
        recurrent refs' boundaries (a chunked fresh prefill reaches the same state as one
        pass: measured bit-exact), with the hit's own adapter."""
        for ref in refs:
            self._check(ref)
        return recompute_hybrid(self.engine.model, self._info, hit, refs)

    def remote_reference(self) -> Callable[[], HybridModelReference]:
        """Optional capability (``dispatch = "process"``): the sidecar process builds the
        same seeded model and recomputes with it."""
        c = self.engine.config
        return functools.partial(HybridModelReference, c.model_kind, c.model,
                                 c.sliding_window, self._info)

    def allocator(self) -> AllocatorState:
        """The full-attention group's pool (every group is allocated alike)."""
        engine = self.engine
        pool = engine.pools[0]
        with engine.lock:
            allocated, filled = engine.slot_usage()
            tables = engine.live_block_tables(0)
            return AllocatorState(
                total_blocks=pool.num_blocks, free_blocks=pool.num_free,
                cached_blocks=pool.num_cached, used_blocks=pool.num_used,
                largest_free_run=pool.largest_usable_run(), allocations=pool.allocations,
                allocation_failures=pool.allocation_failures, allocated_slots=allocated,
                filled_slots=filled, live_sequences=len(tables),
                held_blocks=len({b for t in tables.values() for b in t}),
                hit_tokens=engine.hit_metric)

    def block_tables(self) -> tuple[BlockTableSnapshot, ...]:
        """Each group's pool lists, per-block state, index and the live block tables (null
        entries left out: the null block is reserved), in one hold of the engine's lock."""
        engine = self.engine
        out = []
        with engine.lock:
            for g, pool in engine.pools.items():
                free, cached, index = pool.lists()
                metas = pool.blocks
                null = engine.groups[g].null_block_ids
                sequences: dict[SequenceId, tuple[int, ...]] = {
                    seq: tuple(b for b in table if b not in null)
                    for seq, table in engine.live_block_tables(g).items()}
                out.append(BlockTableSnapshot(
                    group_id=g, num_blocks=pool.num_blocks, free=free, cached=cached,
                    ref_counts=tuple([m.ref_count for m in metas]),
                    block_hashes=tuple([m.block_hash for m in metas]), index=index,
                    sequences=sequences, generations=tuple([m.generation for m in metas]),
                    double_frees=pool.release_errors, reserved=tuple(sorted(null))))
        return tuple(out)


def recompute_hybrid(model: HybridLM, info: EngineInfo, hit: Hit,
                     refs: Sequence[BlockRef]) -> list[BlockKV]:
    """The hybrid engines' recompute on ``model`` (see :meth:`HybridReferenceAdapter.
    recompute`): attention blocks' K/V, a recurrent block's state after its last token."""
    if not refs:
        return []
    bs = info.block_size
    groups = {g.group_id: g for g in info.groups}
    recurrent = {g for g, c in groups.items() if c.kind is GroupKind.RECURRENT_STATE}
    end = recompute_end(info, hit, refs)
    boundaries = sorted({ref.token_range(bs)[1] for ref in refs if ref.group_id in recurrent})
    out = model.forward(list(hit.tokens[:end]), hit.key_fields.get("adapter", ""),
                        boundaries=boundaries)
    blocks: list[BlockKV] = []
    for ref in refs:
        layers = groups[ref.group_id].layers
        if ref.group_id in recurrent:
            state = out.boundary_states[ref.token_range(bs)[1]]
            key = torch.stack([state[i] for i in layers])
            blocks.append(BlockKV(ref, key, torch.empty(0, dtype=key.dtype)))
            continue
        start, stop = ref.token_range(bs)
        blocks.append(BlockKV(
            ref, torch.stack([out.kv[i][0][:, start:stop] for i in layers]),
            torch.stack([out.kv[i][1][:, start:stop] for i in layers])))
    return blocks


class HybridModelReference:
    """The hybrid engines' recompute in another process (``dispatch = "process"``): the
    model built again from its kind, config and seed."""

    reference_kind = "engine"  # the engine's own model code, weights and kernels

    def __init__(self, kind: str, model: ModelConfig, sliding_window: int,
                 info: EngineInfo) -> None:
        self.model = HybridLM(kind, model, sliding_window)
        self.info = info

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return recompute_hybrid(self.model, self.info, hit, refs)


def make_adapter(engine: object) -> object:
    """The adapter for a reference engine of any model: :class:`ReferenceAdapter` for the
    plain one, :class:`HybridReferenceAdapter` for a :class:`HybridEngine`."""
    from kvtestbed.adapters.paged_adapter import ReferenceAdapter
    from kvtestbed.engines.engine import ReferenceEngine
    if isinstance(engine, ReferenceEngine):
        return ReferenceAdapter(engine)
    if isinstance(engine, HybridEngine):
        return HybridReferenceAdapter(engine)
    raise TypeError(f"not a reference engine: {type(engine).__name__}")
