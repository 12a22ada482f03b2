"""``rotary_embedding`` as vLLM's C++ op does it, in torch (test-only shim).

SGLang's ``RotaryEmbedding`` on a device that is neither CUDA, HIP nor its CPU engine imports
``vllm._custom_ops.rotary_embedding`` and calls it in place:
``(positions, query, key, head_size, cos_sin_cache, is_neox)``, with query/key of shape
``(tokens, heads * head_size)`` (or ``(tokens, heads, head_size)``), ``cos_sin_cache`` of
shape ``(max_pos, rot_dim)`` holding cos then sin halves.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    if neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    rot = cos.shape[-1] * 2
    for t in (query, key):
        if t is None:
            continue
        view = t.view(n, -1, head_size)
        view[..., :rot] = _rotate(view[..., :rot], cos, sin, is_neox)
