"""Content statistics: all zeros, NaN/Inf, no spread. No reference needed, so they run on
every sample and catch the "98% hit rate, all zeros" trap (seed 000 §4.2) on their own.

About one pass over the bytes, no full-size temporaries (``kv-sidecar bench perf`` measures
it against a raw one-pass read of the same bytes; target >= 0.5 of it):

* non-finite, on a CPU tensor of a float dtype in :data:`_NONFINITE_BITS`: two integer
  maxima over its bits (numpy, vectorised; no float conversion). A value is NaN or Inf
  exactly when its magnitude bits are at least the exponent mask's, so the signed view's
  maximum finds a positive one and the unsigned view's maximum a negative one. Elsewhere (a
  GPU tensor, another dtype): one float32-accumulated ``sum`` (NaN and Inf propagate into
  it, so a finite sum proves every element finite; a float32 overflow of huge finite values
  pays for the exact count). Only a block that has some pays for the exact count;
* zeros: ``count_nonzero`` over 256 runs of 32 elements (8k of them) drawn at random,
  once per block shape (every layer, head, token and dimension sampled in proportion;
  evenly spaced runs, or any arithmetic rule, see one head or one token of every layer on
  some shape), exact when the sampled ratio is anywhere near the limit;
* no spread: the first head's first and last token rows compared; only identical ones pay
  for the full per-head check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from sidecar.checks.base import Finding
from sidecar.core.protocol import BlockKV
from sidecar.signals import AnomalyKind

# A real K/V block has essentially no exact zeros; a zeroed or uninitialised block has
# (almost) only zeros. Half is far from both.
ZERO_RATIO_LIMIT = 0.5
_ZERO_SAMPLE = 8_192  # elements looked at for the zero ratio
_ZERO_RUN = 32  # ... in runs of this many (a cache line of bf16: a strided pick is 2x slower)
_ZERO_EXACT_BAND = 0.25  # sampled ratio within this of the limit: count them all

# float dtype -> (signed view, unsigned view, the bits of the smallest positive NaN/Inf:
# the exponent mask, or e4m3fn's only NaN, which has no Inf).
_NONFINITE_BITS: dict[torch.dtype, tuple[torch.dtype, type[np.unsignedinteger], int]] = {
    torch.float32: (torch.int32, np.uint32, 0x7F80_0000),
    torch.float64: (torch.int64, np.uint64, 0x7FF0_0000_0000_0000),
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80),
    torch.float16: (torch.int16, np.uint16, 0x7C00),
    torch.float8_e4m3fn: (torch.int8, np.uint8, 0x7F),
    torch.float8_e5m2: (torch.int8, np.uint8, 0x7C),
}


def check_content(block: BlockKV, tokens: Sequence[int] = (), block_size: int = 0
                  ) -> list[Finding]:
    """Zeros, NaN/Inf and no spread across the block's tokens, in K and in V. ``tokens``
    (the hit's) and ``block_size`` name the block's own tokens: where they are one token
    repeated, rows alike are no finding (the V of a model's only layer, or of a group of
    one first layer, depends on the token alone: a clean one-layer run flagged them)."""
    ref = block.ref
    out: list[Finding] = []
    own = tokens[ref.index * block_size:(ref.index + 1) * block_size] if block_size else ()
    one_token = len(own) > 1 and len(set(own)) == 1
    for name, t in (("key", block.key), ("value", block.value)):
        n = t.numel()
        if n == 0:
            continue
        bits = _bits(t)
        if bits is None and t.is_floating_point() and t.element_size() == 1:
            t = t.float()  # another fp8 (ROCm's fnuz): torch reduces none of them
        if _may_be_nonfinite(t, bits):
            bad = _nonfinite_count(t, bits)
            if bad:
                out.append(Finding(AnomalyKind.NONFINITE, ref.group_id, ref.index,
                                   f"{name}: {bad}/{n} elements are NaN or Inf", bad / n))
                continue
        zero_ratio = _zero_ratio(t, bits)
        if zero_ratio >= ZERO_RATIO_LIMIT:
            out.append(Finding(AnomalyKind.ZEROS, ref.group_id, ref.index,
                               f"{name}: zero ratio {zero_ratio:.3f}", zero_ratio))
            continue
        if n > 1 and not (one_token and t.dim() >= 2 and t.shape[-2] > 1) \
                and _degenerate(t, bits):
            out.append(Finding(AnomalyKind.DEGENERATE, ref.group_id, ref.index,
                               f"{name}: no spread across the block's tokens"))
    return out


def _bits(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s elements as signed integers of their width, without a copy; ``None`` off the
    CPU or for a dtype without a known NaN/Inf bit pattern."""
    spec = _NONFINITE_BITS.get(t.dtype)
    if spec is None or t.device.type != "cpu":
        return None
    return (t.detach() if t.requires_grad else t).view(spec[0]).numpy()


def _may_be_nonfinite(t: torch.Tensor, bits: np.ndarray | None) -> bool:
    """Exact where ``bits`` (:func:`_bits`) are given; elsewhere True also for a sum that
    overflowed float32 (the caller counts exactly)."""
    if bits is None:
        return not math.isfinite(float(torch.sum(t, dtype=torch.float32)))
    _, unsigned, lowest = _NONFINITE_BITS[t.dtype]
    negative_lowest = (_magnitude(bits) + 1) | lowest  # the same with the sign bit set
    return bool(bits.max() >= lowest or bits.view(unsigned).max() >= negative_lowest)


def _nonfinite_count(t: torch.Tensor, bits: np.ndarray | None) -> int:
    """The exact count (paid only by a block that may have some; by bits where given:
    torch has no ``isfinite`` for fp8)."""
    if bits is None:
        return t.numel() - int(torch.isfinite(t).sum())
    lowest = _NONFINITE_BITS[t.dtype][2]
    return int(np.count_nonzero((bits & _magnitude(bits)) >= lowest))


def _magnitude(bits: np.ndarray) -> int:
    """The mask of every bit but the sign."""
    return (1 << (8 * bits.itemsize - 1)) - 1


def _zero_ratio(t: torch.Tensor, bits: np.ndarray | None) -> float:
    """The share of elements that are +0 or -0: from the sampled runs, or counted exactly
    when the sample is near the limit (or the tensor small). By bits where given (a
    strided view copied first; -0 masked to 0), else by torch (which counts -0.0 as 0)."""
    n = t.numel()
    flat: Any
    if bits is not None:
        flat, magnitude = np.ascontiguousarray(bits).reshape(-1), _magnitude(bits)

        def zeros(a: Any) -> int:
            return int(a.size) - int(np.count_nonzero(a & magnitude))
    else:
        flat = t.reshape(-1)

        def zeros(a: Any) -> int:
            return int(a.numel()) - int(torch.count_nonzero(a))
    if n >= 2 * _ZERO_SAMPLE:
        runs = flat[:n - n % _ZERO_RUN].reshape(-1, _ZERO_RUN)
        picks = _sampled_runs(len(runs))
        sample = np.take(runs, picks, axis=0) if bits is not None else \
            runs[torch.from_numpy(picks).to(runs.device)]
        ratio = zeros(sample) / (len(picks) * _ZERO_RUN)
        if abs(ratio - ZERO_RATIO_LIMIT) > _ZERO_EXACT_BAND:
            return ratio
    return zeros(flat) / n


@lru_cache(maxsize=64)  # one entry per block shape an engine has
def _sampled_runs(runs: int) -> np.ndarray:
    """Which of ``runs`` runs the zero ratio reads: distinct ones drawn at random (seeded by
    ``runs``, so the same for every block of a shape). Any arithmetic rule aliases with
    some block shape: a golden-ratio sequence saw one half of every head row on 60-layer
    shapes (an outside check: a block half zeros missed, one 49% zeros flagged)."""
    picks = np.random.default_rng(runs).choice(runs, _ZERO_SAMPLE // _ZERO_RUN,
                                               replace=False)
    return np.sort(picks)


def _degenerate(t: torch.Tensor, bits: np.ndarray | None) -> bool:
    """Every token of a head carries the same vector (one row broadcast over the block, a
    memset to a constant); a one-token block: every element of the row the same. The first
    head's first and last rows first (one differing element anywhere answers no); by bits
    where given (no NaN reaches here; a -0 beside a +0 is a spread of zeros, which the zero
    ratio judged first)."""
    if bits is not None:
        if bits.ndim >= 2 and bits.shape[-2] > 1:
            head = bits[(0,) * (bits.ndim - 2)]
            if head[0].tobytes() != head[-1].tobytes():  # ~0.3 us; array_equal ~1.4
                return False
            return bool((bits == bits[..., :1, :]).all())
        return bool((bits == bits[..., :1]).all())
    if t.shape[-2] > 1:
        if not torch.equal(t[..., 0, :], t[..., -1, :]):
            return False
        return bool((t == t[..., :1, :]).all())
    return bool((t == t[..., :1]).all())
