"""Throughput of the write-time fingerprint (:func:`sidecar.checks.fingerprint.kv_digest`).

The digest is taken once per stored block on the engine's side when an adapter enables
fingerprints, so its cost per block matters more than its peak rate: the table gives both,
for a reference-engine block, a block of a mid-size model, and a large buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sidecar.checks.fingerprint import kv_digest

# (what, K shape (layers, kv_heads, block_size, head_dim), dtype); V has the same shape.
SHAPES: tuple[tuple[str, tuple[int, int, int, int], torch.dtype], ...] = (
    ("reference-engine block (2 layers, 2 heads, 16 tokens, 16 dims, fp32)",
     (2, 2, 16, 16), torch.float32),
    ("8B-class block (32 layers, 8 heads, 16 tokens, 128 dims, bf16)",
     (32, 8, 16, 128), torch.bfloat16),
    ("64 MiB buffer (fp32)", (16, 16, 256, 256), torch.float32),
)


@dataclass(frozen=True)
class DigestThroughput:
    what: str
    bytes: int
    seconds_per_digest: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds_per_digest / 1e9

    def as_dict(self) -> dict[str, object]:
        return {"what": self.what, "bytes": self.bytes,
                "microseconds_per_digest": round(self.seconds_per_digest * 1e6, 2),
                "gb_per_s": round(self.gb_per_s, 3)}


def measure(min_seconds: float = 0.3) -> list[DigestThroughput]:
    """Digest each shape repeatedly for at least ``min_seconds``; best of three rounds."""
    out: list[DigestThroughput] = []
    gen = torch.Generator().manual_seed(0)
    for what, shape, dtype in SHAPES:
        key = torch.randn(shape, generator=gen).to(dtype)
        value = torch.randn(shape, generator=gen).to(dtype)
        size = 2 * key.numel() * key.element_size()
        best = float("inf")
        for _ in range(3):
            n = 0
            started = time.perf_counter()
            while True:
                kv_digest(key, value)
                n += 1
                elapsed = time.perf_counter() - started
                if elapsed >= min_seconds / 3:
                    break
            best = min(best, elapsed / n)
        out.append(DigestThroughput(what, size, best))
    return out
