"""Lossy KV storage for the reference pool: int8 with one scale per token row.

Engines that store KV as int8/fp8 keep a scale next to the quantised values and multiply
on read. The reference pool does the same so the sidecar's per-format tolerance
(:data:`sidecar.checks.tolerance.STORAGE_TOLERANCES`) is exercised on real rounding, and so a
*wrong* scale (the quantization-drift fault) produces the error real engines produce.

Granularity: one symmetric scale per (layer, block, head, token slot), i.e. per row of
``head_dim`` values. A per-block scale would have to be fixed when the block's first token
is written (decode fills a block one token at a time) and would clip every later, larger
token; per-row scales keep clean rounding error at ``amax / 254`` of each row.
"""

from __future__ import annotations

import torch

KV_STORAGES: tuple[str, ...] = ("int8",)
INT8_MAX = 127.0
_TINY = 1e-12  # scale floor: an all-zero row quantises to zeros, not NaN


def check_storage(kv_storage: str | None) -> None:
    """Fail early on a storage format the pool does not implement."""
    if kv_storage is not None and kv_storage not in KV_STORAGES:
        raise ValueError(f"unsupported kv_storage {kv_storage!r}; known: "
                         f"{', '.join(KV_STORAGES)} (or None for the model dtype)")


def quantize(x: torch.Tensor, scale_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., head_dim) -> (int8 values, float32 scales of shape (..., 1)).

    ``scale_factor`` multiplies the scale the row needs: 1.0 is the clean quantiser; a
    factor below 1 is a stale, too-small scale (values beyond it saturate at +-127).
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(_TINY) * scale_factor
    q = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 values times their row scales, in the model's dtype."""
    return (q.float() * scale).to(dtype)
