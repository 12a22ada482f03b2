"""The reference engine for hybrid models: one pool and block table per cache group.

Like vLLM's ``kv_cache_groups``: group 0 holds the full-attention layers (every position),
group 1 the sliding-window layers (``hybrid``: only the blocks covering the last
``window - 1`` positions) or the conv layers' recurrent state (``recurrent``: one state per
block boundary; block ``i`` = the state after token ``(i + 1) * block_size - 1``). Each
group has its own :class:`BlockPool`, chained-hash index and LRU; block 0 of group 1 is its
**null block**: it pads every block-table position the group holds nothing for, is never
written and never handed out.

A hit is the **hybrid intersection**: the longest run of prompt blocks the full group has
such that group 1 also has every block :func:`sidecar.checks.group_coverage.required_blocks` names
for
it (the window, or the last boundary's state). As a sequence advances, blocks that fell out
of group 1's coverage are released (still indexed, evictable) and replaced by the null block
in its table. The request loop (lookup, allocate, prefill, decode, release) is the one both
engines share (:class:`~kvtestbed.engines.scheduler.BatchScheduler`) and the event stream is
the plain engine's (:mod:`.engine`); faults hook it through the hybrid
hooks of :class:`~kvtestbed.engines.faults.Fault`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import torch

from kvtestbed.engines.config import EngineConfig
from kvtestbed.engines.faults import Fault, make_fault
from kvtestbed.engines.hybrid_model import CONV, FULL, SLIDING, HybridLM
from kvtestbed.engines.hybrid_tables import NULL_BLOCK, GroupTables
from kvtestbed.engines.hybrid_truth import HybridTruth
from kvtestbed.engines.pool import Allocation, BlockHash, BlockPool, KeyFields
from kvtestbed.engines.scheduler import BatchScheduler
from kvtestbed.engines.sequence import Request, Result, RunningSequence
from sidecar.core.protocol import CacheGroup, EventSink, GroupKind, Hit, Lookup, StoredBlock

__all__ = ["NULL_BLOCK", "HybridEngine", "build_engine"]


class HybridEngine(BatchScheduler, GroupTables):
    """Paged prefix-caching engine over a :class:`HybridLM` with per-group pools. The same
    public surface as :class:`~kvtestbed.engines.engine.ReferenceEngine`
    (submit/step/run/serve, ``lock``, ``stats``, ``fault``, ``truth``)."""

    def __init__(self, config: EngineConfig, sink: EventSink | None = None,
                 fault: Fault | None = None) -> None:
        c = self.config = config
        if c.kv_storage is not None or c.cpu_offload_blocks or c.kv_digest:
            raise ValueError("the hybrid engine keeps KV in the model dtype, with no CPU tier "
                             "and no write-time digest: leave kv_storage, cpu_offload_blocks "
                             "and kv_digest at their defaults")
        if c.num_blocks < 2 or c.block_size < 1:
            raise ValueError("the hybrid engine needs num_blocks >= 2 (one is the null block)")
        self.sink = sink
        if c.torch_threads is not None:
            torch.set_num_threads(c.torch_threads)
        self.model = HybridLM(c.model_kind, c.model, c.sliding_window)
        shape = self.model.shape
        mc = c.model
        self.block_size = bs = c.block_size
        full = CacheGroup(0, GroupKind.FULL_ATTENTION, shape.layers(FULL), name="full")
        if c.model_kind == "hybrid":
            other = CacheGroup(1, GroupKind.SLIDING_WINDOW, shape.layers(SLIDING),
                               sliding_window=c.sliding_window, name="sliding",
                               null_block_ids=frozenset({NULL_BLOCK}))
            other_pool = BlockPool(c.num_blocks, bs, len(other.layers), mc.num_kv_heads,
                                   mc.head_dim, mc.torch_dtype)
        else:
            other = CacheGroup(1, GroupKind.RECURRENT_STATE, shape.layers(CONV),
                               name="recurrent", null_block_ids=frozenset({NULL_BLOCK}))
            # One state per block: the pool's "heads x slots" page is (channels, conv_L).
            channels, width = shape.state_shape
            other_pool = BlockPool(c.num_blocks, width, len(other.layers), channels, 1,
                                   mc.torch_dtype)
        other_pool.reserve(NULL_BLOCK)
        self.groups: tuple[CacheGroup, ...] = (full, other)
        self.pools: dict[int, BlockPool] = {
            0: BlockPool(c.num_blocks, bs, len(full.layers), mc.num_kv_heads, mc.head_dim,
                         mc.torch_dtype),
            1: other_pool}
        self.pool = self.pools[0]  # what plain faults and allocator signals see
        kinds = frozenset(g.kind.value for g in self.groups)
        self.fault = fault or make_fault(c.fault, seed=c.fault_seed,
                                         start_after=c.fault_start_after,
                                         probability=c.fault_probability, **c.fault_params)
        if not self.fault.applies_to(kinds):
            raise ValueError(f"fault {self.fault.name!r} does not apply to model "
                             f"{c.model_kind!r} (groups {', '.join(sorted(kinds))})")
        self.truth = HybridTruth(self) if c.track_truth else None
        self.lock = threading.RLock()
        self._waiting: deque[tuple[int, Request, float]] = deque()
        self._running: list[RunningSequence] = []
        self._state: dict[int, dict[int, torch.Tensor]] = {}  # live recurrent state per seq
        self._pending_free: list[tuple[int, int]] = []  # (group, block) left the index
        self._next_index = 0
        self._head_blocked = False
        self.sink_errors: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        # per group name: hits it served, real blocks and null blocks in those hits
        self.group_stats: dict[str, Counter[str]] = {g.label: Counter() for g in self.groups}

    # ------------------------------------------------------------------ public API
    def live_block_tables(self, group_id: int = 0) -> dict[int, tuple[int, ...]]:
        with self.lock:
            return {s.seq_id: tuple(s.block_table[group_id]) for s in self._running}

    def slot_usage(self) -> tuple[int, int]:
        with self.lock:
            allocated = sum(len(s.blocks) for s in self._running) * self.block_size
            filled = sum(s.num_computed for s in self._running)
        return allocated, filled

    def _admissible(self, request: Request) -> bool:
        """Whether the request could ever run (an empty pool, less its null block)."""
        tokens, blocks = self._span(request)
        return (bool(request.tokens) and request.max_new_tokens >= 1
                and blocks <= self.config.num_blocks - 1
                and tokens <= self.config.model.max_positions)

    def _admit(self, index: int, request: Request,
               submitted: float) -> RunningSequence | None:
        bs = self.block_size
        prompt = list(request.tokens)
        _, needed = self._span(request)
        key_fields = self.key_fields(request)
        hashes: list[BlockHash] = []
        self._chain(index, prompt, key_fields, (len(prompt) - 1) // bs, hashes)
        evicted: list[tuple[int, int]] = []
        with self.lock:
            n_hit, other_hit = self._intersect(hashes)
            hit_tables = {0: self.pools[0].lookup(hashes)[:n_hit], 1: other_hit}
            allocs: dict[int, Allocation] = {}
            for g, pool in self.pools.items():
                real = [b for b in hit_tables[g] if g == 0 or b != NULL_BLOCK]
                alloc = pool.allocate(needed - n_hit, holder=index, reserve=real)
                evicted.extend((g, b) for b in alloc.evicted)
                if not alloc.ok:
                    for done_g, done in allocs.items():  # undo the groups already served
                        self.pools[done_g].release(
                            [*done.block_ids, *(b for b in hit_tables[done_g]
                                                if done_g == 0 or b != NULL_BLOCK)], index)
                    allocs.clear()
                    break
                allocs[g] = alloc
            if allocs:
                seq = RunningSequence(index, request, key_fields, prompt,
                                      {g: [*hit_tables[g], *allocs[g].block_ids]
                                       for g in self.pools},
                                      hashes[:n_hit], submitted, hit_tokens=n_hit * bs,
                                      num_cached_blocks=n_hit)
                if self.truth is not None:
                    for g, a in allocs.items():
                        self.truth.allocated(g, index, a.block_ids)
                self._running.append(seq)
                if n_hit:
                    self.fault.on_hybrid_hit(self, seq, n_hit)
                evicted.extend(self._pending_free)
                self._pending_free.clear()
                hit = self._hit(seq, prompt, key_fields) if n_hit else None
                if hit is not None and self.truth is not None:
                    self.truth.admitted(seq, hit)
                if self.groups[1].kind is GroupKind.RECURRENT_STATE and n_hit:
                    self._state[index] = self._read_state(seq.block_table[1][n_hit - 1])
        for g, b in evicted:
            self._emit("on_free", g, (b,))
        if not allocs:
            return None
        for g, a in allocs.items():
            self._emit("on_allocate", g, index, a.block_ids,
                       tuple(self.pools[g].blocks[b].generation for b in a.block_ids))
        self.stats["admitted"] += 1
        self.stats["query_tokens"] += len(prompt)
        self._count_hits(index, seq.hit_tokens)
        self._emit("on_lookup", Lookup(len(prompt), seq.hit_tokens, hit, seq_id=index))
        return seq

    def _hit(self, seq: RunningSequence, prompt: list[int], key_fields: KeyFields) -> Hit:
        n = seq.num_cached_blocks
        blocks = {g: tuple(seq.block_table[g][:n]) for g in self.pools}
        gens = {g: tuple(self.pools[g].blocks[b].generation for b in ids)
                for g, ids in blocks.items()}
        for g, ids in blocks.items():
            group = self.groups[g]
            nulls = sum(1 for b in ids if g and b in group.null_block_ids)
            counts = self.group_stats[group.label]
            counts["hits"] += 1 if len(ids) > nulls else 0
            counts["blocks"] += len(ids) - nulls
            counts["null_blocks"] += nulls
        return Hit(tokens=tuple(prompt), hit_tokens=seq.hit_tokens, blocks=blocks,
                   generations=gens, key_fields=dict(key_fields))

    def _forward(self, seq: RunningSequence, tokens: Sequence[int], start: int) -> int:
        """Run ``tokens`` at ``start`` over the past the pools hold; write, store, trim."""
        bs = self.block_size
        kv = self._gather(seq, start) if start else None
        recurrent = self.groups[1].kind is GroupKind.RECURRENT_STATE
        end = start + len(tokens)
        boundaries = [p for p in range((start // bs + 1) * bs, end + 1, bs)] if recurrent else []
        out = self.model.forward(tokens, seq.adapter, start, kv, self._state.get(seq.seq_id),
                                 boundaries)
        with self.lock:
            for g, group in enumerate(self.groups):
                if group.kind is GroupKind.RECURRENT_STATE:
                    continue
                keys = torch.stack([out.kv[i][0] for i in group.layers])
                values = torch.stack([out.kv[i][1] for i in group.layers])
                self.pools[g].write(seq.block_table[g], start, keys, values,
                                    skip=frozenset({NULL_BLOCK}) if g else frozenset())
                if self.truth is not None:
                    self.truth.written(g, seq, start, keys, values)
            if recurrent:
                self._state[seq.seq_id] = out.state
                for pos in boundaries:
                    self._store_state(seq, pos // bs - 1, out.boundary_states[pos])
        seq.num_computed = end
        self._store_full_blocks(seq)
        self._trim(seq)
        return out.next_token

    def _prefill(self, seq: RunningSequence) -> None:
        token = self._forward(seq, seq.tokens[seq.hit_tokens:], seq.hit_tokens)
        seq.output.append(token)
        seq.tokens.append(token)

    def _decode(self, seq: RunningSequence) -> None:
        token = self._forward(seq, [seq.output[-1]], seq.num_computed)
        seq.output.append(token)
        seq.tokens.append(token)

    def _gather(self, seq: RunningSequence, num_tokens: int) -> dict[int, tuple[torch.Tensor,
                                                                              torch.Tensor]]:
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with self.lock:
            if self.truth is not None:
                self.truth.gathered(seq, num_tokens)
            for g, group in enumerate(self.groups):
                if group.kind is GroupKind.RECURRENT_STATE:
                    continue
                keys, values = self.pools[g].gather(seq.block_table[g], num_tokens)
                for j, layer in enumerate(group.layers):
                    kv[layer] = (keys[j], values[j])
        return kv

    def _store_full_blocks(self, seq: RunningSequence) -> None:
        bs = self.block_size
        full = seq.num_computed // bs
        if full <= seq.num_cached_blocks:
            return
        self._chain(seq.seq_id, seq.tokens, seq.key_fields, full, seq.block_hashes)
        key_dict = dict(seq.key_fields)
        for i in range(seq.num_cached_blocks, full):
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            for g in self.pools:
                table = seq.block_table[g]
                b = table[i]
                if g and b == NULL_BLOCK:
                    continue
                with self.lock:
                    self.fault.on_group_block_full(self, seq, g, b)
                    if self.truth is not None:
                        self.truth.filled(g, seq, i, b)
                    if not self.pools[g].cache(b, seq.block_hashes[i], tokens,
                                               seq.key_fields, i * bs):
                        continue
                    generation = self.pools[g].blocks[b].generation
                parent = table[i - 1] if i else None
                self._emit("on_store", StoredBlock(
                    group_id=g, block_id=b, generation=generation, tokens=tokens,
                    prefix_tokens=i * bs, key_fields=key_dict,
                    parent_block_id=None if parent in (None, NULL_BLOCK) and g else parent,
                    seq_id=seq.seq_id, write_path=seq.write_path(i, bs)))
        seq.num_cached_blocks = full

    def _finish(self, seq: RunningSequence) -> Result:
        with self.lock:
            released: dict[int, tuple[int, ...]] = {}
            for g, pool in self.pools.items():
                real = [b for b in seq.block_table[g] if g == 0 or b != NULL_BLOCK]
                pool.release(real, seq.seq_id)
                released[g] = tuple(dict.fromkeys(real))
            self._running.remove(seq)
            self._state.pop(seq.seq_id, None)
            self._head_blocked = False
            if self.truth is not None:
                self.truth.finished(seq.seq_id)
        for g, ids in released.items():
            if ids:
                self._emit("on_release", g, seq.seq_id, ids)
        latency = time.perf_counter() - seq.submitted
        self.stats["finished"] += 1
        self._emit("on_request_done", latency)
        return Result(seq.seq_id, seq.request, tuple(seq.output), seq.prompt_len,
                      seq.hit_tokens, latency)


def build_engine(config: EngineConfig, sink: EventSink | None = None) -> Any:
    """The engine for ``config.model_kind``: :class:`ReferenceEngine` for the plain model,
    :class:`HybridEngine` for ``hybrid`` and ``recurrent``."""
    if config.model_kind == "reference":
        from kvtestbed.engines.engine import ReferenceEngine
        return ReferenceEngine(config, sink)
    return HybridEngine(config, sink)
