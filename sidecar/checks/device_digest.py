"""A fingerprint computed with tensor ops, so it runs where the KV lives (CUDA or CPU).

The host digests (xxh3, blake2b, sha256) need the block's bytes in host memory: on a GPU
engine that is a device-to-host copy of every stored block, the very traffic the checks must
not add. ``poly31x2`` is computed on the tensor's own device and only two integers come back.

The bytes are read as little-endian 32-bit words ``x_i`` (zero-padded), and each of two lanes
is ``sum_i (x_i mod p) * w_i mod p`` with ``p`` a prime just under 2**31 and position weights
``w_i = (a*i + b) mod p + 1`` (K's words first, then V's, with the byte lengths mixed in).
Every product and partial sum fits an int64, so the result is exact and identical on every
device (the CPU tests pin the CUDA path's arithmetic). Properties that matter for KV faults:
a change of any single word is always caught unless its difference is a multiple of both
primes (impossible for |difference| < 2**32); a swap of two words is caught unless their
values agree modulo both primes; zeroing or re-layout changes almost all terms. It is a
fingerprint against hardware and software faults, not a cryptographic hash.
"""

from __future__ import annotations

import torch

NAME = "poly31x2"
# (prime, multiplier, offset) per lane: two primes just below 2**31, odd multipliers.
_LANES = ((2_147_483_647, 48_271, 12_345), (2_147_483_629, 69_621, 54_321))
_MASK32 = 0xFFFF_FFFF


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as non-negative int64 words of 32 bits, on its own device."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32).to(torch.int64) & _MASK32


def _lanes(words: torch.Tensor, offset: int) -> torch.Tensor:
    """Each lane's sum for ``words`` at positions ``offset..`` (an int64 tensor of 2)."""
    idx = torch.arange(offset, offset + words.numel(), dtype=torch.int64, device=words.device)
    sums = []
    for p, a, b in _LANES:
        w = (idx * a + b) % p + 1
        sums.append(((words % p) * w % p).sum() % p)
    return torch.stack(sums)


def device_digest(key: torch.Tensor, value: torch.Tensor) -> str:
    """Hex of the two lanes over K's then V's bytes (one host transfer of two integers)."""
    kw, vw = _words(key), _words(value)
    lanes = (_lanes(kw, 0) + _lanes(vw, kw.numel())).tolist()
    nk, nv = key.numel() * key.element_size(), value.numel() * value.element_size()
    mixed = [(s + n * 0x9E37) % p for s, n, (p, _, _) in zip(lanes, (nk, nv), _LANES,
                                                             strict=True)]
    return "".join(f"{m:08x}" for m in mixed)
