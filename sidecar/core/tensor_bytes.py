"""A tensor's raw bytes: the one byte view the digests, the probe's wire and evidence files use.

numpy has no bfloat16 (nor float8), so a tensor's bytes cannot come from ``t.numpy()``;
viewing the flat, contiguous, host copy as ``uint8`` gives the exact bytes in C order for
every dtype, bool included, without converting a value. Zero-copy where the tensor already is
a contiguous host tensor (a digest then reads the engine's bytes in place).
"""

from __future__ import annotations

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """``t``'s bytes in C order, any dtype; a device tensor is copied to the host first."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
