"""SGLang's slot ids as the tap reads them: NumPy views, packed bitmaps, block names.

A torch op on a handful of slots costs microseconds of dispatch, on every allocation and
free of SGLang's scheduler thread, so the tap does its slot bookkeeping in NumPy; a census
ships each slot set as a bitmap (``slots / 8`` bytes)."""

from __future__ import annotations

import numpy as np
import torch

NULL_SLOT = 0  # SGLang's padding slot; an SWA mapping of 0 means "no SWA slot" (tombstoned)


def bitmap(slots: torch.Tensor | np.ndarray, size: int) -> bytes:
    """``slots`` (ids in ``[0, size)``) as a packed bitmap of ``size`` bits."""
    bits = np.zeros(size, dtype=bool)
    ids = slot_array(slots)
    if ids.size:
        bits[ids] = True
    return packed(bits)


def packed(mask: np.ndarray) -> bytes:
    """A boolean mask of slots as the census ships it (:func:`bitmap`'s bytes)."""
    return bytes(np.packbits(mask).tobytes())


def block_names(slots: torch.Tensor, block_size: int) -> list[int]:
    """Each full block of ``slots`` named by its last slot; the null slot where any of its
    slots is null (an SWA block SGLang tombstoned, whole or in part)."""
    blocks = slots.reshape(-1, block_size)
    present = (blocks != NULL_SLOT).all(dim=1)
    return [int(b) for b in torch.where(present, blocks[:, -1], NULL_SLOT).tolist()]


def slot_array(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """Slot ids as a flat int64 NumPy array (a CPU tensor's memory is shared, not copied).
    SGLang's slot tensors are CPU int64 without grad here: ``numpy()`` on them directly
    (0.6 us; detach, reshape and cpu first cost 2.3 us on every allocation and free)."""
    if isinstance(slots, np.ndarray):
        arr = slots
    else:
        try:
            arr = slots.numpy()
        except (RuntimeError, TypeError):  # on a GPU, or needing grad
            arr = slots.detach().cpu().numpy()
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)
