"""The in-engine half: what the tapped radix tree and allocator report, as pipe messages.

Runs inside SGLang's scheduler process, on its thread, from the hooks of
:mod:`.backend`. It imports torch and the sidecar's pipe/wire/sampling modules, never SGLang,
so it is testable with plain tensors. Every public method is best-effort: an exception is
logged and counted (the count rides on the next ``tap_stats`` message), never raised into
SGLang. What it sends, in the order things happened (one PUSH socket keeps that order, so a
store always reaches the sidecar before a hit that names it):

* ``hello``: block size, dtype, KV heads, head dim, the cache groups (each pool's layers and
  kind), SGLang version;
* ``events``: ``[[kind, fields], ...]``, runs of stores, frees and lookups in the order
  they happened, each with the fields its own message would have (one message per flush of
  the outbox, below; ``tap_stats`` rides last when the server goes quiet);
* stores: ``[[block_id, prefix_tokens, tokens, prefix_digest, key_fields], ...]`` for the
  full blocks an insert added to the tree;
* frees: block ids whose last slot went back to the allocator (evicted, or freed);
* lookups / ``capture``: one lookup per admitted request (what SGLang itself counts as
  the request's cached tokens), and for 1 in ``sample_every`` hits the K/V of the chosen
  blocks, copied while the request still holds them. On a hybrid SWA server (full and
  sliding-window layers in two pools) the hit names each block twice: in the full group by
  its full-pool slot, in the sliding group by the SWA-pool slot SGLang maps it to (null,
  0, where SGLang tombstoned any of the block's SWA slots);
* ``census``: at most once per ``census_every_s``, the pool as SGLang keeps it (free list,
  tree slots, slots the tap saw allocated, evictable and protected sizes) for the sidecar's
  invariant checks; and at most ``census_share`` of SGLang's time: a census costs in
  proportion to the pool (the tap's part ~0.03 ms at 4k slots, ~6.5 ms at 2M: bitmaps of
  every slot), so after one that took ``t`` (SGLang's reads included) the next waits at
  least ``t / census_share`` (a 2M-slot pool is censused every ~3-4 s at the default 0.002,
  a small one every ``census_every_s``), never more than :data:`MAX_CENSUS_WAIT_S` for that;
  and once more as the last running request is released, within that budget and at most
  once per ``census_every_s`` of such censuses (a server gone quiet is censused idle: the
  sidecar's leak check needs an idle census);
* ``tap_stats``: the tap's own errors and its time in SGLang's process (``busy_ns``: its
  hooks' time, added up by :mod:`.backend`, plus its shipper's CPU), with each census and
  when the server goes quiet.

Stores, frees and lookups wait in one ordered outbox and are handed over together, as one
``events`` message: before a capture or a census (so the sidecar has every event that came
before what it checks), when 64 items wait, and when the last admitted request is released
(a server going quiet keeps nothing back). A message per event cost the scheduler a ZMQ send
each, and so did a message per run of one kind (kinds alternate per request); the slot maps
are NumPy arrays for the same reason (a torch op per allocation or free costs several
microseconds of dispatch).

Every message goes, in order, to the tap's shipper (:mod:`.tap_shipper`): the batches are
packed and sent by a thread of its own, off SGLang's thread (a send there cost ~300 us of
wall time on a busy host); the hello, a sampled hit's capture and a census go at once,
with everything queued before them. The outbox is also handed over from an allocation (a
decode step) once it has waited :data:`~.tap_shipper.SHIP_EVERY_S`: a long request must not
hold other requests' events back until it ends.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sidecar.adapters.sglang.slot_ids import NULL_SLOT, bitmap, block_names, packed, slot_array
from sidecar.adapters.sglang.tap_shipper import SHIP_EVERY_S, TapShipper
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.wire import capture_fields
from sidecar.checks.keys import token_digest
from sidecar.core.protocol import CacheGroup, GroupKind, Hit
from sidecar.core.sampling import UniformSampler

log = logging.getLogger(__name__)

_MAX_TRACKED = 10_000  # requests admitted and not yet released (bounded memory)
OUTBOX_ITEMS = 64  # stores, frees and lookups held back at most before they are sent
# The longest a census's own cost can put the next one off (a tiny census_share must not
# end the invariant checks); census_every_s may still set a longer period.
MAX_CENSUS_WAIT_S = 300.0


@dataclass(frozen=True)
class PoolGroup:
    """One cache group as the tap reads it: the SGLang pool holding its layers' K/V
    (``k_buffer``/``v_buffer`` per layer, ``(slots, kv_heads, head_dim)``) and, for the
    sliding-window pool of a hybrid SWA server, how a full-pool slot maps to its slot there
    (``translate``; ``None``: the full pool itself)."""

    group: CacheGroup
    pool: Any
    translate: Callable[[torch.Tensor], torch.Tensor] | None = None

    @staticmethod
    def full(pool: Any) -> PoolGroup:
        """A full-attention server's one group: every layer, in ``pool``."""
        return PoolGroup(CacheGroup(0, GroupKind.FULL_ATTENTION, tuple(range(len(
            pool.k_buffer))), name="full", null_block_ids=frozenset({NULL_SLOT})), pool)


