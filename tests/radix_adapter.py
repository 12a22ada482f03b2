"""kv-sidecar adapter for the radix engine, written against sidecar.protocol only.

A *block* is a block_size-aligned run of a path's token positions (tokens ``i*bs`` to
``(i+1)*bs`` of a prefix); its id is the slot holding its LAST token. Not the first: two
paths that part inside a block share its first slot but not its last, and a slot belongs
to one node at one position, so the last slot names the block's whole token prefix. The
run may span two nodes and its slots need not be contiguous: the adapter remembers each
id's slots (bounded: ids are slot indices). Only full blocks are stored; a hit's partial last block
is served but never verified. No generation stamps: the Monitor's epochs see evictions.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.checks.keys import prefix_digest
from sidecar.protocol import (
    AdapterError,
    AllocatorState,
    BlockKV,
    BlockRef,
    BlockTableSnapshot,
    CacheGroup,
    EngineInfo,
    EventSink,
    GroupKind,
    Hit,
    Lookup,
    StoredBlock,
)
from tests.radix_engine import RadixEngine, Running


class RadixAdapter:
    def __init__(self, engine: RadixEngine, sink: EventSink | None = None) -> None:
        self.engine, self.sink, self.bs = engine, sink, engine.block_size
        self.runs: dict[int, tuple[int, ...]] = {}  # block id -> its slots
        mc = engine.model.config
        self.info = EngineInfo("radix", mc.name, mc.revision, mc.dtype, self.bs,
                               mc.num_kv_heads, mc.head_dim,
                               (CacheGroup(0, GroupKind.FULL_ATTENTION,
                                           tuple(range(mc.num_layers)), name="full"),),
                               key_fields=("model_revision", "adapter"))
        engine.listener = self

    # -------------------------------------------- engine events -> sidecar events
    def matched(self, run: Running, matched: int) -> None:
        n, req, bs = matched // self.bs, run.request, self.bs
        hit = Hit(req.tokens, n * bs, {0: [run.matched[(i + 1) * bs - 1] for i in range(n)]},
                  key_fields=self._fields(run)) if matched else None
        if self.sink is not None:
            self.sink.on_lookup(Lookup(len(req.tokens), matched, hit, run.rid))

    def inserted(self, run: Running, slots: list[int], cached: int) -> None:
        tokens, fields = run.tokens, self._fields(run)
        for i in range(cached // self.bs, len(tokens) // self.bs):
            lo, hi = i * self.bs, (i + 1) * self.bs
            self.runs[slots[hi - 1]] = tuple(slots[lo:hi])
            if self.sink is not None:
                self.sink.on_store(StoredBlock(0, slots[hi - 1], 0, tokens[lo:hi], lo, fields,
                                               prefix_digest=prefix_digest(tokens[:lo],
                                                                           self.bs)))

    def evicted(self, slots: list[int], start: int) -> None:
        first, end = start // self.bs, len(slots) // self.bs  # full blocks ending in the leaf
        if self.sink is not None and end > first:
            self.sink.on_free(0, [slots[(i + 1) * self.bs - 1] for i in range(first, end)])

    def finished(self, latency_s: float) -> None:
        if self.sink is not None:
            self.sink.on_request_done(latency_s)

    def _fields(self, run: Running) -> dict[str, str]:  # the request's own, not the key's
        return {"model_revision": self.info.revision, "adapter": run.request.adapter}

    # -------------------------------------------- sidecar.protocol.Adapter
    def describe(self) -> EngineInfo:
        return self.info

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        out = []
        with self.engine.lock:
            for ref in refs:
                slots = self.runs.get(ref.block_id)
                if ref.group_id != 0 or slots is None:
                    raise AdapterError(f"no slot run is known for block {ref.block_id}")
                k, v = self.engine.pool_k[list(slots)], self.engine.pool_v[list(slots)]
                out.append(BlockKV(ref, k.permute(1, 2, 0, 3).contiguous(),
                                   v.permute(1, 2, 0, 3).contiguous()))
        return out

    capture = read  # called in on_lookup, before the prefill gathers the slots

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        end = max((r.index + 1) * self.bs for r in refs)
        if end > len(hit.tokens) or hit.key_fields.get("model_revision") != self.info.revision:
            raise AdapterError("hit too short, or its model revision is not loaded")
        kv = self.engine.model.prefill(list(hit.tokens[:end]), hit.key_fields.get("adapter", ""))
        return [BlockKV(r, kv.keys[:, :, r.index * self.bs:(r.index + 1) * self.bs].clone(),
                        kv.values[:, :, r.index * self.bs:(r.index + 1) * self.bs].clone())
                for r in refs]

    def allocator(self) -> AllocatorState:
        snap = self.block_tables()[0]
        used = sum(1 for rc in snap.ref_counts if rc > 0)
        held = len({s for t in snap.sequences.values() for s in t})
        # Any free slot serves any token: no contiguity to lose, so the whole free list is
        # one usable run (fragmentation 0), and every allocated slot holds a token.
        return AllocatorState(snap.num_blocks, len(snap.free), len(snap.cached), used,
                              len(snap.free), self.engine.allocations,
                              self.engine.allocation_failures, held, held,
                              live_sequences=len(snap.sequences), held_blocks=held)

    def block_tables(self) -> tuple[BlockTableSnapshot, ...]:
        """Slot ownership, a 'block' being one slot here: free slots, unlocked tree slots
        (evictable), per slot the lock refs of its node plus a live request's own hold, and
        each slot's write-time tag against the tag the tree's path gives it."""
        e = self.engine
        with e.lock:
            owned = e.tree_slots()
            refs = [0] * e.num_slots
            hashes: list[int | None] = [None] * e.num_slots
            for node, s, _ in owned:
                refs[s], hashes[s] = refs[s] + node.lock_ref, e.tags[s]
            tables = {r.rid: tuple(r.matched + r.private) for r in e.running.values()}
            for r in e.running.values():
                for s in r.private:
                    refs[s] += 1
            return (BlockTableSnapshot(
                0, e.num_slots, tuple(e.free),
                tuple(s for node, s, _ in owned if node.lock_ref == 0),
                tuple(refs), tuple(hashes), tuple((h, s) for _, s, h in owned), tables),)
