"""vLLM's prefix-cache block hash, re-implemented so the sidecar can audit it independently.

Written from reading vLLM 0.32 (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``,
``generate_block_hash_extra_keys``, ``to_event_extra_keys``, ``init_none_hash``;
``vllm/utils/hashing.py``), without importing vLLM, so the core environment can run it.

The recipe, per FULL block, chained from the first block of the prompt::

    hash_i = H((hash_{i-1} or NONE_HASH, tuple(block_token_ids), extra_keys_i or None))

* ``H`` is the engine's ``--prefix-caching-hash-algo``: ``sha256`` (default: SHA-256 of
  ``pickle.dumps(obj, protocol=HIGHEST)``), ``sha256_cbor`` (SHA-256 of canonical CBOR),
  ``xxhash`` / ``xxhash_cbor`` (XXH3-128 of the same serialisations; optional package).
* ``NONE_HASH = H(seed)`` where ``seed`` is the engine process's ``PYTHONHASHSEED`` if set;
  otherwise ``"vllm-none-hash"`` for the cryptographic algorithms, and 32 random bytes (hex)
  for the xxhash ones. So: with sha256 and no PYTHONHASHSEED the sidecar needs nothing; with
  PYTHONHASHSEED set on the engine, give the sidecar the same value (``hash_seed``); with
  xxhash and no PYTHONHASHSEED the first block of every chain cannot be recomputed (it is
  counted as ``random_seed``-unverifiable, later blocks still are, from their parent).
* ``extra_keys`` are tagged tuples, in this order: ``("lora", name, path)``,
  ``("mm", identifier, offset)`` per multimodal item, ``("cache_salt", salt)`` (first block
  only), ``("prompt_embeds", sha256_digest)``. KV *events* publish them untagged (bare LoRA
  name and salt, ``[identifier, offset]`` pairs, bare digests), without the LoRA path:
  :func:`event_extra_keys_to_hash_keys` undoes that, given the LoRA paths if any.
* Events carry the hash either as the full digest (``bytes``) or, by default
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), as its last 8 bytes read as an unsigned
  big-endian int (:func:`external`). The chain needs full parents, so the auditor keeps the
  full digests it recomputed itself.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

HashFn = Callable[[Any], bytes]
ExternalHash = bytes | int

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
CRYPTO_ALGOS = ("sha256", "sha256_cbor")
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


class Unverifiable(Exception):
    """A block hash cannot be recomputed from what the event carries; ``reason`` is a
    bounded label value (see ``KV_EVENT_HASH_UNVERIFIABLE``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _pickle_bytes(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_bytes(obj: Any) -> bytes:
    import cbor2  # optional: only for the *_cbor algorithms

    return bytes(cbor2.dumps(obj, canonical=True))


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # the engine needs it too; say what is missing
        raise RuntimeError("the xxhash algorithms need `pip install xxhash`") from exc
    return bytes(xxhash.xxh3_128_digest(data))


def hash_function(algo: str) -> HashFn:
    """The engine's ``H`` for ``--prefix-caching-hash-algo algo``."""
    if algo == "sha256":
        return lambda obj: hashlib.sha256(_pickle_bytes(obj)).digest()
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(_cbor_bytes(obj)).digest()
    if algo == "xxhash":
        return lambda obj: _xxh3_128(_pickle_bytes(obj))
    if algo == "xxhash_cbor":
        return lambda obj: _xxh3_128(_cbor_bytes(obj))
    raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}; known: {ALGOS}")


def none_hash(algo: str, hash_seed: str | None) -> bytes | None:
    """The engine's ``NONE_HASH`` (the parent of every first block), or ``None`` when it is
    a per-process random value the sidecar cannot know (xxhash without PYTHONHASHSEED)."""
    if hash_seed is None:
        if algo not in CRYPTO_ALGOS:
            return None
        hash_seed = DEFAULT_NONE_HASH_SEED
    return hash_function(algo)(hash_seed)


def external(full: bytes, as_int: bool) -> ExternalHash:
    """The hash as KV events publish it: the digest, or its low 64 bits as an int."""
    if not as_int:
        return full
    return int.from_bytes(full, byteorder="big") & ((1 << 64) - 1)


def matches(full: bytes, published: ExternalHash) -> bool:
    """Whether a recomputed digest is the one an event published (either form)."""
    if isinstance(published, int):
        return external(full, True) == published
    return full == bytes(published)


def event_extra_keys_to_hash_keys(
        keys: Sequence[Any] | None, lora_name: str | None,
        lora_paths: Mapping[str, str] | None = None) -> tuple[Any, ...] | None:
    """Re-tag one block's untagged event extra keys into the tuple vLLM hashed.

    Order in both forms: LoRA, multimodal items, cache salt, prompt-embeds digest. A bare
    string is the LoRA name when the event names a LoRA (it comes first), else the salt.
    Raises :class:`Unverifiable` when the LoRA path (not published) is unknown.
    """
    if not keys:
        return None
    out: list[tuple[Any, ...]] = []
    items = list(keys)
    if lora_name is not None:
        if not items or items[0] != lora_name:
            raise Unverifiable("unknown_extra_key", "LoRA event without its name first")
        path = (lora_paths or {}).get(lora_name)
        if path is None:
            raise Unverifiable("lora_path_unknown", f"no path configured for {lora_name!r}")
        out.append(("lora", lora_name, path))
        items = items[1:]
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            out.append(("mm", item[0], item[1]))
        elif isinstance(item, str):
            out.append(("cache_salt", item))
        elif isinstance(item, (bytes, bytearray)):
            out.append(("prompt_embeds", bytes(item)))
        else:
            raise Unverifiable("unknown_extra_key", f"extra key of type {type(item).__name__}")
    return tuple(out) if out else None


def hash_block(fn: HashFn, parent: bytes, tokens: Sequence[int],
               extra_keys: tuple[Any, ...] | None) -> bytes:
    """One link of the chain: ``H((parent, tuple(tokens), extra_keys))``."""
    return fn((parent, tuple(int(t) for t in tokens), extra_keys))


def chain_hashes(fn: HashFn, parent: bytes, tokens: Sequence[int], block_size: int,
                 extra_keys: Sequence[tuple[Any, ...] | None]) -> list[bytes]:
    """Full digests of consecutive full blocks of ``tokens`` chained on ``parent``."""
    out: list[bytes] = []
    n_full = len(tokens) // block_size
    for i in range(n_full):
        keys = extra_keys[i] if i < len(extra_keys) else None
        parent = hash_block(fn, parent, tokens[i * block_size:(i + 1) * block_size], keys)
        out.append(parent)
    return out
