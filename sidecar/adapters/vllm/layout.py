"""vLLM's paged KV layouts, the CPU backend's and the GPU backends' (FlashAttention,
FlashInfer), and their conversion to the sidecar's.

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

Other CPU ISAs (neon, vxe, vsx, rvv: untested) lay blocks out differently; the probe
refuses to start rather than misread them.

**GPU backends** (vLLM 0.32 and 0.33, FlashAttention and FlashInfer). Older vLLM allocated
``(2, num_blocks, block_size, kv_heads, head_dim)`` per layer and named the physical order
with ``get_kv_cache_stride_order``; 0.32 and 0.33 no longer have either. Every layer now gets
a *logical* ``[B, H, N, C]`` view (blocks, heads, tokens, content: K's ``head_dim`` values
then V's) over one byte allocation, with the physical order one of the ``KVCacheLayout``
stride permutations of ``[L, B, H, N, C]`` (``LBNHC`` = the old "NHD", ``LBHNC`` = "HND",
``BLNHC``/``BLHNC``/``BHLNC`` interleave layers inside a block; vllm/v1/kv_cache_layout.py),
resolved once by the engine core from the backends' ``supported_kv_cache_layouts`` and
``VLLM_KV_CACHE_LAYOUT``. Both backends split the view the same way
(``kv_cache.transpose(1, 2).split(head_size, dim=-1)``), so one decoder reads them all; what
it checks is that the view's strides are the ones the layout vLLM *reports* implies (never a
guess from the shape), and it refuses quantised caches (fp8, nvfp4: K and V as separate head
slots), kernel-split blocks and any other backend. A block is read where it lives (a view,
then one device-side copy); nothing goes to the host here.

**Tensor parallelism**: each worker holds ``kv_heads / tp`` heads (rank ``r`` heads
``r*per .. (r+1)*per``), or, with fewer KV heads than ranks, one replicated head
``r * kv_heads // tp`` (vLLM's ``QKVParallelLinear`` rule); :func:`merge_tp_shards` puts the
ranks' blocks back into the model's heads.
"""

from __future__ import annotations

import itertools
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


