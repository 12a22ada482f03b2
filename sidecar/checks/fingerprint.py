"""Write-time fingerprints of KV bytes: exact, so they catch what tolerances cannot.

A recompute compare must tolerate rounding noise, so a flipped low mantissa bit or a torn copy
that happens to be close passes it. A digest recorded when the block was written and compared
with a digest of what is read now catches any byte that changed after the write. BLAKE2b over
the raw bytes (no float conversion) keeps it exact and fast; ``kv-sidecar bench`` measures GB/s.
"""

from __future__ import annotations

import hashlib

import torch

from sidecar.checks.base import Finding
from sidecar.protocol import BlockKV
from sidecar.signals import AnomalyKind


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes, without converting values (bf16 has no numpy dtype)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def kv_digest(key: torch.Tensor, value: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(tensor_bytes(key))
    h.update(tensor_bytes(value))
    return h.hexdigest()


def check_fingerprint(block: BlockKV, stored_digest: str | None) -> list[Finding]:
    if stored_digest is None:
        return []
    now = kv_digest(block.key, block.value)
    if now != stored_digest:
        ref = block.ref
        return [Finding(AnomalyKind.FINGERPRINT_MISMATCH, ref.group_id, ref.index,
                        f"KV digest {now[:12]} != digest at store {stored_digest[:12]}")]
    return []