# What the tap's uniform sampler is shown for a hit it only counts down (see ``admitted``).
_UNSAMPLED = Hit(tokens=[], hit_tokens=0, blocks={})


class SglangTap:
    """See the module docstring. ``pool`` is SGLang's ``MHATokenToKVPool`` (per-layer
    ``k_buffer``/``v_buffer`` of shape ``(slots, kv_heads, head_dim)``)."""

    def __init__(self, endpoint: str, block_size: int, sample_every: int = 100,
                 blocks_per_sample: int = 2, seed: int = 0, census_every_s: float = 1.0,
                 pipe_hwm: int = 256, census_share: float = 0.002) -> None:
        self.block_size = block_size
        self.blocks_per_sample = blocks_per_sample
        self.census_every_s = census_every_s
        self.census_share = census_share  # 0: no limit by the census's own cost
        self.sampler = UniformSampler(sample_every, seed)
        self._rng = random.Random(seed)
        self.pipe = Pipe(endpoint, pipe_hwm)
        self.errors = 0
        self.busy_ns = 0  # SGLang's thread in the tap (the backend's hooks add it up)
        self.shipper = TapShipper(self.pipe, self._stats)
        self._admitted: OrderedDict[str, None] = OrderedDict()
        # (kind, items) in the order things happened; see the module docstring
        self._outbox: list[tuple[str, list[Any]]] = []
        self._waiting = 0  # items in the outbox
        self._outbox_due = 0.0  # when the oldest waiting item must be handed over
        self._next_census = 0.0
        self._census_began: float | None = None  # when census_due last said yes
        self._next_by_cost = 0.0  # the census's own cost budget alone (a quiet server's)
        self._next_quiet = 0.0  # a quiet server's census: at most once per census_every_s
        self._quiet = False  # the census census_due last allowed is a quiet server's
        self.groups: tuple[PoolGroup, ...] = ()
        self.cache_groups: tuple[CacheGroup, ...] = ()
        self.size = 0
        self._is_block = np.zeros(0, dtype=bool)  # slot -> names a stored block
        self._digests: dict[int, int] = {}  # stored block's slot -> its chained token digest
        self._allocated = np.zeros(0, dtype=bool)  # slot -> handed out, not freed

    # ------------------------------------------------------------------ set-up
    def attach(self, groups: Sequence[PoolGroup], size: int, engine_version: str,
               model: str) -> None:
        """``groups``: the server's cache groups (group ids in order of each kind's first
        layer, as the sidecar numbers them); ``size``: the full pool's slots."""
        self.groups = tuple(sorted(groups, key=lambda g: g.group.group_id))
        self.cache_groups = tuple(g.group for g in self.groups)
        self.size = int(size) + 1  # SGLang's slot 0 is a padding slot; ids are 1..size
        self._is_block = np.zeros(self.size, dtype=bool)
        self._allocated = np.zeros(self.size, dtype=bool)
        k0 = self.groups[0].pool.k_buffer[0]
        self.shipper.send("hello", dict(
            sglang=engine_version, model=model,
            dtype=str(k0.dtype).removeprefix("torch."), block_size=self.block_size,
            kv_heads=int(k0.shape[1]), head_dim=int(k0.shape[2]),
            groups={g.group_id: list(g.layers) for g in self.cache_groups},
            group_kinds={g.group_id: g.kind.value for g in self.cache_groups},
            slots=int(size)), now=True)

    def _failed(self, what: str) -> None:
        self.errors += 1
        log.exception("kv-sidecar sglang tap: %s failed (ignored)", what)

    # ------------------------------------------------------------------ tree events
    def inserted(self, token_ids: Sequence[int], path_slots: torch.Tensor, prefix_len: int,
                 fields: dict[str, str]) -> None:
        """An insert that found ``prefix_len`` tokens already in the tree: the full blocks
        ending past it are new. ``path_slots`` are the tree's slots for the whole key. The
        token-digest chain starts at the last stored block before the new ones when its
        digest is known (:attr:`_digests`): an insert costs its new blocks, not its prompt
        (a 500-token prompt ending in one new block: 43 -> 6 us)."""
        try:
            bs = self.block_size
            path = slot_array(path_slots)  # NumPy: a torch index or slice costs ~1 us of dispatch
            n = min(len(token_ids), int(path.size)) // bs * bs
            if n <= 0 or n <= prefix_len:
                return
            first = prefix_len // bs * bs  # the first block ending past prefix_len
            digest: int | None = None
            if first:
                digest = self._digests.get(int(path[first - 1]))
                if digest is None:
                    first = 0  # the chain from the start
            slots = path[first:n].tolist()
            items = []
            for lo in range(first, n, bs):
                block_tokens = [int(t) for t in token_ids[lo:lo + bs]]
                before = digest
                digest = token_digest(digest, block_tokens)
                if lo + bs - 1 < prefix_len:
                    continue
                block_id = int(slots[lo - first + bs - 1])
                self._digests[block_id] = digest
                items.append([block_id, lo, block_tokens, before, fields])
            if items:
                self._is_block[np.array([i[0] for i in items], dtype=np.int64)] = True
                self._post("stores", items)
        except Exception:
            self._failed("insert")

    def admitted(self, rid: str, prompt: Sequence[int], hit_tokens: int,
                 prefix_slots: torch.Tensor, fields: dict[str, str]) -> None:
        """A request's first checkpoint (its prefill ran on ``hit_tokens`` cached tokens,
        whose slots it still holds): one lookup, or a sampled capture. ``prefix_slots``:
        the request's slots from its first token on (at least ``hit_tokens`` of them, on
        the pool's device), read, and copied to the CPU, only for a sampled hit."""
        try:
            if rid in self._admitted:
                return
            if len(self._admitted) >= _MAX_TRACKED:
                self._admitted.popitem(last=False)
            self._admitted[rid] = None
            bs = self.block_size
            n_full = min(hit_tokens, int(prefix_slots.numel())) // bs
            # The sampler counts hits down without looking at them: the Hit (a copy of the
            # prompt, every group's block ids) is built only for a sampled one.
            if n_full > 0 and self.sampler.should_sample(_UNSAMPLED):
                slots = prefix_slots[:n_full * bs].to("cpu", torch.int64)
                group_slots = {g.group.group_id: self._group_slots(g, slots)
                               for g in self.groups}
                hit = Hit(tokens=list(prompt[:n_full * bs]), hit_tokens=n_full * bs,
                          key_fields=fields,
                          blocks={gid: block_names(gs, bs) for gid, gs in group_slots.items()})
                refs = self.sampler.choose(hit, bs, self.blocks_per_sample, self.cache_groups)
                by_id = {g.group.group_id: g for g in self.groups}
                kv = [(r.group_id, r.index, r.block_id,
                       *self._read(by_id[r.group_id].pool,
                                   group_slots[r.group_id][r.index * bs:(r.index + 1) * bs]))
                      for r in refs]
                self.flush()
                self.shipper.send("capture", {"key_fields": fields, **capture_fields(
                    f"{rid}"[:200], "hit", None, prompt[:hit_tokens], len(prompt),
                    hit_tokens, {gid: list(ids) for gid, ids in hit.blocks.items()}, kv)},
                    now=True)
            else:
                self._post("lookups", [[len(prompt), int(hit_tokens)]])
        except Exception:
            self._failed("admit")

    @staticmethod
    def _group_slots(g: PoolGroup, slots: torch.Tensor) -> torch.Tensor:
        """The hit's slots in ``g``'s pool (CPU, int64; 0 where SGLang keeps none)."""
        if g.translate is None:
            return slots
        return g.translate(slots).to("cpu", torch.int64)

    def released(self, rid: str) -> None:
        """A request let go of its slots. The last one out flushes the outbox and sends the
        tap's stats: a server going quiet must not keep lookups, stores or frees back in the
        engine process, where the sidecar cannot see them (under load the census flushes
        once a second)."""
        try:
            self._admitted.pop(rid, None)
            if not self._admitted:
                self.flush(stats=True)
        except Exception:
            self._failed("release")

    @staticmethod
    def _read(pool: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` for every layer of ``pool``, as (layers, kv_heads, tokens,
        head_dim)."""
        idx = slots.to(pool.k_buffer[0].device)
        k = torch.stack([buf[idx] for buf in pool.k_buffer]).transpose(1, 2)
        v = torch.stack([buf[idx] for buf in pool.v_buffer]).transpose(1, 2)
        return k.contiguous().cpu(), v.contiguous().cpu()

    def _post(self, kind: str, items: list[Any]) -> None:
        """Queue ``items`` of ``kind`` behind everything queued before them."""
        box = self._outbox
        if not box:
            self._outbox_due = time.monotonic() + SHIP_EVERY_S
        if box and box[-1][0] == kind:
            box[-1][1].extend(items)
        else:
            box.append((kind, items))
        self._waiting += len(items)
        if self._waiting >= OUTBOX_ITEMS:
            self.flush()

    def flush(self, stats: bool = False) -> None:
        """Hand what waits in the outbox, in order, to the shipper as one ``events``
        message: its runs of one kind each (``[[kind, fields], ...]``). Kinds alternate per
        request (a lookup, its stores, its frees), so a message per run cost a pack and a
        ZMQ send per event. ``stats``: the tap's stats ride along, last."""
        box, self._outbox, self._waiting = self._outbox, [], 0
        runs = [[kind, {"ids" if kind == "frees" else "items": items}] for kind, items in box]
        if stats:  # filled in by the shipper as it sends (its own time counts too)
            runs.append(["tap_stats", {}])
        if runs:
            self.shipper.send("events", {"runs": runs})

    # ------------------------------------------------------------------ allocator events
    def allocated(self, slots: torch.Tensor | None) -> None:
        try:
            if slots is None:
                self.shipper.send("alloc_failed", {"n": 1})
                return
            self._allocated[slot_array(slots)] = True
            # Every decode step allocates: a long request carries what waits out.
            if self._waiting and time.monotonic() >= self._outbox_due:
                self.flush()
        except Exception:
            self._failed("alloc")

    def freed(self, slots: torch.Tensor) -> None:
        try:
            idx = slot_array(slots)
            if not idx.size:
                return
            self._allocated[idx] = False
            ids = idx[self._is_block[idx]]
            if ids.size:
                self._is_block[ids] = False
                freed = ids.tolist()
                for b in freed:
                    self._digests.pop(b, None)
                self._post("frees", freed)
        except Exception:
            self._failed("free")

    def cleared(self) -> None:
        """The allocator was reset (a cache flush): every slot is free, no block stored."""
        try:
            self._allocated[:] = False
            ids = np.flatnonzero(self._is_block)
            self._is_block[:] = False
            self._digests.clear()
            if ids.size:
                self._post("frees", ids.tolist())
            self.flush()
        except Exception:
            self._failed("clear")

    # ------------------------------------------------------------------ census
    def census_due(self, quiet: bool = False) -> bool:
        """A census is due (and its time counts from now: SGLang's reads of its free list
        and tree, between this and :meth:`census`, are part of its cost). ``quiet``: the
        server's last running request is being released: due within ``census_share``
        alone and at most once per ``census_every_s`` of quiet ones, whenever the last busy
        one was (an idle server is censused once more, idle; a server whose every batch ends
        together is not censused at every batch)."""
        now = time.monotonic()
        if now < (max(self._next_by_cost, self._next_quiet) if quiet else self._next_census):
            return False
        self._census_began, self._quiet = now, quiet
        return True

    def census(self, free_slots: torch.Tensor, tree_slots: torch.Tensor, evictable: int,
               protected: int, idle: bool, held_back: torch.Tensor | None = None) -> None:
        """The pool as SGLang keeps it right now (on the scheduler's thread, so atomic).
        ``held_back``: frees SGLang has taken but not yet applied (a free group)."""
        began, self._census_began = self._census_began or time.monotonic(), None
        if self._quiet:
            self._next_quiet = began + self.census_every_s
        try:
            self._next_census = time.monotonic() + self.census_every_s
            self.flush()
            free, tree = slot_array(free_slots), slot_array(tree_slots)
            self.shipper.send("census", dict(
                total=self.size - 1, free_len=int(free.size), free=bitmap(free, self.size),
                tree_len=int(tree.size), tree=bitmap(tree, self.size),
                allocated=self._handed_out(held_back),
                evictable=int(evictable), protected=int(protected), idle=bool(idle)))
            self.send_stats(now=True)  # the census and the stats behind it, at once
        except Exception:
            self._failed("census")
        if self.census_share > 0:
            took = time.monotonic() - began
            self._next_by_cost = began + min(took / self.census_share, MAX_CENSUS_WAIT_S)
            self._next_census = max(self._next_census, self._next_by_cost)

    def send_stats(self, now: bool = False) -> None:
        """Queue a ``tap_stats``: its fields are taken by the shipper as it sends it."""
        self.shipper.send("tap_stats", {}, now=now)

    def _stats(self) -> dict[str, int]:
        """Errors and time of the tap in SGLang's process: its hooks on the scheduler's
        thread and its shipper's thread together."""
        return {"errors": self.errors + self.shipper.errors,
                "busy_ns": self.busy_ns + self.shipper.ship_ns}

    def _handed_out(self, held_back: torch.Tensor | None) -> bytes:
        """The slots handed out and not freed, as :func:`bitmap` packs them: straight from
        the tap's mask (ids and back cost ~1.8 ms at 2M slots; this ~0.3)."""
        mask = self._allocated
        if held_back is not None and held_back.numel():
            mask = mask.copy()
            mask[slot_array(held_back)] = False
        return packed(mask)

    def close(self, timeout_s: float = 2.0) -> None:
        """Queue what waits and the stats, let the shipper send them (a bounded wait), and
        close the pipe once its thread is done with the socket."""
        self.flush()
        self.send_stats()
        if self.shipper.close(timeout_s):
            self.pipe.close()
