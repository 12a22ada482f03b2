"""Structure checks: the block has the shape, dtype and layout the engine described.

Catches layout mismatches (K/V swapped into the wrong view, heads transposed, a wrong dtype
view) before any arithmetic is spent on them.
"""

from __future__ import annotations

import torch

from sidecar.checks.base import Finding
from sidecar.protocol import BlockKV, EngineInfo
from sidecar.signals import AnomalyKind


def check_structure(block: BlockKV, info: EngineInfo, n_layers: int) -> list[Finding]:
    ref = block.ref
    expected = (n_layers, info.num_kv_heads, info.block_size, info.head_dim)
    out: list[Finding] = []
    for name, t in (("key", block.key), ("value", block.value)):
        if tuple(t.shape) != expected:
            out.append(Finding(AnomalyKind.STRUCTURE, ref.group_id, ref.index,
                               f"{name} shape {tuple(t.shape)} != expected {expected}"))
            continue
        if dtype_name(t) != info.dtype:
            out.append(Finding(AnomalyKind.STRUCTURE, ref.group_id, ref.index,
                               f"{name} dtype {t.dtype} != engine dtype {info.dtype}"))
        if t.numel() and t.stride()[-1] != 1:
            out.append(Finding(AnomalyKind.STRUCTURE, ref.group_id, ref.index,
                               f"{name} innermost stride {t.stride()[-1]} != 1 (wrong view)"))
        if not t.is_floating_point():
            out.append(Finding(AnomalyKind.STRUCTURE, ref.group_id, ref.index,
                               f"{name} is not floating point ({t.dtype})"))
    return out


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
