"""Structure checks: the block has the shape, dtype and layout the engine described.

Catches layout mismatches (K/V swapped into the wrong view, heads transposed, a wrong dtype
view) before any arithmetic is spent on them. Per cache group: each group is checked
against its own layer count, so one group's wrong layout names that group only. A recurrent
group's state has no token axis (``(layers, *state_shape)``, the second component possibly
empty): only its layer count, dtype and innermost stride are known up front; its full shape
is compared with the recompute's (see the verifier).
"""

from __future__ import annotations

import torch

from sidecar.checks.base import Finding
from sidecar.core.protocol import BlockKV, EngineInfo, GroupKind
from sidecar.signals import AnomalyKind


def check_structure(block: BlockKV, info: EngineInfo, n_layers: int,
                    kind: GroupKind = GroupKind.FULL_ATTENTION) -> list[Finding]:
    ref = block.ref
    expected = (n_layers, info.num_kv_heads, info.block_size, info.head_dim)
    recurrent = kind is GroupKind.RECURRENT_STATE
    out: list[Finding] = []
    for name, t in (("key", block.key), ("value", block.value)):
        if recurrent and name == "value" and t.numel() == 0:
            continue  # a single-component state
        if recurrent and (t.dim() < 2 or t.shape[0] != n_layers):
            out.append(Finding(AnomalyKind.STRUCTURE, ref.group_id, ref.index,
                               f"{name} state shape {tuple(t.shape)}: expected "
                               f"({n_layers}, ...) for group {ref.group_id}'s layers"))
            continue
        if not recurrent and tuple(t.shape) != expected:
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
