"""A minimal in-memory adapter for testing the monitor and verifier in isolation.

Its "model" maps a token prefix to KV deterministically (a seeded generator per position),
so recompute is exact and a test can corrupt any stored block and know what should be
flagged. Engine behaviour is tested with the real reference engine elsewhere; this is for
the sidecar's own control flow (sampling, queue, errors, time limits).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from sidecar.core.protocol import (
    AllocatorState,
    BlockKV,
    BlockRef,
    CacheGroup,
    EngineInfo,
    GroupKind,
    Hit,
    Lookup,
    StoredBlock,
)

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8


def reference_kv(tokens: Sequence[int], index: int, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                  torch.Tensor]:
    """KV of block ``index``: depends on every token up to the end of the block."""
    seed = hash(tuple(tokens[: (index + 1) * BS])) % (2**31)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, HEADS, BS, DIM, generator=g).to(dtype)
    v = torch.randn(LAYERS, HEADS, BS, DIM, generator=g).to(dtype)
    return k, v


class ToyEngine:
    """Stores blocks for prompts and serves hits; tests corrupt ``self.kv`` directly."""

    def __init__(self, sink, dtype: torch.dtype = torch.float32) -> None:
        self.sink = sink
        self.dtype = dtype
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gen: dict[int, int] = {}
        self.index: dict[tuple[int, ...], int] = {}
        self.next_block = 0

    def serve(self, tokens: list[int], key_fields: dict[str, str] | None = None) -> Hit | None:
        key_fields = key_fields or {}
        n_full = len(tokens) // BS
        blocks: list[int] = []
        for i in range(n_full):
            b = self.index.get(tuple(tokens[: (i + 1) * BS]))
            if b is None:
                break
            blocks.append(b)
        hit_tokens = len(blocks) * BS
        hit = None
        if blocks:
            hit = Hit(tokens, hit_tokens, {0: blocks}, {0: [self.gen[b] for b in blocks]},
                      key_fields)
        self.sink.on_lookup(Lookup(len(tokens), hit_tokens, hit))
        for i in range(len(blocks), n_full):
            b = self.next_block
            self.next_block += 1
            self.gen[b] = self.gen.get(b, 0) + 1
            self.kv[b] = reference_kv(tokens, i, self.dtype)
            self.index[tuple(tokens[: (i + 1) * BS])] = b
            self.sink.on_store(StoredBlock(0, b, self.gen[b], tokens[i * BS:(i + 1) * BS],
                                           i * BS, key_fields,
                                           parent_block_id=blocks[-1] if blocks else None))
            blocks.append(b)
        self.sink.on_request_done(0.01)
        return hit


class ToyAdapter:
    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine
        self.fail: dict[str, BaseException] = {}
        self.hang: dict[str, threading.Event] = {}

    def describe(self) -> EngineInfo:
        return EngineInfo("toy", "toy-model", "r1", str(self.engine.dtype).removeprefix("torch."),
                          BS, HEADS, DIM,
                          (CacheGroup(0, GroupKind.FULL_ATTENTION, tuple(range(LAYERS))),),
                          ("adapter",))

    def _maybe_misbehave(self, op: str) -> None:
        if op in self.hang:
            self.hang[op].wait(30)
        if op in self.fail:
            raise self.fail[op]

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        self._maybe_misbehave("read")
        out = []
        for r in refs:
            k, v = self.engine.kv[r.block_id]
            out.append(BlockKV(r, k.clone(), v.clone(), self.engine.gen[r.block_id]))
        return out

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        self._maybe_misbehave("recompute")
        return [BlockKV(r, *reference_kv(hit.tokens, r.index, self.engine.dtype)) for r in refs]

    def allocator(self) -> AllocatorState | None:
        self._maybe_misbehave("allocator")
        n = self.engine.next_block
        return AllocatorState(total_blocks=100, free_blocks=100 - n, cached_blocks=n,
                              used_blocks=0, largest_free_run=100 - n, allocations=n,
                              allocation_failures=0)
