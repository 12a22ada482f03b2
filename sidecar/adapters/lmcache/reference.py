"""The reference a retrieved chunk is compared with: a from-scratch prefill by an HF model.

LMCache stores what the serving engine computed; the reference recomputes the chunk's K/V
from the tokens alone, with a transformers causal LM of the same checkpoint (passed in as a
model object, so the caller decides where the weights come from: ``from_pretrained`` on the
served checkpoint directory in production, a randomly initialised tiny Llama in tests).
Recompute prefills the prefix up to the last sampled chunk, never through LMCache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sidecar.core.protocol import AdapterError, BlockKV, BlockRef, Hit


class HFChunkReference:
    """Recomputes chunks with a transformers causal LM (its KV cache, layer by layer)."""

    name = "hf"

    def __init__(self, model: Any, chunk_size: int) -> None:
        self.model = model.eval()
        self.chunk_size = chunk_size

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        if not refs:
            return []
        n = (max(r.index for r in refs) + 1) * self.chunk_size
        if len(hit.tokens) < n:
            raise AdapterError(f"hit has {len(hit.tokens)} tokens, {n} needed")
        with torch.inference_mode():
            out = self.model(torch.tensor([list(hit.tokens[:n])]), use_cache=True)
        layers = out.past_key_values.layers
        result = []
        for ref in refs:
            lo, hi = ref.token_range(self.chunk_size)
            k = torch.stack([layer.keys[0, :, lo:hi] for layer in layers])
            v = torch.stack([layer.values[0, :, lo:hi] for layer in layers])
            result.append(BlockKV(ref, k.contiguous(), v.contiguous()))
        return result
