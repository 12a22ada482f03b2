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
* ``blake2b`` (the default otherwise: stdlib), ``sha256`` (where a policy wants it);
* ``wsum64`` (:mod:`sidecar.checks.device_digest`, the default for KV not in host memory):
  tensor ops on the KV's own device, two integers come back, so a GPU engine's blocks
  are never copied to the host to be fingerprinted.

``kv-sidecar bench perf`` measures each against a one-pass ``amax`` of the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from sidecar.checks import device_digest
from sidecar.checks.base import Finding
from sidecar.core.protocol import BlockKV
from sidecar.core.tensor_bytes import byte_view
from sidecar.signals import AnomalyKind

Hasher = Callable[[memoryview, memoryview], str]


tensor_bytes = byte_view  # the one byte view (sidecar.core.tensor_bytes)


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
# Digests computed on the KV's own device, from tensors (no host copy of the block).
DEVICE_ALGORITHMS: dict[str, Callable[[torch.Tensor, torch.Tensor], str]] = {
    device_digest.NAME: device_digest.device_digest}
DEVICE_DEFAULT_ALGORITHM = device_digest.NAME


def default_algorithm(t: torch.Tensor) -> str:
    """The digest for KV on ``t``'s device: a host digest for host memory, else one that
    runs on the device."""
    return DEFAULT_ALGORITHM if t.device.type == "cpu" else DEVICE_DEFAULT_ALGORITHM


def kv_digest(key: torch.Tensor, value: torch.Tensor, algorithm: str | None = None) -> str:
    """``"<algorithm>:<hex>"`` of K's then V's raw bytes."""
    algo = algorithm or default_algorithm(key)
    on_device = DEVICE_ALGORITHMS.get(algo)
    if on_device is not None:
        return f"{algo}:{on_device(key, value)}"
    try:
        fn = ALGORITHMS[algo]
    except KeyError:
        raise ValueError(f"unknown digest algorithm {algo!r}; available: "
                         f"{', '.join(sorted([*ALGORITHMS, *DEVICE_ALGORITHMS]))}") from None
    return f"{algo}:{fn(tensor_bytes(key), tensor_bytes(value))}"


class PoolDigests:
    """Write-time digests of the blocks of a host KV pool laid out ``(layers, blocks, ...)``,
    read in place: ``digest(b) == kv_digest(key[:, b], value[:, b])``.

    Why: an engine fingerprints every block it stores, and for the small blocks of a small
    model the six torch calls and two clones of :func:`kv_digest` over a block read back
    cost ten times the hash (16 vs 1.6 us per block of the reference engine; ~1% of its
    requests/s). Views of the whole pool as bytes are taken once, so a block costs one
    strided copy per tensor (numpy indexing) and the hash. Host memory, contiguous pools
    only (a device pool has :data:`DEVICE_ALGORITHMS`); the pool's tensors must not be
    replaced while this is in use."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor,
                 algorithm: str = DEFAULT_ALGORITHM) -> None:
        for t in (key, value):
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 2:
                raise ValueError("PoolDigests needs contiguous host tensors "
                                 "(layers, blocks, ...)")
        self.algorithm = algorithm
        self._hash = ALGORITHMS[algorithm]
        self._key = key.view(torch.uint8).numpy()
        self._value = value.view(torch.uint8).numpy()

    def __call__(self, block_id: int) -> str:
        # A C-order copy of the block's bytes: exactly what kv_digest hashes.
        k = memoryview(self._key[:, block_id].copy())  # type: ignore[arg-type]
        v = memoryview(self._value[:, block_id].copy())  # type: ignore[arg-type]
        return f"{self.algorithm}:{self._hash(k, v)}"


def checkable(digest: str) -> bool:
    """Whether this sidecar can recompute a digest of ``digest``'s algorithm."""
    algo = digest.rpartition(":")[0]
    return algo in ALGORITHMS or algo in DEVICE_ALGORITHMS


def fingerprint_check(block: BlockKV, stored: str | None, served: str | None = None
                      ) -> tuple[list[Finding], bool | None]:
    """``(findings, matched)`` of a write-time digest against the bytes served: ``served``
    where the engine side took it over the same bytes (an in-engine probe digests the block
    in the engine's layout, at write and at capture), else ``block`` digested here.
    ``matched`` is None when there is no verdict (no digest, or one of an unknown kind)."""
    if served is None:
        found = check_fingerprint(block, stored)
        return found, None if stored is None or not checkable(stored) else not found
    if stored is None:
        return [], None
    if served == stored:
        return [], True
    ref = block.ref
    return [Finding(AnomalyKind.FINGERPRINT_MISMATCH, ref.group_id, ref.index,
                    f"KV digest {served[:20]} when served != digest at write {stored[:20]}")
            ], False


def check_fingerprint(block: BlockKV, stored_digest: str | None) -> list[Finding]:
    # no digest, or one this sidecar cannot recompute: no verdict
    if stored_digest is None or not checkable(stored_digest):
        return []
    algo = stored_digest.rpartition(":")[0]
    now = kv_digest(block.key, block.value, algo)
    if now != stored_digest:
        ref = block.ref
        return [Finding(AnomalyKind.FINGERPRINT_MISMATCH, ref.group_id, ref.index,
                        f"KV digest {now[:20]} != digest at store {stored_digest[:20]}")]
    return []
