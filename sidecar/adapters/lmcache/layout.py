"""LMCache's chunk layout and the sidecar's block layout, and how to read served KV.

LMCache keeps a chunk as one tensor in ``KV_2LTD`` format: ``(2, layers, tokens, kv_heads *
head_dim)`` (K at index 0, V at 1). The sidecar's :class:`sidecar.core.protocol.BlockKV` wants
``(layers, kv_heads, tokens, head_dim)`` for K and V apart. One conversion is used for all
three places KV is seen (the chunk at store, the KV the engine was served, the chunk a tier
holds now), so their bytes, and so their fingerprints, are comparable exactly.

:class:`FlatServedKV` reads what a retrieve delivered from a flat ``(2, layers, tokens,
hidden)`` buffer passed as ``kvcaches=`` (the layout of a CPU connector built on LMCache's
``MockGPUConnector``). A paged engine passes its own :class:`ServedKV` that gathers the
slots of its ``slot_mapping``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


def chunk_to_block(chunk: torch.Tensor, num_kv_heads: int, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2, L, T, H*D)`` -> K and V as ``(L, H, T, D)``, contiguous copies (the source may be
    a buffer LMCache or the engine reuses as soon as we return)."""
    if chunk.dim() != 4 or chunk.shape[0] != 2 or chunk.shape[3] != num_kv_heads * head_dim:
        raise ValueError(f"expected a KV_2LTD chunk (2, layers, tokens, "
                         f"{num_kv_heads * head_dim}), got {tuple(chunk.shape)}")
    layers, tokens = int(chunk.shape[1]), int(chunk.shape[2])

    def side(t: torch.Tensor) -> torch.Tensor:  # one copy, always a new tensor
        return t.reshape(layers, tokens, num_kv_heads, head_dim).permute(0, 2, 1, 3) \
            .clone(memory_format=torch.contiguous_format)

    return side(chunk[0]), side(chunk[1])


class ServedKV(Protocol):
    """Reads the KV a retrieve delivered to the serving engine for tokens ``[start, end)``,
    from the keyword arguments that retrieve was called with; K and V as ``(L, H, T, D)``."""

    def __call__(self, kwargs: Mapping[str, Any], start: int, end: int
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


class FlatServedKV:
    """:class:`ServedKV` for a flat ``kvcaches`` buffer ``(2, layers, tokens, H*D)``."""

    def __init__(self, num_kv_heads: int, head_dim: int, argument: str = "kvcaches") -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.argument = argument

    def __call__(self, kwargs: Mapping[str, Any], start: int, end: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = kwargs.get(self.argument)
        if not isinstance(buffer, torch.Tensor):
            raise ValueError(f"retrieve was called without a {self.argument}= tensor")
        return chunk_to_block(buffer[:, :, start:end], self.num_kv_heads, self.head_dim)