def cpu_block_views(layers: Sequence[torch.Tensor], block_id: int, block_size: int,
                    isa: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, views of one block's K and V as ``(kv_heads, block_size, head_dim)`` in
    token order (no copy: a copy of each view, e.g. into a capture slot, decodes it).
    ``isa``: the kernel that wrote the block, by default the one vLLM picks for the caches'
    dtype and shape."""
    out = []
    for t in layers:
        blk = t[block_id]  # (H, bs, 2D)
        h, bs, two_d = blk.shape
        d = two_d // 2
        kind = isa or cpu_attn_isa(blk.dtype, block_size, d)
        flat = blk.reshape(h, 2 * bs * d)
        k_raw, v_raw = flat[:, : bs * d], flat[:, bs * d:]
        if kind == "amx":
            r = _AMX_ROWS
            out.append((k_raw.reshape(h, bs // r, d // 2, r, 2).permute(0, 1, 3, 2, 4)
                        .reshape(h, bs, d),
                        v_raw.reshape(h, d // r, bs // 2, r, 2).permute(0, 2, 4, 1, 3)
                        .reshape(h, bs, d)))
        else:
            out.append((k_raw.reshape(h, d, bs).transpose(1, 2), v_raw.reshape(h, bs, d)))
    return out


def decode_cpu_block(layers: Sequence[torch.Tensor], block_id: int, block_size: int,
                     isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one block for ``layers``, each ``(layers, kv_heads, block_size, head_dim)``,
    copied (the engine may reuse the block the moment we return); see
    :func:`cpu_block_views`."""
    return stack_views(cpu_block_views(layers, block_id, block_size, isa))


def stack_views(views: Sequence[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer K and V views stacked into fresh ``(layers, ...)`` tensors (one copy)."""
    return torch.stack([k for k, _ in views]), torch.stack([v for _, v in views])


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


# --------------------------------------------------------------------------- GPU backends
# The attention backends (``AttentionBackend.get_name()``) whose blocks the decoders read.
CPU_BACKEND = "CPU_ATTN"
GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
# vLLM's KVCacheLayout members: the physical order of the logical [L, B, H, N, C] axes.
STRIDE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
_LEGACY_LAYOUT_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}  # VLLM_KV_CACHE_LAYOUT aliases
_DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def layer_view_order(layout: str) -> tuple[int, ...]:
    """Physical order of the per-layer ``[B, H, N, C]`` view's axes for ``layout``."""
    order = STRIDE_LAYOUTS[_LEGACY_LAYOUT_NAMES.get(layout, layout)]
    return tuple(i - 1 for i in order if i != 0)


def validate_gpu_layout(kv_caches: Mapping[str, torch.Tensor], block_size: int,
                        backend: str, layout: str | None) -> None:
    """Refuse (:class:`UnsupportedLayout`, with what was found) unless every cache is the
    ``[B, H, block_size, 2*head_dim]`` view of a dense dtype with the strides ``layout``
    (the KVCacheLayout vLLM resolved) implies, written by a backend decoded here."""
    if not kv_caches:
        raise UnsupportedLayout("kv-sidecar probe: the engine registered no KV caches")
    if backend not in GPU_BACKENDS:
        raise UnsupportedLayout(
            f"kv-sidecar probe: vLLM reports attention backend {backend!r}, whose KV layout "
            f"is untested; supported: {', '.join((CPU_BACKEND, *GPU_BACKENDS))}.")
    name = _LEGACY_LAYOUT_NAMES.get(layout or "", layout)
    if name not in STRIDE_LAYOUTS:
        raise UnsupportedLayout(
            f"kv-sidecar probe: vLLM reports KV cache layout {layout!r}; known: "
            f"{', '.join(STRIDE_LAYOUTS)}.")
    order = layer_view_order(name)
    for cache_name, t in kv_caches.items():
        if t.dim() != 4 or t.shape[2] != block_size or t.shape[3] % 2:
            raise UnsupportedLayout(
                f"kv-sidecar probe: KV cache {cache_name!r} has shape {tuple(t.shape)}; "
                f"expected vLLM's per-layer view (num_blocks, kv_heads, {block_size}, "
                "2*head_dim) (kernel-split blocks and packed K/V head slots are untested).")
        if t.dtype not in _DENSE_DTYPES:
            raise UnsupportedLayout(
                f"kv-sidecar probe: KV cache {cache_name!r} is stored as {t.dtype} (a "
                "quantised KV cache); only float16, bfloat16 and float32 caches are read.")
        if not _strides_follow(t, order):
            raise UnsupportedLayout(
                f"kv-sidecar probe: KV cache {cache_name!r} has strides {t.stride()}, not "
                f"those of the {name} layout vLLM reports for backend {backend}.")


def _strides_follow(t: torch.Tensor, order: Sequence[int]) -> bool:
    """The view's axes, outermost first in ``order``, have decreasing strides (size-1 axes
    aside, their stride is arbitrary) and the content axis is dense."""
    if t.stride(3) != 1 and t.shape[3] > 1:
        return False
    strides = [t.stride(d) for d in order if t.shape[d] > 1]
    return all(a > b for a, b in itertools.pairwise(strides))


def gpu_block_views(layers: Sequence[torch.Tensor], block_id: int
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, views of one block's K and V as ``(kv_heads, block_size, head_dim)`` in
    vLLM's ``[B, H, N, 2D]`` views (any stride layout); no copy."""
    out = []
    for t in layers:
        blk = t[block_id]
        d = blk.shape[-1] // 2
        out.append((blk[..., :d], blk[..., d:]))
    return out


def decode_gpu_block(layers: Sequence[torch.Tensor], block_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one block for ``layers``, each ``(layers, kv_heads, block_size, head_dim)``:
    a copy on the caches' own device (the engine may reuse the block once we return)."""
    return stack_views(gpu_block_views(layers, block_id))


def encode_gpu_block(view: torch.Tensor, block_id: int, key: torch.Tensor,
                     value: torch.Tensor) -> None:
    """Write one layer's ``(H, bs, D)`` K and V into block ``block_id`` of a ``[B, H, N,
    2D]`` view, addressed the way the FlashAttention/FlashInfer backends split it (tests)."""
    d = key.shape[-1]
    key_cache, value_cache = view.transpose(1, 2).split(d, dim=-1)  # (B, N, H, D) each
    key_cache[block_id] = key.transpose(0, 1)
    value_cache[block_id] = value.transpose(0, 1)


def tp_kv_heads(rank: int, tp_size: int, total_kv_heads: int) -> range:
    """The model's KV heads TP rank ``rank`` of ``tp_size`` holds (vLLM's QKVParallelLinear
    sharding: a contiguous slice, or one replicated head when heads < ranks)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"TP rank {rank} outside 0..{tp_size - 1}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over TP={tp_size}")
        per = total_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % total_kv_heads:
        raise ValueError(f"TP={tp_size} is not a multiple of {total_kv_heads} KV heads")
    head = rank * total_kv_heads // tp_size
    return range(head, head + 1)


def merge_tp_shards(shards: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    total_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's K and V over all the model's heads from each TP rank's decoded block
    (rank order), ``(layers, heads, bs, D)``; a replicated head is taken from its first
    holder."""
    tp = len(shards)
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    for rank, (k, v) in enumerate(shards):
        heads = tp_kv_heads(rank, tp, total_kv_heads)
        if k.shape[1] != len(heads):
            raise UnsupportedLayout(f"TP rank {rank} holds {k.shape[1]} KV heads, expected "
                                    f"{len(heads)} of {total_kv_heads} over TP={tp}")
        for i, h in enumerate(heads):
            keys.setdefault(h, k[:, i])
            values.setdefault(h, v[:, i])
    return (torch.stack([keys[h] for h in range(total_kv_heads)], dim=1),
            torch.stack([values[h] for h in range(total_kv_heads)], dim=1))


def validate_layout(kv_caches: Mapping[str, torch.Tensor], block_size: int,
                    backend: str = CPU_BACKEND, layout: str | None = None) -> None:
    """The check the probe runs at ``register_kv_caches``: the CPU or a GPU backend's."""
    if backend == CPU_BACKEND:
        validate_cpu_layout(kv_caches, block_size)
    else:
        validate_gpu_layout(kv_caches, block_size, backend, layout)


def block_views(layers: Sequence[torch.Tensor], block_id: int, block_size: int,
                backend: str = CPU_BACKEND) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer K and V views of one block, decoded by the backend that wrote it."""
    if backend == CPU_BACKEND:
        return cpu_block_views(layers, block_id, block_size)
    return gpu_block_views(layers, block_id)


def decode_block(layers: Sequence[torch.Tensor], block_id: int, block_size: int,
                 backend: str = CPU_BACKEND) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the decoder of the backend that wrote it (copied)."""
    return stack_views(block_views(layers, block_id, block_size, backend))


def reported_layout(vllm_config: object, layer_names: Sequence[str]) -> tuple[str, str | None]:
    """(attention backend, KVCacheLayout name) as vLLM reports them for these layers: the
    backend every layer's ``get_attn_backend()`` names and the layout the engine core
    resolved (``cache_config.kv_cache_layout``). Layers on different backends, or none
    reported, refuse to start: the decoder is never guessed from a tensor's shape. State
    layers of hybrids (Mamba/conv: no paged K/V) are not attention KV and are left out."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    names = {layer.get_attn_backend().get_name() for layer in layers.values()
             if not isinstance(layer, MambaBase)}
    if len(names) != 1:
        raise UnsupportedLayout(f"kv-sidecar probe: the KV cache layers report attention "
                                f"backends {sorted(names)}; expected exactly one")
    cache_config = getattr(vllm_config, "cache_config", None)
    return names.pop(), getattr(cache_config, "kv_cache_layout", None)
