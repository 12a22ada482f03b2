"""What a block of the reference pool is: its content hash, book-keeping and stored bytes.

Shared by the pool, the CPU tier, the ground truth and the faults, so none of them has to
import another's module for a type (the pool is the only one that mutates blocks).

The block hash is chained: a block's hash covers its parent's hash, its tokens and the key
fields, so it stands for the whole prefix up to its end.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

BlockHash = bytes
KeyFields = tuple[tuple[str, str], ...]  # ordered (name, value) pairs the hash covers

ROOT_HASH: BlockHash = hashlib.sha256(b"kv-sidecar/reference/root").digest()


def chain_hash(parent: BlockHash | None, tokens: Sequence[int],
               key_fields: KeyFields) -> BlockHash:
    """SHA-256 over (parent hash, this block's token ids, the key fields).

    Chaining makes a block's hash stand for the whole prefix up to its end; the key fields
    make two contexts that produce different KV for the same tokens (model revision,
    adapter, cache salt) land on different entries. Length prefixes keep the encoding
    unambiguous.
    """
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    for name, value in key_fields:
        for part in (name.encode(), value.encode()):
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
    return h.digest()


@dataclass(slots=True)
class BlockMeta:
    """Book-keeping of one physical block. ``tokens``/``key_fields``/``prefix_tokens``
    describe the content its hash was computed over (set when it is cached)."""

    block_id: int
    ref_count: int = 0
    generation: int = 0
    block_hash: BlockHash | None = None
    holders: Counter[int] = field(default_factory=Counter)  # holder -> references held
    tokens: tuple[int, ...] = ()
    key_fields: KeyFields = ()
    prefix_tokens: int = 0


@dataclass(frozen=True)
class BlockData:
    """One block's stored bytes: K and V ``(layers, kv_heads, block_size, head_dim)`` in
    the storage dtype, plus the per-row scales when the storage is quantised."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.key, self.value, self.key_scale, self.value_scale)
                     if t is not None)


@dataclass(frozen=True)
class Allocation:
    """Blocks handed out by one allocation (``ok``), and the cached blocks evicted to make
    room (their index entries are gone: the engine reports them as freed)."""

    block_ids: tuple[int, ...]
    evicted: tuple[int, ...]
    ok: bool = True
