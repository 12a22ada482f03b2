"""Write-time fingerprints in the probe: each full block fingerprinted as the engine fills it.

A recompute compare has to tolerate rounding noise, so a change below the tolerance after the
write (one layer of one block nudged by 1e-3 of its spread in bfloat16) passes it. A digest
of the block's bytes taken when the forward that filled it ends, compared with a digest of
what a later hit is served, catches any changed byte, whatever the dtype.

Two halves, like the probe:

* :class:`WriteTracker` (scheduler half): from each step's scheduler output, which full
  blocks of which attention group that step completes (block ``i`` of a request is completed
  when ``computed < (i+1)*block_size <= computed + scheduled``), and by which write path:
  ``prefill`` when the block holds prompt tokens only, ``decode`` when it holds generated
  ones (multi-turn reuse of a model's own answer). Each is marked to be fingerprinted, 1 in
  ``every``; the others only have their path recorded (a stale digest of the block's last
  occupant must never survive a rewrite);
* :class:`WriteTable` (worker half): after the forward, the marked blocks' bytes are
  digested as the engine lays them out (:func:`raw_digest`: each layer's slice of the block,
  no decoding, where the KV lives: xxh3 in place in host memory, the device-agnostic
  ``wsum64`` on a GPU). A capture digests its blocks the same way when the hit is served and
  ships both digests; the sidecar compares them (digesting the decoded block instead would
  add the decoder's strided copies to every write: ``kv-sidecar bench perf --figures
  fingerprint`` measures both). Entries are keyed by (group, block id) and stamped with a
  write sequence number (the epoch: one per write); the table is bounded (oldest first out,
  counted).

Recurrent-state groups (LFM2's conv state) are not fingerprinted: vLLM keeps the running
state in a block it rewrites or relocates as the sequence advances, so "the forward that
filled it" does not name a final write. Their blocks are still recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sidecar.checks.fingerprint import kv_digest
from sidecar.core.protocol import WritePath
from sidecar.core.tensor_bytes import byte_view

try:  # vLLM depends on xxhash; without it the stacked digest below is used
    import xxhash

    _xxh3_128: Any = xxhash.xxh3_128
except ImportError:  # pragma: no cover - exercised where xxhash is missing
    _xxh3_128 = None

DEFAULT_CAPACITY = 1 << 20  # entries (group, block): ~200 bytes each, far above any pool here


@dataclass(frozen=True)
class BlockFill:
    """One full block a step completes: where, by which path, fingerprinted or not."""

    group_id: int
    block_id: int
    path: str  # WritePath value
    fingerprint: bool


@dataclass
class _Request:
    prompt_len: int
    blocks: dict[int, list[int]] = field(default_factory=dict)  # group -> block ids


class WriteTracker:
    """Scheduler half (see the module docstring). ``groups``: the attention groups to track;
    ``null_ids``: per group, block ids that hold nothing (vLLM's null block)."""

    def __init__(self, block_size: int, every: int, groups: Iterable[int],
                 null_ids: dict[int, frozenset[int]] | None = None,
                 max_requests: int = 10_000) -> None:
        if every < 0:
            raise ValueError(f"fingerprint_every must be >= 0 (0: off), got {every}")
        self.block_size = block_size
        self.every = every
        self.groups = frozenset(groups)
        self.null_ids = null_ids or {}
        self.max_requests = max_requests
        self._requests: dict[str, _Request] = {}
        self._count = 0  # completed blocks so far: every ``every``-th is fingerprinted

    @property
    def enabled(self) -> bool:
        return self.every > 0 and bool(self.groups)

    def step(self, so: Any, skip: Callable[[str], bool] = lambda _r: False
             ) -> list[BlockFill]:
        """The blocks this scheduler output's forward completes. ``skip(req_id)``: requests
        whose blocks are not tracked (the sidecar's own salted recomputes)."""
        if not self.enabled:
            return []
        out: list[BlockFill] = []
        for req in so.scheduled_new_reqs:
            if skip(req.req_id):
                continue
            if len(self._requests) >= self.max_requests:  # oldest first: bounded memory
                self._requests.pop(next(iter(self._requests)))
            state = _Request(len(req.prompt_token_ids or []),
                             {g: list(ids) for g, ids in enumerate(req.block_ids)
                              if g in self.groups})
            self._requests[req.req_id] = state
            out += self._completed(state, int(req.num_computed_tokens),
                                   int(so.num_scheduled_tokens.get(req.req_id, 0)))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            state = tracked
            new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if new_ids is not None:
                resumed = req_id in cached.resumed_req_ids  # a preempted request starts over
                for g, ids in enumerate(new_ids):
                    if g in self.groups:
                        state.blocks[g] = list(ids) if resumed else \
                            state.blocks.get(g, []) + list(ids)
            out += self._completed(state, int(cached.num_computed_tokens[i]),
                                   int(so.num_scheduled_tokens.get(req_id, 0)))
        return out

    def _completed(self, state: _Request, computed: int, scheduled: int) -> list[BlockFill]:
        bs = self.block_size
        out = []
        for i in range(computed // bs, (computed + scheduled) // bs):
            path = WritePath.PREFILL if (i + 1) * bs <= state.prompt_len else WritePath.DECODE
            for g, ids in state.blocks.items():
                if i >= len(ids) or ids[i] in self.null_ids.get(g, ()):
                    continue  # out of a sliding window: vLLM's null block
                self._count += 1
                out.append(BlockFill(g, ids[i], path.value, self._count % self.every == 0))
        return out

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)


@dataclass(frozen=True)
class WriteEntry:
    epoch: int  # the probe's write sequence number: one per write of any block
    digest: str | None  # None: not one of the 1 in ``every`` fingerprinted
    path: str


Digester = Callable[[int, int], str]  # (group, block) -> raw_digest of its bytes now


def raw_digest(layers: Sequence[torch.Tensor], block_id: int) -> str:
    """The digest of one block's bytes in the engine's layout: each layer's slice of the
    block (``t[block_id]``) in layer order, no decoding. In host memory each slice is hashed
    in place (xxh3, streamed: no copy); elsewhere the slices are stacked on their device
    (one copy) and digested there (``wsum64``). Only ever compared with itself (at write and
    at capture, by the same probe), never recomputed by the sidecar."""
    slices = [t[block_id] for t in layers]
    if _xxh3_128 is not None and all(x.device.type == "cpu" and x.is_contiguous()
                                     for x in slices):
        h = _xxh3_128()
        for x in slices:
            h.update(byte_view(x))
        return f"xxh3_128:{h.hexdigest()}"
    raw = torch.stack(slices)
    return kv_digest(raw, raw.new_empty(0))


class WriteTable:
    """Worker half (see the module docstring): the last write of each (group, block)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, int], WriteEntry] = OrderedDict()
        self._epoch = 0
        self.fingerprinted: dict[tuple[int, str], int] = {}  # (group, path) -> blocks, unsent
        self.evictions = 0  # unsent

    def record(self, fills: Sequence[BlockFill], digest_of: Digester) -> None:
        """After the forward that completed ``fills``: digest the marked ones."""
        for fill in fills:
            key = (fill.group_id, fill.block_id)
            digest = None
            if fill.fingerprint:
                digest = digest_of(fill.group_id, fill.block_id)
                at = (fill.group_id, fill.path)
                self.fingerprinted[at] = self.fingerprinted.get(at, 0) + 1
            self._epoch += 1
            self._entries.pop(key, None)  # a rewrite: the block moves to the newest end
            self._entries[key] = WriteEntry(self._epoch, digest, fill.path)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1

    def get(self, group_id: int, block_id: int) -> WriteEntry | None:
        return self._entries.get((group_id, block_id))

    def __len__(self) -> int:
        return len(self._entries)

    def take_counts(self) -> dict[str, Any] | None:
        """The counts since the last call, as a ``fingerprints`` message's fields (``None``
        when there is nothing to report)."""
        if not self.fingerprinted and not self.evictions:
            return None
        out = {"blocks": [[g, p, n] for (g, p), n in sorted(self.fingerprinted.items())],
               "evictions": self.evictions}
        self.fingerprinted, self.evictions = {}, 0
        return out
