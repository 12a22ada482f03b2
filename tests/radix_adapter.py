"""kv-sidecar adapter for the radix engine, written against the public protocol only.

What the protocol now gives it (issue 20): block names for a slot engine
(:class:`sidecar.adapters.slot_blocks.SlotBlocks`: a block is a block_size-aligned run of a
path's slots, named by its LAST slot, remembered at hit time as well as at store time, since
a hit can precede the store); documented ``read`` semantics (a block that is gone may be left
out or read as its slots are now: either way the Monitor drops it as evicted, no adapter
error); ``capture`` as a
declared, conformance-checked capability (:mod:`sidecar.core.capabilities`, called inside
``on_lookup`` before the prefill gathers the slots: this engine's lock is re-entrant); and
block-table snapshots confirmed on a second snapshot, so lock refs changed under the
engine's lock before the hooks run read as no leak. Only full blocks are stored; a hit's
partial last block is served but never verified. Its own hook code is guarded by
:func:`sidecar.adapters.hook_guard.never_raises`. No generation stamps: the Monitor's
epochs see evictions.
"""

from __future__ import annotations

from collections.abc import Sequence

import sidecar.core.protocol as kv
from sidecar.adapters.hook_guard import never_raises
from sidecar.adapters.slot_blocks import SlotBlocks
from sidecar.checks.keys import prefix_digest
from tests.radix_engine import RadixEngine, Running


class RadixAdapter:
    reference_kind = "engine"  # recomputes through the engine's own model (engine.model)

    def __init__(self, engine: RadixEngine) -> None:
        self.engine, self.bs = engine, engine.block_size
        self.runs, self.hook_errors = SlotBlocks(self.bs), 0  # block id (last slot) -> slots
        mc = engine.model.config
        group = kv.CacheGroup(0, kv.GroupKind.FULL_ATTENTION, tuple(range(mc.num_layers)),
                              name="full")
        self.info = kv.EngineInfo("radix", mc.name, mc.revision, mc.dtype, self.bs,
                                  mc.num_kv_heads, mc.head_dim, (group,),
                                  key_fields=("model_revision", "adapter"))

    def attach(self, sink: kv.EventSink) -> RadixAdapter:
        """Start translating the engine's events into ``sink`` (a Monitor)."""
        self.sink, self.engine.listener = sink, self
        return self

    # -------------------------------------------- engine events -> sidecar events
    @never_raises
    def matched(self, run: Running, matched: int) -> None:
        n, req, bs = matched // self.bs, run.request, self.bs
        blocks = {0: self.runs.name_all(run.matched[:n * bs])}
        hit = kv.Hit(req.tokens, n * bs, blocks, key_fields=self._fields(run)) if matched else None
        self.sink.on_lookup(kv.Lookup(len(req.tokens), matched, hit, run.rid))

    @never_raises
    def inserted(self, run: Running, slots: list[int], cached: int) -> None:
        tokens, fields, bs = run.tokens, self._fields(run), self.bs
        for lo in range(cached // bs * bs, len(tokens) // bs * bs, bs):
            self.sink.on_store(kv.StoredBlock(0, self.runs.name(slots, lo), 0,
                                              tokens[lo:lo + bs], lo, fields,
                                              prefix_digest=prefix_digest(tokens[:lo], bs)))

    @never_raises
    def evicted(self, slots: list[int], start: int) -> None:
        bs = self.bs  # the full blocks whose last token is in the evicted leaf
        ids = [slots[lo + bs - 1] for lo in range(start // bs * bs, len(slots) // bs * bs, bs)]
        if ids:  # runs kept: a read of a gone block gets its slots' bytes, epochs drop it
            self.sink.on_free(0, ids)

    @never_raises
    def finished(self, latency_s: float) -> None:
        self.sink.on_request_done(latency_s)

    def _fields(self, run: Running) -> dict[str, str]:  # the request's own, not the key's
        return {"model_revision": self.info.revision, "adapter": run.request.adapter}

    # -------------------------------------------- sidecar.core.protocol.Adapter
    def describe(self) -> kv.EngineInfo:
        return self.info

    def read(self, hit: kv.Hit, refs: Sequence[kv.BlockRef]) -> list[kv.BlockKV]:
        """The refs' slots as the pool holds them now; a block never named is left out
        (Adapter.read's contract)."""
        out, e = [], self.engine
        with e.lock:
            for ref in refs:
                if ref.group_id == 0 and (slots := self.runs.slots(ref.block_id)):
                    k, v = e.pool_k[list(slots)], e.pool_v[list(slots)]
                    out.append(kv.BlockKV(ref, k.permute(1, 2, 0, 3).contiguous(),
                                          v.permute(1, 2, 0, 3).contiguous()))
        return out

    capture = read  # sidecar.core.capabilities.Capture: in on_lookup, before the prefill

    def recompute(self, hit: kv.Hit, refs: Sequence[kv.BlockRef]) -> list[kv.BlockKV]:
        bs, fields = self.bs, hit.key_fields
        end = max((r.index + 1) * bs for r in refs)
        if end > len(hit.tokens) or fields.get("model_revision") != self.info.revision:
            raise kv.AdapterError("hit too short, or its model revision is not loaded")
        ref_kv = self.engine.model.prefill(list(hit.tokens[:end]), fields.get("adapter", ""))
        span = [slice(r.index * bs, (r.index + 1) * bs) for r in refs]
        return [kv.BlockKV(r, ref_kv.keys[:, :, s].clone(), ref_kv.values[:, :, s].clone())
                for r, s in zip(refs, span, strict=True)]

    def allocator(self) -> kv.AllocatorState:
        snap = self.block_tables()[0]
        used = sum(1 for rc in snap.ref_counts if rc > 0)
        held = len({s for t in snap.sequences.values() for s in t})
        # Any free slot serves any token: no contiguity to lose, so the whole free list is
        # one usable run (fragmentation 0), and every allocated slot holds a token.
        return kv.AllocatorState(snap.num_blocks, len(snap.free), len(snap.cached), used,
                                 len(snap.free), self.engine.allocations,
                                 self.engine.allocation_failures, held, held,
                                 live_sequences=len(snap.sequences), held_blocks=held)

    def block_tables(self) -> tuple[kv.BlockTableSnapshot, ...]:
        """Slot ownership, a 'block' being one slot here: free slots, unlocked tree slots
        (evictable), per slot the lock refs of its node plus a live request's own hold, and
        each slot's write-time tag against the tag the tree's path gives it."""
        e = self.engine
        with e.lock:
            owned = e.tree_slots()
            refs, hashes = [0] * e.num_slots, [None] * e.num_slots  # type: list[int], list[object]
            for node, s, _ in owned:
                refs[s], hashes[s] = refs[s] + node.lock_ref, e.tags[s]
            for r in e.running.values():
                for s in r.private:
                    refs[s] += 1
            return (kv.BlockTableSnapshot(
                0, e.num_slots, tuple(e.free),
                tuple(s for node, s, _ in owned if node.lock_ref == 0),
                tuple(refs), tuple(hashes), tuple((h, s) for _, s, h in owned),
                {r.rid: tuple(r.matched + r.private) for r in e.running.values()}),)
