"""A fingerprint computed with tensor ops, so it runs where the KV lives (CUDA or CPU).

The host digests (xxh3, blake2b, sha256) need the block's bytes in host memory: on a GPU
engine that is a device-to-host copy of every stored block, the very traffic the checks must
not add. ``wsum64`` is computed on the tensor's own device and two integers come back.

The bytes are read as 64-bit words, laid out as rows of :data:`COLUMNS` words (zero-padded),
and the digest is the weighted sum ``sum_rc x_rc * c_c * r_r  mod 2**64`` with fixed odd
weights per column (``c``) and per row (``r``, K's rows first, then V's), plus the byte
lengths. Integer arithmetic modulo 2**64 is exact and order-free, so the result is identical
on every device and for any reduction order (the CPU tests check torch's int64 arithmetic
against Python's exact integers). A change of any single word is always caught (an odd
weight times a non-zero difference is never 0 mod 2**64); any other change escapes with
probability ~2**-64 over the weights; zeroing, swaps and re-layouts change it.

Cost: one elementwise multiply by the (cache-resident) column weights and two sums: about
three passes over the block's bytes, no host copy. A fingerprint against hardware and
software faults, not a cryptographic hash.
"""

from __future__ import annotations

import threading

import torch

NAME = "wsum64"
COLUMNS = 4096  # words per row (32 KiB): the column weights stay in cache
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(i: int) -> int:
    z = (i * _GOLDEN + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _odd_weights(salt: int, start: int, n: int) -> list[int]:
    """Odd 64-bit weights ``start .. start+n`` of stream ``salt``, as signed int64."""
    out = []
    for i in range(start, start + n):
        w = _splitmix64((salt << 40) + i) | 1
        out.append(w - (1 << 64) if w >= 1 << 63 else w)
    return out


class _Weights:
    """Per device: the column weights and a growing prefix of the row weights."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cols: dict[torch.device, torch.Tensor] = {}
        self._rows: dict[torch.device, torch.Tensor] = {}

    def columns(self, device: torch.device) -> torch.Tensor:
        with self._lock:
            w = self._cols.get(device)
            if w is None:
                w = torch.tensor(_odd_weights(1, 0, COLUMNS), dtype=torch.int64, device=device)
                self._cols[device] = w
            return w

    def rows(self, device: torch.device, n: int) -> torch.Tensor:
        with self._lock:
            w = self._rows.get(device)
            have = 0 if w is None else w.numel()
            if have < n:
                grow = max(n, 2 * have, 64)
                more = torch.tensor(_odd_weights(2, have, grow - have), dtype=torch.int64,
                                    device=device)
                w = more if w is None else torch.cat([w, more])
                self._rows[device] = w
            assert w is not None
            return w[:n]


_WEIGHTS = _Weights()


def _rows_of_words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as ``(rows, COLUMNS)`` int64 words, on its own device."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % (8 * COLUMNS)
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    elif raw.storage_offset() % 8:  # a view that does not start on a word
        raw = raw.clone()
    return raw.view(torch.int64).view(-1, COLUMNS)


def _weighted(words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``sum_rc words * cols * rows`` mod 2**64 (int64 wraps), a 0-dim tensor."""
    per_row = (words * _WEIGHTS.columns(words.device)).sum(dim=1)
    return (per_row * rows).sum()


def device_digest(key: torch.Tensor, value: torch.Tensor) -> str:
    """Hex of the 64-bit weighted sum over K's then V's bytes (one host transfer)."""
    kw, vw = _rows_of_words(key), _rows_of_words(value)
    rows = _WEIGHTS.rows(kw.device, kw.shape[0] + vw.shape[0])
    sk, sv = torch.stack([_weighted(kw, rows[:kw.shape[0]]),
                          _weighted(vw, rows[kw.shape[0]:])]).tolist()
    nk, nv = key.numel() * key.element_size(), value.numel() * value.element_size()
    total = (sk + sv + _splitmix64(nk) + 3 * _splitmix64(nv + (1 << 50))) & _MASK64
    return f"{total:016x}"
