"""Content statistics: all zeros, NaN/Inf, no spread. No reference needed, so they run on
every sample and catch the "98% hit rate, all zeros" trap (seed 000 §4.2) on their own."""

from __future__ import annotations

import torch

from sidecar.checks.base import Finding
from sidecar.protocol import BlockKV
from sidecar.signals import AnomalyKind

# A real K/V block has essentially no exact zeros; a zeroed or uninitialised block has
# (almost) only zeros. Half is far from both.
ZERO_RATIO_LIMIT = 0.5


def check_content(block: BlockKV) -> list[Finding]:
    ref = block.ref
    out: list[Finding] = []
    for name, t in (("key", block.key), ("value", block.value)):
        if t.numel() == 0:
            continue
        f = t.float()
        finite = torch.isfinite(f)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            out.append(Finding(AnomalyKind.NONFINITE, ref.group_id, ref.index,
                               f"{name}: {bad}/{t.numel()} elements are NaN or Inf",
                               bad / t.numel()))
            continue
        zero_ratio = float((f == 0).float().mean())
        if zero_ratio >= ZERO_RATIO_LIMIT:
            out.append(Finding(AnomalyKind.ZEROS, ref.group_id, ref.index,
                               f"{name}: zero ratio {zero_ratio:.3f}", zero_ratio))
            continue
        # Degenerate: every token of a head carries the same vector (e.g. one row broadcast
        # over the block, or a memset to a constant).
        spread = f.std(dim=-2) if f.shape[-2] > 1 else f.std(dim=-1)
        if bool((spread == 0).all()):
            out.append(Finding(AnomalyKind.DEGENERATE, ref.group_id, ref.index,
                               f"{name}: no spread across the block's tokens"))
    return out
