"""vLLM's paged KV layout on the CPU backend, and its conversion to the sidecar's.

vLLM 0.32's CPU attention backend allocates one tensor per layer of shape
``(num_blocks, kv_heads, block_size, 2 * head_dim)``: per head, the first ``block_size *
head_dim`` values of a block hold K and the last ``block_size * head_dim`` hold V. How those
values are ordered depends on the kernel ISA vLLM picks (``_get_attn_isa``), and the same
engine build picks differently on different CPUs:

* ``vec`` / ``vec16`` (fp32, fp16, and bf16 on CPUs without AMX): K *transposed*
  (``head_dim x block_size`` row-major), then V as ``block_size x head_dim``.
* ``amx`` (bf16 with ``block_size % 32 == 0`` on a CPU with AMX tiles, e.g. Sapphire Rapids):
  both are VNNI-packed for the AMX B operand. K as ``[block_size/16][head_dim/2][16 tokens]
  [2 dims]``, V as ``[head_dim/16][block_size/2][16 dims][2 tokens]``.

Reading an AMX block with the ``vec`` order scrambles every value (normalized error ~5
against an HF recompute, while the engine reference, scrambled the same way, still agreed).
Both orders were measured against vLLM's own ``cpu_attn_reshape_and_cache`` kernel
(``tests/vllm/test_layout.py``) and against an HF recompute of the same tokens (fp32 ~1e-6,
bf16 ~3e-2), so the reading is right, not just plausible.

Other backends (FlashAttention on GPU: ``(2, num_blocks, block_size, kv_heads, head_dim)``)
and other CPU ISAs (neon, vxe, vsx, rvv: untested) lay blocks out differently; the probe
refuses to start rather than misread them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

# The CPU kernels whose block layout this module decodes (see the module docstring).
SUPPORTED_ISAS = ("vec", "vec16", "amx")
_AMX_ROWS = 16  # AMX tile: 16 rows of 64 bytes = 16 x (2 bf16), the VNNI pair


class UnsupportedLayout(RuntimeError):
    """The engine's KV tensors are not in a layout this probe was tested with."""


def cpu_attn_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The kernel ISA vLLM's CPU backend uses for these caches: vLLM's own choice when vLLM is
    importable (the probe runs inside it), else the same rule for x86 (AMX for bf16)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        if head_dim % 32 and head_dim % 16 == 0:
            return "vec16"
        if (dtype == torch.bfloat16 and block_size % 32 == 0
                and torch.cpu._is_amx_tile_supported()):
            return "amx"
        return "vec" if block_size % 32 == 0 else "vec16"
    return str(_get_attn_isa(dtype, block_size, head_dim))


def validate_cpu_layout(kv_caches: Mapping[str, torch.Tensor], block_size: int) -> None:
    if not kv_caches:
        raise UnsupportedLayout("kv-sidecar probe: the engine registered no KV caches")
    for name, t in kv_caches.items():
        if t.dim() != 4 or t.shape[2] != block_size or t.shape[3] % 2:
            raise UnsupportedLayout(
                f"kv-sidecar probe: KV cache {name!r} has shape {tuple(t.shape)}; expected "
                f"vLLM's CPU layout (num_blocks, kv_heads, {block_size}, 2*head_dim). "
                "Only the CPU attention backend's layout is supported by this probe.")
        isa = cpu_attn_isa(t.dtype, block_size, t.shape[3] // 2)
        if isa not in SUPPORTED_ISAS:
            raise UnsupportedLayout(
                f"kv-sidecar probe: KV cache {name!r} is written by vLLM's {isa!r} CPU kernel, "
                f"whose block layout is untested; supported: {', '.join(SUPPORTED_ISAS)}.")


def decode_cpu_block(layers: Sequence[torch.Tensor], block_id: int, block_size: int,
                     isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one block for ``layers``, each ``(layers, kv_heads, block_size, head_dim)``,
    copied (the engine may reuse the block the moment we return). ``isa``: the kernel that
    wrote the block, by default the one vLLM picks for the caches' dtype and shape."""
    keys, values = [], []
    for t in layers:
        blk = t[block_id]  # (H, bs, 2D)
        h, bs, two_d = blk.shape
        d = two_d // 2
        kind = isa or cpu_attn_isa(blk.dtype, block_size, d)
        flat = blk.reshape(h, 2 * bs * d)
        k_raw, v_raw = flat[:, : bs * d], flat[:, bs * d:]
        if kind == "amx":
            r = _AMX_ROWS
            keys.append(k_raw.reshape(h, bs // r, d // 2, r, 2).permute(0, 1, 3, 2, 4)
                        .reshape(h, bs, d))
            values.append(v_raw.reshape(h, d // r, bs // 2, r, 2).permute(0, 2, 4, 1, 3)
                          .reshape(h, bs, d))
        else:
            keys.append(k_raw.reshape(h, d, bs).transpose(1, 2))
            values.append(v_raw.reshape(h, bs, d))
    return (torch.stack(keys).contiguous().clone(), torch.stack(values).contiguous().clone())


def encode_cpu_block(key: torch.Tensor, value: torch.Tensor,
                     isa: str = "vec") -> torch.Tensor:
    """Inverse of :func:`decode_cpu_block` for one layer: ``(H, bs, D)`` K and V to the
    ``(H, bs, 2D)`` block vLLM stores (tests use it to write a block through the worker)."""
    h, bs, d = key.shape
    if isa == "amx":
        r = _AMX_ROWS
        k_raw = key.reshape(h, bs // r, r, d // 2, 2).permute(0, 1, 3, 2, 4)
        v_raw = value.reshape(h, bs // 2, 2, d // r, r).permute(0, 3, 1, 4, 2)
    else:
        k_raw, v_raw = key.transpose(1, 2), value  # K^T's bytes, row-major
    return torch.cat([k_raw.reshape(h, bs * d), v_raw.reshape(h, bs * d)],
                     dim=1).reshape(h, bs, 2 * d)
