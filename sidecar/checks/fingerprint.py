"""Write-time fingerprints of KV bytes: exact, so they catch what tolerances cannot.

A recompute compare must tolerate rounding noise, so a flipped low mantissa bit or a torn copy
that happens to be close passes it. A digest recorded when the block was written and compared
with a digest of what is read now catches any byte that changed after the write.

Over the raw bytes (no float conversion, bfloat16 included), with the algorithm named in the
digest (``"xxh3_128:..."``) so a digest is only ever compared with one of its own kind:

* ``xxh3_128`` (the default where the ``xxhash`` package is installed — it comes with vLLM
  and the ``events``/``fast`` extras): tens of GB/s, far above the memory bandwidth a check
  may use; not cryptographic, which a fingerprint against hardware and software faults does
  not need;
* ``blake2b`` (the default otherwise: stdlib), ``sha256`` (where a policy wants it).

``kv-sidecar bench perf`` measures each against a one-pass ``amax`` of the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from sidecar.checks.base import Finding
from sidecar.protocol import BlockKV
from sidecar.signals import AnomalyKind

Hasher = Callable[[memoryview, memoryview], str]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes, without converting values (bf16 has no numpy dtype)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _hashlib(name: str) -> Hasher:
    def digest(key: memoryview, value: memoryview) -> str:
        h = hashlib.blake2b(digest_size=16) if name == "blake2b" else hashlib.new(name)
        h.update(key)
        h.update(value)
        return h.hexdigest()
    return digest


def _xxh3() -> Hasher | None:
    try:
        import xxhash
    except ImportError:
        return None

    def digest(key: memoryview, value: memoryview) -> str:
        h = xxhash.xxh3_128()
        h.update(key)
        h.update(value)
        return h.hexdigest()
    return digest


ALGORITHMS: dict[str, Hasher] = {"blake2b": _hashlib("blake2b"), "sha256": _hashlib("sha256")}
_fast = _xxh3()
if _fast is not None:
    ALGORITHMS["xxh3_128"] = _fast
DEFAULT_ALGORITHM = "xxh3_128" if _fast is not None else "blake2b"


def kv_digest(key: torch.Tensor, value: torch.Tensor, algorithm: str | None = None) -> str:
    """``"<algorithm>:<hex>"`` of K's then V's raw bytes."""
    algo = algorithm or DEFAULT_ALGORITHM
    try:
        fn = ALGORITHMS[algo]
    except KeyError:
        raise ValueError(f"unknown digest algorithm {algo!r}; available: "
                         f"{', '.join(sorted(ALGORITHMS))}") from None
    return f"{algo}:{fn(tensor_bytes(key), tensor_bytes(value))}"


def check_fingerprint(block: BlockKV, stored_digest: str | None) -> list[Finding]:
    if stored_digest is None:
        return []
    algo, _, _ = stored_digest.rpartition(":")
    if algo not in ALGORITHMS:  # a digest this sidecar cannot recompute: no verdict
        return []
    now = kv_digest(block.key, block.value, algo)
    if now != stored_digest:
        ref = block.ref
        return [Finding(AnomalyKind.FINGERPRINT_MISMATCH, ref.group_id, ref.index,
                        f"KV digest {now[:20]} != digest at store {stored_digest[:20]}")]
    return []
