"""The reference paged prefix-caching engine: a small, real cache manager the sidecar watches.

One request goes through the steps a production engine's cache manager takes:

1. **lookup**: the prompt's full blocks are hashed (chained, with the key fields) and the
   longest run found in the index is the hit. The last prompt token is never covered, so the
   prefill always has at least one token to run and the first output has logits (as vLLM).
2. **allocate**: the hit blocks are referenced and fresh blocks reserved for the rest of the
   prompt and every generated token (no preemption: a running sequence never fails
   mid-decode). When the pool cannot satisfy it, the request waits while other sequences
   run and is rejected (counted) when nothing running could free space.
3. **prefill**: the hit's KV is gathered *from the pool* as the attention past and only the
   remaining prompt tokens run, so what the cache holds is what the model decodes over.
4. **decode**: greedy, one token per step, each step attending over KV gathered from the
   pool; every block that becomes full (prompt or generated tokens) is hashed, indexed and
   reported.
5. **release**: references dropped; full indexed blocks become evictable (LRU), partial ones
   free.

Observability is an optional collaborator (an :class:`~sidecar.core.protocol.EventSink`); no
exception from it ever reaches the engine. Faults (:mod:`.faults`) hook the same steps.
Cache groups: one full-attention group (id 0) today, but block tables, events and hits are
keyed by group id so hybrid groups slot in without a redesign.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from kvtestbed.engines.config import DigestFn, EngineConfig
from kvtestbed.engines.faults import Fault, make_fault
from kvtestbed.engines.model import SequenceKV, TinyLlama
from kvtestbed.engines.pool import BlockHash, BlockPool
from kvtestbed.engines.scheduler import BatchScheduler
from kvtestbed.engines.sequence import (
    GROUP_ID,
    KEY_FIELD_NAMES,
    Request,
    Result,
    RunningSequence,
)
from kvtestbed.engines.tier import CpuTier, Load, TierEntry, finish, hit_tier_states
from kvtestbed.engines.truth import GroundTruth
from sidecar.core.device import resolve_device
from sidecar.core.protocol import EventSink, Hit, Lookup, StoredBlock, TierState

# Re-exported: callers (the adapter, the demo, the benchmark, tests) import these from here.
__all__ = ["GROUP_ID", "KEY_FIELD_NAMES", "DigestFn", "EngineConfig", "ReferenceEngine",
           "Request", "Result", "RunningSequence"]


LOAD_TIMEOUT_S = 30.0  # a tier load not done by then is given up and recomputed


def _with_fault_needs(config: EngineConfig, fault: Fault) -> EngineConfig:
    """A fault that needs a CPU tier or quantised storage (``Fault.engine_needs``) turns
    it on where the config left that setting at its default: ``--fault failed-load-as-hit``
    alone must give a fault that can act."""
    default = EngineConfig()
    changes = {k: v for k, v in fault.engine_needs.items()
               if getattr(config, k) == getattr(default, k)}
    return replace(config, **changes) if changes else config


class ReferenceEngine(BatchScheduler):
    """Paged prefix-caching engine over :class:`TinyLlama` with optional fault injection.

    ``lock`` serialises pool mutation and KV copies between the engine thread and readers
    (the sidecar adapter); it is held for bookkeeping and copies only, never for a forward.
    """

    def __init__(self, config: EngineConfig | None = None, sink: EventSink | None = None,
                 fault: Fault | None = None, digest: DigestFn | None = None) -> None:
        c = config or EngineConfig()
        self.fault = fault or make_fault(c.fault, seed=c.fault_seed,
                                         start_after=c.fault_start_after,
                                         probability=c.fault_probability, **c.fault_params)
        if not self.fault.applies_to(frozenset({"full_attention"})):
            raise ValueError(f"fault {self.fault.name!r} needs a hybrid model's cache groups "
                             f"({', '.join(sorted(self.fault.needs_groups))})")
        self.config = c = _with_fault_needs(c, self.fault)
        self.sink = sink
        if c.torch_threads is not None:
            torch.set_num_threads(c.torch_threads)
        self.device = resolve_device(c.device)
        self.model = TinyLlama(c.model, device=self.device)
        self.block_size = c.block_size
        self.pool = BlockPool(c.num_blocks, c.block_size, c.model.num_layers,
                              c.model.num_kv_heads, c.model.head_dim, c.model.torch_dtype,
                              kv_storage=c.kv_storage, device=self.device)
        self.tier = CpuTier(c.cpu_offload_blocks) if c.cpu_offload_blocks > 0 else None
        self._digests: dict[int, str | None] = {}  # write-time digests, kept for the tier
        self._tier_keys: dict[int, BlockHash] = {}  # block -> its tier key, where it differs
        self._unawaited: dict[int, list[Load]] = {}  # seq -> loads served while in flight
        if self.tier is not None:
            self.pool.on_evict = self._spill
        self.truth = GroundTruth(self.pool, KEY_FIELD_NAMES) if c.track_truth else None
        # The write-time digest of a block id (the sidecar's fingerprint; bench perf counts
        # it as the sidecar's cost): ``digest`` over the block read back, else the pool's own.
        self._digest: Callable[[int], str] | None = (
            self.pool.digester(digest) if digest is not None or c.kv_digest else None)
        self.lock = threading.RLock()
        self._waiting: deque[tuple[int, Request, float]] = deque()
        self._running: list[RunningSequence] = []
        self._next_index = 0
        self._head_blocked = False  # the waiting head failed; retry after a release
        self.sink_errors: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ public API
    @property
    def live_sequences(self) -> tuple[int, ...]:
        """Holder ids of the live sequences (for the pool's leak invariant)."""
        return tuple(s.seq_id for s in self._running)

    def live_block_tables(self) -> dict[int, tuple[int, ...]]:
        """Each live sequence's block table (group 0): the holders the sidecar's allocator
        invariants count (kvtestbed.adapters.paged_adapter)."""
        with self.lock:
            return {s.seq_id: tuple(s.blocks) for s in self._running}

    def slot_usage(self) -> tuple[int, int]:
        """(token slots in blocks held by live sequences, slots holding KV): what internal
        fragmentation is made of. Admission reserves a request's whole span, so the gap
        includes the slots its remaining decode steps will fill."""
        with self.lock:
            allocated = sum(len(s.blocks) for s in self._running) * self.block_size
            filled = sum(s.num_computed for s in self._running)
        return allocated, filled

    def _admissible(self, request: Request) -> bool:
        """Whether the request could ever run (an empty pool would fit it)."""
        tokens, blocks = self._span(request)
        return (bool(request.tokens) and request.max_new_tokens >= 1
                and blocks <= self.pool.num_blocks
                and tokens <= self.config.model.max_positions)

    def _admit(self, index: int, request: Request,
               submitted: float) -> RunningSequence | None:
        """Lookup and allocation; ``None`` when the pool cannot hold the request now."""
        bs = self.block_size
        prompt = list(request.tokens)
        _, needed = self._span(request)
        key_fields = self.key_fields(request)
        hashes: list[BlockHash] = []
        self._chain(index, prompt, key_fields, (len(prompt) - 1) // bs, hashes)
        loaded: list[tuple[int, TierEntry, TierState]] = []
        with self.lock:
            hit_ids = self.pool.lookup(hashes)
            tier_keys = self._tier_chain(index, prompt, key_fields, hashes)
            offloaded = (self.tier.match(GROUP_ID, tier_keys[len(hit_ids):]) if self.tier
                         else [])
            if not getattr(self.sink, "hits_allowed", True):  # a circuit breaker is open
                hit_ids, offloaded = [], []  # (sidecar.protect.actions): every lookup is a miss
            self.fault.before_allocate(self, index)
            alloc = self.pool.allocate(needed - len(hit_ids), holder=index, reserve=hit_ids)
            if alloc.ok:
                if self.truth is not None:
                    self.truth.allocated(index, alloc.block_ids)
                loaded = self._load(index, offloaded, alloc.block_ids,
                                    hashes[len(hit_ids):], tier_keys[len(hit_ids):])
                hit_ids = [*hit_ids, *(b for b, _, _ in loaded)]
                generations = [self.pool.blocks[b].generation for b in hit_ids]
                seq = RunningSequence(index, request, key_fields, prompt,
                                      {GROUP_ID: [*hit_ids, *alloc.block_ids[len(loaded):]]},
                                      hashes[:len(hit_ids)], submitted,
                                      hit_tokens=len(hit_ids) * bs,
                                      num_cached_blocks=len(hit_ids))
                self._running.append(seq)
                self.fault.on_hit(self, seq, hit_ids)
                self.fault.on_allocate(self, seq, alloc.block_ids[len(loaded):])
        self._emit_tier_events()
        if alloc.evicted:
            self._emit("on_free", GROUP_ID, alloc.evicted)
        if not alloc.ok:
            return None
        self.stats["admitted"] += 1
        self.stats["query_tokens"] += len(prompt)
        self._count_hits(index, seq.hit_tokens)
        if self.sink is None:  # detached: no hook arguments built (bench perf's baseline)
            return seq
        self._emit("on_allocate", GROUP_ID, index, alloc.block_ids,
                   tuple(self.pool.blocks[b].generation for b in alloc.block_ids))
        for b, entry, _ in loaded:  # reported like any stored block, with its original digest
            i = entry.prefix_tokens // bs
            self._emit("on_store", StoredBlock(
                group_id=GROUP_ID, block_id=b, generation=generations[i], tokens=entry.tokens,
                prefix_tokens=entry.prefix_tokens, key_fields=dict(entry.key_fields),
                parent_block_id=seq.blocks[i - 1] if i else None, kv_digest=entry.kv_digest,
                seq_id=index))
        hit = None
        if hit_ids:
            hit = Hit(tokens=tuple(prompt), hit_tokens=seq.hit_tokens,
                      blocks={GROUP_ID: tuple(hit_ids)},
                      generations={GROUP_ID: tuple(generations)},
                      key_fields=dict(key_fields),
                      tier_states=hit_tier_states(GROUP_ID, len(hit_ids),
                                                  [state for _, _, state in loaded]))
        self._emit("on_lookup", Lookup(len(prompt), seq.hit_tokens, hit, seq_id=index))
        return seq

    def _prefill(self, seq: RunningSequence) -> None:
        past = self._gather(seq, seq.hit_tokens) if seq.hit_tokens else None
        out = self.model.forward(seq.tokens[seq.hit_tokens:], seq.adapter, past)
        self._settle_unawaited(seq.seq_id)
        self._write(seq, seq.hit_tokens, out.kv)
        seq.num_computed = seq.prompt_len
        self._store_full_blocks(seq)
        seq.append(out.next_token)

    def _decode(self, seq: RunningSequence) -> None:
        past = self._gather(seq, seq.num_computed)
        out = self.model.forward([seq.output[-1]], seq.adapter, past)
        self._write(seq, seq.num_computed, out.kv)
        seq.num_computed += 1
        self._store_full_blocks(seq)
        seq.append(out.next_token)

    def _finish(self, seq: RunningSequence) -> Result:
        with self.lock:
            # References held before the release, to report the blocks it really freed
            # (a leaking release frees none).
            held = {b: self.pool.blocks[b].holders[seq.seq_id] for b in seq.blocks}
            left_index = self.fault.release(self, seq)
            if left_index is None:
                self.pool.release(seq.blocks, seq.seq_id)
                left_index = []
            released = tuple(b for b, n in held.items()
                             if self.pool.blocks[b].holders[seq.seq_id] < n)
            self._running.remove(seq)
            self._head_blocked = False
            if self.truth is not None:
                self.truth.finished(seq.seq_id)
        if released:
            self._emit("on_release", GROUP_ID, seq.seq_id, released)
        if left_index:
            self._emit("on_free", GROUP_ID, tuple(left_index))
        latency = time.perf_counter() - seq.submitted
        self.stats["finished"] += 1
        self._emit("on_request_done", latency)
        return Result(seq.seq_id, seq.request, tuple(seq.output), seq.prompt_len,
                      seq.hit_tokens, latency)

    # ------------------------------------------------------------------ KV movement
    def _gather(self, seq: RunningSequence, num_tokens: int) -> SequenceKV:
        with self.lock:
            if self.truth is not None:
                self.truth.gathered(seq, num_tokens)
            keys, values = self.pool.gather(seq.blocks, num_tokens)
        return SequenceKV(keys, values)

    def _write(self, seq: RunningSequence, start: int, kv: SequenceKV) -> None:
        with self.lock:
            self.pool.write(seq.blocks, start, kv.keys, kv.values,
                            skip=frozenset(seq.skip_write))
            if self.truth is not None:
                self.truth.written(seq, start, kv.keys, kv.values)

    def _store_full_blocks(self, seq: RunningSequence) -> None:
        """Hash, index and report every block that became full since the last call."""
        bs = self.block_size
        full = seq.num_computed // bs
        if full <= seq.num_cached_blocks:
            return
        self._chain(seq.seq_id, seq.tokens, seq.key_fields, full, seq.block_hashes)
        tier_keys = (self._tier_chain(seq.seq_id, seq.tokens, seq.key_fields,
                                      seq.block_hashes) if self.tier is not None else [])
        key_dict = dict(seq.key_fields)
        for i in range(seq.num_cached_blocks, full):
            b = seq.blocks[i]
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            with self.lock:
                self.fault.on_block_full(self, seq, b)
                if self.truth is not None:
                    self.truth.filled(seq, i, b)
                if not self.pool.cache(b, seq.block_hashes[i], tokens, seq.key_fields, i * bs):
                    continue  # same hash already indexed: this copy stays private
                generation = self.pool.blocks[b].generation
                digest = self._digest(b) if self._digest else None
                if self.tier is not None:
                    self._digests[b] = digest
                    self._keep_tier_key(b, seq.block_hashes[i], tier_keys[i])
            if self.sink is not None:  # detached: no hook arguments built
                self._emit("on_store", StoredBlock(
                    group_id=GROUP_ID, block_id=b, generation=generation, tokens=tokens,
                    prefix_tokens=i * bs, key_fields=key_dict,
                    parent_block_id=seq.blocks[i - 1] if i else None, kv_digest=digest,
                    seq_id=seq.seq_id, write_path=seq.write_path(i, bs)))
            with self.lock:
                self.fault.on_block_stored(self, seq, b)
        seq.num_cached_blocks = full

    # ------------------------------------------------------------------ CPU offload tier
    def _keep_tier_key(self, block_id: int, block_hash: BlockHash, tier_key: BlockHash) -> None:
        """Remember the key a block spills under to the tier where it is not its hash."""
        if tier_key != block_hash:
            self._tier_keys[block_id] = tier_key
        else:
            self._tier_keys.pop(block_id, None)

    def _spill(self, block_id: int) -> None:
        """Pool eviction hook: copy the cached block out to the tier (under the lock; the
        block goes to a new owner right after, so this copy cannot be deferred)."""
        meta = self.pool.blocks[block_id]
        if self.tier is None or meta.block_hash is None:
            return
        extra = self.truth.spill(block_id) if self.truth is not None else None
        self.tier.put(TierEntry(meta.block_hash, self.pool.export_block(block_id),
                                meta.tokens, meta.key_fields, meta.prefix_tokens,
                                self._digests.pop(block_id, None), extra,
                                group_id=GROUP_ID, block_id=block_id,
                                tier_key=self._tier_keys.pop(block_id, None)))

    def _load(self, seq_id: int, entries: Sequence[TierEntry], fresh: Sequence[int],
              hashes: Sequence[BlockHash], tier_keys: Sequence[BlockHash],
              ) -> list[tuple[int, TierEntry, TierState]]:
        """Load offloaded blocks into the first fresh blocks (async, on the tier's worker),
        wait until each may be read, and keep the leading run the request may serve, with
        each one's tier state at that moment. A load that fails (or times out) ends the hit
        there: that block and the ones after it stay private and are recomputed. The
        faults' bugs: a load the fault fails is served all the same (failed-load-as-hit),
        a load may copy back only some layers, or be served before it completed. Each
        loaded block is indexed under the request's own hash (``hashes``): the engine takes
        what its tier key (``tier_keys``) found for the request's block."""
        tier = self.tier
        if tier is None or not entries:
            return []
        num_layers = int(self.pool.key.shape[0])
        loads: list[Load] = []
        for entry, b, h, key in zip(entries, fresh, hashes, tier_keys, strict=False):
            if not self.pool.cache(b, h, entry.tokens, entry.key_fields, entry.prefix_tokens):
                break
            self._keep_tier_key(b, h, key)
            loads.append(tier.load(
                entry, self.pool, b, layers=self.fault.load_layers(self, seq_id, b, num_layers),
                fails=self.fault.load_fails(self, seq_id, b),
                hold_after=self.fault.unawaited_layers(self, seq_id, b, num_layers)))
        ready = [load.wait(LOAD_TIMEOUT_S) for load in loads]  # every copy out of the way
        served: list[tuple[int, TierEntry, TierState]] = []
        for load, ok in zip(loads, ready, strict=True):
            state = load.entry.state
            if not ok or (state is TierState.FAILED and not load.fails) or state is None:
                break
            served.append((load.block_id, load.entry, state))
        for load in loads[len(served):]:  # recovered by recompute: private blocks again
            load.cancel()
            self.pool.uncache(load.block_id)
            self.stats["tier_loads_recomputed"] += 1
        for load in loads[:len(served)]:
            if load.hold_after is not None:
                self._unawaited.setdefault(seq_id, []).append(load)
            if self.truth is not None:
                self.truth.loaded(load.block_id, load.entry.extra)
            self._digests[load.block_id] = load.entry.kv_digest
        tier.loads += len(served)
        return served

    def _settle_unawaited(self, seq_id: int) -> None:
        """After the prefill used them: let loads served while in flight finish."""
        loads = self._unawaited.pop(seq_id, None)
        if loads:
            finish(loads, LOAD_TIMEOUT_S)
            self._emit_tier_events()

    def _emit_tier_events(self) -> None:
        """Report the tier's transitions (from any thread) on the engine's thread."""
        if self.tier is not None:
            for e in self.tier.drain_events():
                self._emit("on_tier", e.group_id, e.block_id, e.state, e.seconds)

    # ------------------------------------------------------------------ observability
    def evict(self, block_ids: Sequence[int]) -> list[int]:
        """Quarantine (sidecar.protect.actions): drop ``block_ids`` from the prefix index so later
        lookups miss them and recompute. A block a live sequence holds stays its own until
        released (then it goes to the free list, unindexed); an unreferenced one goes to
        the free list now. Reported like an eviction (``on_free``). The removed ids."""
        removed: list[int] = []
        with self.lock:
            for b in block_ids:
                if not 0 <= b < self.pool.num_blocks or not self.pool.uncache(b):
                    continue
                removed.append(b)
                self._digests.pop(b, None)
                self._tier_keys.pop(b, None)
                if self.pool.blocks[b].ref_count == 0:
                    self.pool.push_free(b)
        if removed:
            self._emit("on_free", GROUP_ID, tuple(removed))
        return removed
