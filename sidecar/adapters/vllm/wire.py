"""Messages from the in-engine probe to the sidecar (msgpack over a ZMQ PUSH/PULL pipe).

Both ends import this module; it needs torch and msgpack, never vLLM. The probe pushes with
``NOBLOCK`` onto a bounded pipe (a full pipe drops the message and counts it, the engine
never waits), the sidecar binds the PULL end. Every message is a map with ``v`` (this
protocol's version) and ``kind``:

* ``hello``: what the engine is (vLLM version, block size, dtype, KV heads, head size, layers
  per cache group), sent when the worker registers its KV caches;
* ``lookups``: ``[[query_tokens, hit_tokens], ...]`` for prefix lookups of one engine step
  that were *not* sampled;
* ``capture``: one sampled hit (``role="hit"``, also counted as a lookup) or one engine-side
  reference recompute (``role="reference"``, tagged with the cache salt the sidecar chose):
  prompt tokens, hit length, block ids per group, and the K/V of the chosen blocks, as raw
  bytes.

Every message also carries ``src`` (which pipe sent it) and ``dropped`` (how many messages
that pipe has dropped so far), so the sidecar can count what was lost on the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from sidecar.protocol import BlockKV, BlockRef

PROTOCOL_VERSION = 1
REFERENCE_SALT_PREFIX = "kvsidecar-ref:"


def pack(kind: str, src: str = "", dropped: int = 0, **fields: Any) -> bytes:
    """``src`` names the sending pipe (each probe half has its own); ``dropped`` is how many
    messages that pipe has dropped so far."""
    return bytes(msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, "src": src,
                                "dropped": dropped, **fields}, use_bin_type=True))


def unpack(data: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION or "kind" not in msg:
        raise ValueError(f"not a kv-sidecar probe message (protocol {PROTOCOL_VERSION})")
    return msg


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of ``t`` (any dtype, bfloat16 included) in C order."""
    return bytes(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def tensor_from(data: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(tuple(shape))


def reference_salt(capture_id: str, indices: Sequence[int]) -> str:
    """The cache salt of an engine-side recompute: unique (so it can never hit the cache)
    and naming the block indices the probe must read back."""
    return f"{REFERENCE_SALT_PREFIX}{capture_id}:{','.join(str(i) for i in indices)}"


def parse_reference_salt(salt: str | None) -> list[int] | None:
    """Block indices wanted by a reference salt, or ``None`` for any other salt."""
    if not salt or not salt.startswith(REFERENCE_SALT_PREFIX):
        return None
    try:
        return [int(i) for i in salt.rsplit(":", 1)[1].split(",") if i]
    except ValueError:
        return None


@dataclass(frozen=True)
class Capture:
    """A decoded ``capture`` message: blocks of one hit (or one reference recompute)."""

    capture_id: str
    role: str
    salt: str | None
    tokens: tuple[int, ...]
    query_tokens: int
    hit_tokens: int
    blocks: dict[int, list[int]]
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]  # (group, index) -> K, V

    def block_kv(self, ref: BlockRef) -> BlockKV | None:
        kv = self.kv.get((ref.group_id, ref.index))
        return None if kv is None else BlockKV(ref, kv[0], kv[1])


def capture_fields(capture_id: str, role: str, salt: str | None, tokens: Sequence[int],
                   query_tokens: int, hit_tokens: int, blocks: dict[int, list[int]],
                   kv: Sequence[tuple[int, int, int, torch.Tensor, torch.Tensor]]
                   ) -> dict[str, Any]:
    """Fields of a ``capture`` message. ``kv``: ``(group, index, block_id, K, V)`` with K
    and V of shape (layers, kv_heads, block_size, head_dim)."""
    return dict(id=capture_id, role=role, salt=salt,
                tokens=[int(t) for t in tokens], query_tokens=int(query_tokens),
                hit_tokens=int(hit_tokens),
                blocks={int(g): [int(b) for b in ids] for g, ids in blocks.items()},
                kv=[[g, i, b, str(k.dtype).removeprefix("torch."), list(k.shape),
                     tensor_bytes(k), tensor_bytes(v)] for g, i, b, k, v in kv])


def decode_capture(msg: dict[str, Any]) -> Capture:
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for g, i, _b, dtype, shape, kb, vb in msg["kv"]:
        kv[(int(g), int(i))] = (tensor_from(kb, dtype, shape), tensor_from(vb, dtype, shape))
    return Capture(str(msg["id"]), str(msg["role"]), msg.get("salt"),
                   tuple(msg["tokens"]), int(msg["query_tokens"]), int(msg["hit_tokens"]),
                   {int(g): list(ids) for g, ids in msg["blocks"].items()}, kv)
