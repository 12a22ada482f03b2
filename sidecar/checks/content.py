"""Content statistics: all zeros, NaN/Inf, no spread. No reference needed, so they run on
every sample and catch the "98% hit rate, all zeros" trap (seed 000 §4.2) on their own.

About one pass over the bytes, no full-size temporaries (``kv-sidecar bench perf`` measures
it against a one-pass ``amax``):

* non-finite: one float32-accumulated ``sum`` — NaN and Inf propagate into it, so a finite
  sum proves every element finite; only a non-finite sum (or a float32 overflow of huge
  finite values) pays for the exact element count;
* zeros: ``count_nonzero`` over a fixed stride of the elements (64k of them), exact when
  the sampled ratio is anywhere near the limit;
* no spread: the first and last token rows compared; only identical ones pay for the full
  per-head check.
"""

from __future__ import annotations

import math

import torch

from sidecar.checks.base import Finding
from sidecar.core.protocol import BlockKV
from sidecar.signals import AnomalyKind

# A real K/V block has essentially no exact zeros; a zeroed or uninitialised block has
# (almost) only zeros. Half is far from both.
ZERO_RATIO_LIMIT = 0.5
_ZERO_SAMPLE = 65_536  # elements looked at for the zero ratio
_ZERO_EXACT_BAND = 0.25  # sampled ratio within this of the limit: count them all


def check_content(block: BlockKV) -> list[Finding]:
    ref = block.ref
    out: list[Finding] = []
    for name, t in (("key", block.key), ("value", block.value)):
        n = t.numel()
        if n == 0:
            continue
        if not math.isfinite(float(torch.sum(t, dtype=torch.float32))):
            bad = n - int(torch.isfinite(t).sum())
            if bad:
                out.append(Finding(AnomalyKind.NONFINITE, ref.group_id, ref.index,
                                   f"{name}: {bad}/{n} elements are NaN or Inf", bad / n))
                continue
        zero_ratio = _zero_ratio(t)
        if zero_ratio >= ZERO_RATIO_LIMIT:
            out.append(Finding(AnomalyKind.ZEROS, ref.group_id, ref.index,
                               f"{name}: zero ratio {zero_ratio:.3f}", zero_ratio))
            continue
        if _degenerate(t):
            out.append(Finding(AnomalyKind.DEGENERATE, ref.group_id, ref.index,
                               f"{name}: no spread across the block's tokens"))
    return out


def _zero_ratio(t: torch.Tensor) -> float:
    flat = t.reshape(-1)
    n = flat.numel()
    stride = max(1, n // _ZERO_SAMPLE)
    if stride > 1:
        sample = flat[::stride]
        ratio = 1.0 - int(torch.count_nonzero(sample)) / sample.numel()
        if abs(ratio - ZERO_RATIO_LIMIT) > _ZERO_EXACT_BAND:
            return ratio
    return 1.0 - int(torch.count_nonzero(flat)) / n


def _degenerate(t: torch.Tensor) -> bool:
    """Every token of a head carries the same vector (one row broadcast over the block, a
    memset to a constant); a one-token block: every element of the row the same."""
    if t.shape[-2] > 1:
        if not torch.equal(t[..., 0, :], t[..., -1, :]):
            return False
        return bool((t == t[..., :1, :]).all())
    return bool((t == t[..., :1]).all())
