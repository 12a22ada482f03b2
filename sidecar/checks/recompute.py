"""Recompute-and-compare: the cached block against a from-scratch computation, dtype-aware.

The metric is scale-free (see :mod:`sidecar.checks.tolerance`): ``max|cached - ref| / rms(ref)``
over K and V of all the group's layers.

Three passes over the bytes and one temporary of the block's own size, no float32 copies:
the difference in the inputs' dtype (exact where the two are within 2x of each other, else
rounded to the dtype's precision, far below any tolerance), ``aminmax`` of it, and a norm of
the reference (accumulated in float32 by torch). ``kv-sidecar bench perf`` measures it
against a one-pass ``amax`` of the same bytes.

Device-agnostic: the arithmetic runs where the cached block lives (a reference computed
elsewhere is moved there, it is the smaller cost than moving the block) and the three scalars
come back in one transfer, so a CUDA block costs one synchronisation, not three.
"""

from __future__ import annotations

import math

import torch

from sidecar.core.protocol import BlockKV

_EPS = 1e-12


def normalized_error(cached: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|cached - reference| / rms(reference)`` in float32; inf when shapes differ or
    the cached values are not finite."""
    if cached.shape != reference.shape:
        return float("inf")
    if cached.numel() == 0:
        return 0.0
    if reference.device != cached.device:
        reference = reference.to(cached.device)
    lo, hi = torch.aminmax(torch.sub(cached, reference))
    neg_lo, hi_f, norm = torch.stack([-lo.float(), hi.float(),
                                      torch.linalg.vector_norm(reference).float()]).tolist()
    diff = max(neg_lo, hi_f)
    if not math.isfinite(diff):
        return float("inf")
    rms = norm / math.sqrt(reference.numel())
    return diff / (rms + _EPS)


def block_error(cached: BlockKV, reference: BlockKV) -> float:
    """The block's error: the worse of K and V. The verifier compares it with the
    calibrated tolerance and :func:`sidecar.checks.hybrid.explain` names the finding."""
    return max(normalized_error(cached.key, reference.key),
               normalized_error(cached.value, reference.value))

