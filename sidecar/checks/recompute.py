"""Recompute-and-compare: the cached block against a from-scratch computation, dtype-aware.

The metric is scale-free (see :mod:`sidecar.tolerance`): ``max|cached - ref| / rms(ref)``,
computed in float32 over K and V of all the group's layers.
"""

from __future__ import annotations

import torch

from sidecar.checks.base import Finding
from sidecar.protocol import BlockKV
from sidecar.signals import AnomalyKind

_EPS = 1e-12


def normalized_error(cached: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|cached - reference| / rms(reference)`` in float32; inf when shapes differ or
    the cached values are not finite."""
    if cached.shape != reference.shape:
        return float("inf")
    a = cached.float()
    b = reference.float()
    diff = (a - b).abs().max()
    if not bool(torch.isfinite(diff)):
        return float("inf")
    rms = b.pow(2).mean().sqrt()
    return float(diff / (rms + _EPS))


def block_error(cached: BlockKV, reference: BlockKV) -> float:
    return max(normalized_error(cached.key, reference.key),
               normalized_error(cached.value, reference.value))


def check_recompute(cached: BlockKV, reference: BlockKV, tolerance: float) -> list[Finding]:
    err = block_error(cached, reference)
    if err > tolerance:
        ref = cached.ref
        return [Finding(AnomalyKind.RECOMPUTE_MISMATCH, ref.group_id, ref.index,
                        f"normalized error {err:.3g} > tolerance {tolerance:.3g}", err)]
    return []
