"""kv-sidecar adapter for the radix engine, written against sidecar.core.protocol only.

A *block* is a block_size-aligned run of a path's token positions (tokens ``i*bs`` to
``(i+1)*bs`` of a prefix); its id is the slot holding its LAST token. Not the first: two
paths that part inside a block share its first slot but not its last, and a slot belongs
to one node at one position, so the last slot names the block's whole token prefix. The
run may span two nodes and its slots need not be contiguous: the adapter remembers each
id's slots (bounded: ids are slot indices). Only full blocks are stored; a hit's partial last block
is served but never verified. No generation stamps: the Monitor's epochs see evictions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import sidecar.core.protocol as kv
from sidecar.checks.keys import prefix_digest
from tests.radix_engine import RadixEngine, Running


def never_raises(hook: Callable[..., None]) -> Callable[..., None]:
    """Engine-side translation must not raise into the engine; the protocol offers no
    guard for it (nor a counter to report it to), so errors are counted here and logged."""
    def guarded(self: RadixAdapter, *args: Any) -> None:
        try:
            hook(self, *args)
        except Exception:
            self.hook_errors += 1
            logging.getLogger(__name__).exception("radix adapter hook %s failed", hook.__name__)
    return guarded


class RadixAdapter:
    def __init__(self, engine: RadixEngine) -> None:
        self.engine, self.bs = engine, engine.block_size
        self.runs: dict[int, tuple[int, ...]] = {}  # block id -> its slots
        self.hook_errors = 0
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
        blocks = {0: [run.matched[(i + 1) * bs - 1] for i in range(n)]}
        hit = kv.Hit(req.tokens, n * bs, blocks, key_fields=self._fields(run)) if matched else None
        self.sink.on_lookup(kv.Lookup(len(req.tokens), matched, hit, run.rid))

    @never_raises
    def inserted(self, run: Running, slots: list[int], cached: int) -> None:
        tokens, fields, bs = run.tokens, self._fields(run), self.bs
        for lo in range(cached // bs * bs, len(tokens) // bs * bs, bs):
            block_id = slots[lo + bs - 1]
            self.runs[block_id] = tuple(slots[lo:lo + bs])
            self.sink.on_store(kv.StoredBlock(0, block_id, 0, tokens[lo:lo + bs], lo, fields,
                                              prefix_digest=prefix_digest(tokens[:lo], bs)))

    @never_raises
    def evicted(self, slots: list[int], start: int) -> None:
        bs = self.bs  # the full blocks whose last token is in the evicted leaf
        ids = [slots[lo + bs - 1] for lo in range(start // bs * bs, len(slots) // bs * bs, bs)]
        if ids:
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
        with self.engine.lock:
            return [self._block(ref) for ref in refs]

    def _block(self, ref: kv.BlockRef) -> kv.BlockKV:
        slots = self.runs.get(ref.block_id)
        if ref.group_id != 0 or slots is None:
            raise kv.AdapterError(f"no slot run is known for block {ref.block_id}")
        k, v = self.engine.pool_k[list(slots)], self.engine.pool_v[list(slots)]
        return kv.BlockKV(ref, k.permute(1, 2, 0, 3).contiguous(),
                          v.permute(1, 2, 0, 3).contiguous())

    capture = read  # called in on_lookup, before the prefill gathers the slots

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
            refs, hashes = [0] * e.num_slots, [None] * e.num_slots  # type: list[int], list[Any]
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
