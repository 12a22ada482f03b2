"""vLLM's paged KV layout on the CPU backend, and its conversion to the sidecar's.

vLLM 0.32's CPU attention backend allocates one tensor per layer of shape
``(num_blocks, kv_heads, block_size, 2 * head_dim)``. Viewed as
``(num_blocks, kv_heads, 2 * block_size, head_dim)``, a block's first ``block_size`` rows
hold K *transposed* (``head_dim x block_size`` in row-major order) and the last
``block_size`` rows hold V as ``block_size x head_dim``. Measured against an HF recompute of
the same tokens (fp32 normalized error ~1e-6), so the reading is right, not just plausible.

Other backends (FlashAttention on GPU: ``(2, num_blocks, block_size, kv_heads, head_dim)``)
lay blocks out differently; the probe refuses to start rather than misread them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class UnsupportedLayout(RuntimeError):
    """The engine's KV tensors are not in a layout this probe was tested with."""


def validate_cpu_layout(kv_caches: Mapping[str, torch.Tensor], block_size: int) -> None:
    if not kv_caches:
        raise UnsupportedLayout("kv-sidecar probe: the engine registered no KV caches")
    for name, t in kv_caches.items():
        if t.dim() != 4 or t.shape[2] != block_size or t.shape[3] % 2:
            raise UnsupportedLayout(
                f"kv-sidecar probe: KV cache {name!r} has shape {tuple(t.shape)}; expected "
                f"vLLM's CPU layout (num_blocks, kv_heads, {block_size}, 2*head_dim). "
                "Only the CPU attention backend's layout is supported by this probe.")


def decode_cpu_block(layers: Sequence[torch.Tensor], block_id: int,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one block for ``layers``, each ``(layers, kv_heads, block_size, head_dim)``,
    copied (the engine may reuse the block the moment we return)."""
    keys, values = [], []
    for t in layers:
        blk = t[block_id]  # (H, bs, 2D)
        h, bs, two_d = blk.shape
        d = two_d // 2
        rows = blk.reshape(h, 2 * bs, d)
        keys.append(rows[:, :bs, :].reshape(h, d, bs).transpose(1, 2))
        values.append(rows[:, bs:, :])
    return (torch.stack(keys).contiguous().clone(), torch.stack(values).contiguous().clone())


def encode_cpu_block(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`decode_cpu_block` for one layer: ``(H, bs, D)`` K and V to the
    ``(H, bs, 2D)`` block vLLM stores (tests use it to write a block through the worker)."""
    h, bs, d = key.shape
    k_rows = key.transpose(1, 2).contiguous().reshape(h, bs, d)  # K^T's bytes, row-major
    return torch.cat([k_rows, value], dim=1).reshape(h, bs, 2 * d)
