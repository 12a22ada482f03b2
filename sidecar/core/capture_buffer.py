"""Capture at match time into a bounded, preallocated buffer, on the device that holds the KV.

A sampled hit's blocks are copied the moment the engine serves them, so what the request
read is what gets verified, whatever the engine does to the blocks afterwards. The copy must
not allocate on the engine's thread (an allocator call per sample in a hot hook) nor grow
without bound when the verifier falls behind, so the buffer holds a fixed number of block
slots, allocated once; a capture that finds too few free slots is refused (counted in
:attr:`CaptureBuffer.refused`; the sample is then verified from a later read, not lost).

A slot is free again when the last reference to the views it handed out is gone (the
verifier dropped the sample): the views carry the lease and a finalizer returns the slot, so
nothing else in the sidecar needs to know the buffer exists.

On CUDA the copy is asynchronous on a side stream: an event recorded on the engine's
current stream (after the kernel that wrote the blocks) is waited on by the side stream, the
copy is queued there, and the engine's stream then waits on the copy's own event, so no
later kernel of the engine (a reuse of the block) and no check reading the slot (the
verifier queues on the same current stream) can run before the copy finished. The host
never waits. A reader on another host thread (the vLLM probe's shipper) calls
:func:`wait_copied` on a slot before reading it on the host: it waits for that copy only,
never for the engine's stream. That is the only CUDA-specific code (:meth:`_copy_cuda`);
slot accounting, leases and the CPU path are shared, and run on "meta" tensors too.

A block's K (or V) is given either as one tensor of the slot's shape or as one tensor per
layer (views into the engine's paged layout, e.g. transposed or tile-packed): the copy into
the slot then decodes the layout in the same pass, with no intermediate tensor.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

Block = tuple[torch.Tensor, torch.Tensor]  # (key, value), each (layers, heads, bs, dim)
Part = torch.Tensor | Sequence[torch.Tensor]  # one K or V: a tensor, or one per layer
SourceBlock = tuple[Part, Part]


class _Lease:
    """Holds slots until every view handed out for them is collected."""

    __slots__ = ("__weakref__", "copied", "slots")

    def __init__(self, slots: list[int]) -> None:
        self.slots = slots
        self.copied: torch.cuda.Event | None = None  # the side stream's copy (CUDA only)


def wait_copied(slot: torch.Tensor) -> None:
    """Block this host thread until the copy into ``slot`` is done (CUDA: that copy's own
    event; CPU: the copy was done when ``capture`` returned). Call before reading a slot on
    another thread than the engine's."""
    lease = getattr(slot, "_kvsidecar_lease", None)
    if lease is not None and lease.copied is not None:
        lease.copied.synchronize()


def _shape(part: Part) -> tuple[int, ...]:
    if isinstance(part, torch.Tensor):
        return tuple(part.shape)
    shapes = {tuple(p.shape) for p in part}
    return (len(part), *shapes.pop()) if len(shapes) == 1 else (len(part), -1)


def _copy(dst: torch.Tensor, src: Part, non_blocking: bool = False) -> None:
    if isinstance(src, torch.Tensor):
        dst.copy_(src, non_blocking=non_blocking)
    else:
        for layer, part in enumerate(src):
            dst[layer].copy_(part, non_blocking=non_blocking)


class CaptureBuffer:
    """``slots`` block-sized K and V slots of ``block_shape`` and ``dtype`` on ``device``."""

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str, slots: int) -> None:
        if slots <= 0:
            raise ValueError("a capture buffer needs at least one slot")
        self.device = torch.device(device)
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.key = torch.empty((slots, *self.block_shape), dtype=dtype, device=self.device)
        self.value = torch.empty_like(self.key)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.captured = 0  # blocks copied
        self.refused = 0  # captures refused for want of free slots
        self._side: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._side = torch.cuda.Stream(device=self.device)

    @property
    def num_slots(self) -> int:
        return int(self.key.shape[0])

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def slot_bytes(self) -> int:
        return 2 * self.key[0].numel() * self.key.element_size()

    def capture(self, blocks: Sequence[SourceBlock]) -> list[Block] | None:
        """Copies of ``blocks`` in buffer slots (views that hold the slots until collected),
        or ``None`` when fewer than ``len(blocks)`` slots are free (nothing is copied)."""
        for key, value in blocks:
            if _shape(key) != self.block_shape or _shape(value) != self.block_shape:
                raise ValueError(f"block of shape {_shape(key)} in a capture buffer of "
                                 f"{self.block_shape}")
        with self._lock:
            if len(blocks) > len(self._free):
                self.refused += 1
                return None
            slots = [self._free.pop() for _ in blocks]
        lease = _Lease(slots)
        weakref.finalize(lease, self._release, slots)
        pairs = [(self.key[s], self.value[s], k, v) for s, (k, v) in zip(slots, blocks,
                                                                          strict=True)]
        if self._side is not None:
            lease.copied = self._copy_cuda(pairs)
        else:
            for dk, dv, k, v in pairs:
                _copy(dk, k)
                _copy(dv, v)
        out: list[Block] = []
        for dk, dv, _, _ in pairs:
            dk._kvsidecar_lease = lease  # type: ignore[attr-defined]
            dv._kvsidecar_lease = lease  # type: ignore[attr-defined]
            out.append((dk, dv))
        self.captured += len(out)
        return out

    def _copy_cuda(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor, Part, Part]]
                   ) -> torch.cuda.Event:
        """Side-stream copy ordered after the engine's write and before anything the
        engine's stream queues next (a reuse of the block, a check of the slot)."""
        assert self._side is not None
        engine = torch.cuda.current_stream(self.device)
        written = torch.cuda.Event()
        written.record(engine)
        self._side.wait_event(written)
        with torch.cuda.stream(self._side):
            for dk, dv, k, v in pairs:
                _copy(dk, k, non_blocking=True)
                _copy(dv, v, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._side)
        engine.wait_event(copied)
        return copied

    def _release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)
