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
  bytes. A recurrent-state group's block carries its state in K and an empty V, so V may
  name its own shape (an 8th element; absent = K's shape). An optional ``key_fields`` map
  (str -> str) carries the request's own key fields (SGLang's tap sends its extra key and
  cache salt), for the key check against what the block was stored under. An optional
  ``writes`` list names what the probe recorded when each captured block was last written
  (:mod:`.block_writes`): ``[group, index, epoch, digest at write or None, write path,
  digest now or None]`` (both over the block in the engine's layout). Optional, from an
  in-process engine's front (:mod:`sidecar.adapters.remote.front`): ``generations`` (group -> the
  hit's generation stamps), ``tier_states`` (group -> each block's tier state or None),
  ``seq_id`` (int or short string) and ``kv_generations`` (``[group, index, generation]``
  of each captured block, read while copying it);
* ``fingerprints``: counts since the last one, ``blocks: [[group, write path, n], ...]``
  fingerprinted at write and ``evictions`` from the probe's bounded table.

Every message also carries ``src`` (which pipe sent it) and that pipe's cumulative losses:
``dropped`` (captures, i.e. sampled hits, it could not send), ``lost_lookups`` and
``lost_messages`` (:mod:`.pipe` says what each covers), so the sidecar can count what was
lost on the way, each as what it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from sidecar.core.protocol import BlockKV, BlockRef, BlockWrite, TierState, WritePath
from sidecar.core.tensor_bytes import byte_view

PROTOCOL_VERSION = 1
REFERENCE_SALT_PREFIX = "kvsidecar-ref:"

# What a peer may send. The dtype is looked up in this allow-list, never with getattr(torch,
# ...): a quantized or exotic dtype name (``qint8``) makes torch.frombuffer crash the process.
ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "int8": torch.int8, "uint8": torch.uint8,
}
MAX_MESSAGE_BYTES = 256 * 2**20  # one capture of a few blocks is a few MB at most
MAX_DIMS = 8
MAX_ITEMS = 1_000_000  # lookups per message, tokens per capture, blocks per group
MAX_LOOKUPS = 65_536  # lookups in one message (one engine step, or a pipe's carry)
MAX_DIGEST = 128  # characters of a write-time digest ("xxh3_128:" + 32 hex digits)
MAX_COUNT_STEP = 1 << 24  # blocks one fingerprints message may report (a probe's second)
WRITE_PATHS = frozenset(p.value for p in WritePath)


class WireError(ValueError):
    """A probe message that does not fit the protocol; counted and skipped, never fatal."""


def pack(kind: str, src: str = "", dropped: int = 0, **fields: Any) -> bytes:
    """``src`` names the sending pipe (each probe half has its own); ``dropped`` is how many
    captures (sampled hits) that pipe has dropped so far; ``fields`` may add its other
    cumulative losses, ``lost_lookups`` and ``lost_messages`` (:mod:`.pipe`)."""
    return bytes(msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, "src": src,
                                "dropped": dropped, **fields}, use_bin_type=True,
                               default=_unpackable))


def _unpackable(obj: Any) -> str:
    """What msgpack cannot hold (a numpy integer an engine passed for a block id) goes as
    a marker string, which the receiver's checks refuse for that item alone: one foreign
    value must not cost the whole message it rides in."""
    return f"<unpackable {type(obj).__name__}>"


def unpack(data: bytes) -> dict[str, Any]:
    """Decode one message; anything malformed (size, nesting, msgpack) is a WireError."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_MESSAGE_BYTES:
        raise WireError("probe message is not bytes or larger than the size cap")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (RecursionError too)
        raise WireError(f"not msgpack: {type(exc).__name__}") from exc
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION or \
            not isinstance(msg.get("kind"), str):
        raise WireError(f"not a kv-sidecar probe message (protocol {PROTOCOL_VERSION})")
    return msg


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of ``t`` (any dtype, bfloat16 included) in C order."""
    return bytes(byte_view(t))  # the one byte view (sidecar.core.tensor_bytes)


def tensor_from(data: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """Rebuild a tensor from a peer's bytes. Dtype, shape and byte length are all checked
    before torch sees anything (see :data:`ALLOWED_DTYPES`)."""
    dt = ALLOWED_DTYPES.get(dtype) if isinstance(dtype, str) else None
    if dt is None:
        raise WireError(f"dtype {str(dtype)[:40]!r} is not one of {sorted(ALLOWED_DTYPES)}")
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= MAX_DIMS or \
            not all(_is_int(d) and 0 <= d <= MAX_MESSAGE_BYTES for d in shape):
        raise WireError("shape is not a short list of non-negative ints")
    if not isinstance(data, (bytes, bytearray)):
        raise WireError("tensor data is not bytes")
    expected = math.prod(shape) * dt.itemsize
    if len(data) != expected:
        raise WireError(f"{len(data)} bytes for shape {list(shape)} of {dtype} "
                        f"(needs {expected})")
    if expected == 0:  # frombuffer refuses an empty buffer
        return torch.empty(tuple(shape), dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(tuple(shape))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v: Any, what: str) -> list[int]:
    if isinstance(v, list) and len(v) > MAX_ITEMS:
        raise WireError(f"{what}: {len(v)} items, over the cap of {MAX_ITEMS}")
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise WireError(f"{what} is not a list of ints")
    return v


def _int(v: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if not _is_int(v) or not lo <= v <= hi:
        raise WireError(f"{what} is not an int in [{lo}, {hi}]")
    return int(v)


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
    key_fields: Mapping[str, str] = field(default_factory=dict)
    writes: Mapping[tuple[int, int], BlockWrite] = field(default_factory=dict)
    generations: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    tier_states: Mapping[int, tuple[TierState | None, ...]] = field(default_factory=dict)
    seq_id: int | str | None = None
    kv_generations: Mapping[tuple[int, int], int] = field(default_factory=dict)

    def block_kv(self, ref: BlockRef) -> BlockKV | None:
        kv = self.kv.get((ref.group_id, ref.index))
        return None if kv is None else BlockKV(ref, kv[0], kv[1],
                                               self.kv_generations.get((ref.group_id, ref.index)))


def capture_fields(capture_id: str, role: str, salt: str | None, tokens: Sequence[int],
                   query_tokens: int, hit_tokens: int, blocks: dict[int, list[int]],
                   kv: Sequence[tuple[int, int, int, torch.Tensor, torch.Tensor]],
                   writes: Sequence[tuple[int, int, int, str | None, str, str | None]] = ()
                   ) -> dict[str, Any]:
    """Fields of a ``capture`` message. ``kv``: ``(group, index, block_id, K, V)`` with K
    and V of shape (layers, kv_heads, block_size, head_dim); ``writes``: ``(group, index,
    epoch, digest at write, write path, digest now)`` of the captured blocks the probe saw
    written."""
    out = dict(id=capture_id, role=role, salt=salt,
               tokens=[int(t) for t in tokens], query_tokens=int(query_tokens),
               hit_tokens=int(hit_tokens),
               blocks={int(g): [int(b) for b in ids] for g, ids in blocks.items()},
               kv=[_kv_entry(g, i, b, k, v) for g, i, b, k, v in kv])
    if writes:
        out["writes"] = [[int(g), int(i), int(e), d, str(p), now]
                         for g, i, e, d, p, now in writes]
    return out


def _kv_entry(g: int, i: int, b: int, k: torch.Tensor, v: torch.Tensor) -> list[Any]:
    entry = [g, i, b, str(k.dtype).removeprefix("torch."), list(k.shape), tensor_bytes(k),
             tensor_bytes(v)]
    if tuple(v.shape) != tuple(k.shape):  # a state block: V has a shape of its own
        entry.append(list(v.shape))
    return entry


def decode_capture(msg: dict[str, Any]) -> Capture:
    """A ``capture`` message, every field type-checked; a bad one is a :class:`WireError`."""
    cid, role, salt = msg.get("id"), msg.get("role"), msg.get("salt")
    if not isinstance(cid, str) or len(cid) > 256 or role not in ("hit", "reference"):
        raise WireError("capture id or role is malformed")
    if salt is not None and (not isinstance(salt, str) or len(salt) > 4096):
        raise WireError("capture salt is not a short string")
    tokens = _int_list(msg.get("tokens"), "tokens")
    blocks_raw = msg.get("blocks")
    if not isinstance(blocks_raw, dict) or len(blocks_raw) > 64:
        raise WireError("blocks is not a small map group -> block ids")
    blocks = {_int(g, "group", 0, 1023): list(_int_list(ids, "block ids"))
              for g, ids in blocks_raw.items()}
    kv_raw = msg.get("kv")
    if not isinstance(kv_raw, list) or len(kv_raw) > 1024:
        raise WireError("kv is not a list of blocks")
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for entry in kv_raw:
        if not isinstance(entry, list) or len(entry) not in (7, 8):
            raise WireError("kv entry is not [group, index, block, dtype, shape, K, V"
                            "(, V shape)]")
        g, i, _b, dtype, shape, kb, vb = entry[:7]
        v_shape = entry[7] if len(entry) == 8 else shape
        gi, ii = _int(g, "group", 0, 1023), _int(i, "block index")
        if ii >= len(blocks.get(gi, ())):  # KV of a block the capture's table does not name
            raise WireError(f"kv entry for group {gi} block #{ii}: not in the capture's "
                            "block table")
        kv[(gi, ii)] = (tensor_from(kb, dtype, shape), tensor_from(vb, dtype, v_shape))
    return Capture(cid, role, salt, tuple(tokens), _int(msg.get("query_tokens"), "query_tokens"),
                   _int(msg.get("hit_tokens"), "hit_tokens"), blocks, kv,
                   decode_key_fields(msg.get("key_fields")), _writes(msg.get("writes"), kv),
                   *_hit_extras(msg, blocks, kv))


_TIER_VALUES = {s.value: s for s in TierState}


def _hit_extras(msg: Mapping[str, Any], blocks: Mapping[int, list[int]],
                kv: Mapping[tuple[int, int], Any]) -> tuple[Any, ...]:
    """A capture's optional hit extras (module docstring): generations and tier states per
    group of the capture's block table, each at most as long as that group's list; the
    sequence id; the captured blocks' generations."""
    gens_raw, tiers_raw, kvg_raw = (msg.get(k) for k in ("generations", "tier_states",
                                                        "kv_generations"))
    generations: dict[int, tuple[int, ...]] = {}
    tiers: dict[int, tuple[TierState | None, ...]] = {}
    for raw, what in ((gens_raw, "generations"), (tiers_raw, "tier_states")):
        if raw is None:
            continue
        if not isinstance(raw, dict) or len(raw) > 64:
            raise WireError(f"{what} is not a small map group -> list")
        for g, values in raw.items():
            gi = _int(g, "group", 0, 1023)
            if gi not in blocks or not isinstance(values, list) or \
                    len(values) > len(blocks[gi]):
                raise WireError(f"{what} of group {gi}: not a list as long as its blocks")
            if what == "generations":
                generations[gi] = tuple(_int(v, "generation") for v in values)
            elif not all(v is None or v in _TIER_VALUES for v in values):
                raise WireError(f"tier states must be None or one of {sorted(_TIER_VALUES)}")
            else:
                tiers[gi] = tuple(None if v is None else _TIER_VALUES[v] for v in values)
    seq_id = msg.get("seq_id")
    if seq_id is not None and not ((_is_int(seq_id) and abs(seq_id) < 2**63) or
                                   (isinstance(seq_id, str) and len(seq_id) <= 256)):
        raise WireError("seq_id is not an int or a short string")
    kv_generations: dict[tuple[int, int], int] = {}
    if kvg_raw is not None:
        if not isinstance(kvg_raw, list) or len(kvg_raw) > 1024:
            raise WireError("kv_generations is not a short list")
        for entry in kvg_raw:
            if not isinstance(entry, list) or len(entry) != 3:
                raise WireError("a kv generation is not [group, index, generation]")
            key = (_int(entry[0], "group", 0, 1023), _int(entry[1], "block index"))
            if key not in kv:
                raise WireError(f"kv generation for group {key[0]} block #{key[1]}: not a "
                                "captured block")
            kv_generations[key] = _int(entry[2], "generation")
    return generations, tiers, seq_id, kv_generations


def _writes(raw: Any, kv: Mapping[tuple[int, int], Any]) -> dict[tuple[int, int], BlockWrite]:
    """A capture's optional ``writes``: only for blocks whose KV the capture carries."""
    if raw is None:
        return {}
    if not isinstance(raw, list) or len(raw) > 1024:
        raise WireError("writes is not a short list")
    out: dict[tuple[int, int], BlockWrite] = {}
    for entry in raw:
        if not isinstance(entry, list) or len(entry) != 6:
            raise WireError("a write is not [group, index, epoch, digest, write path, "
                            "digest now]")
        g, i = _int(entry[0], "group", 0, 1023), _int(entry[1], "block index")
        epoch, digest, path, served = _int(entry[2], "epoch"), entry[3], entry[4], entry[5]
        for d in (digest, served):
            if d is not None and (not isinstance(d, str) or len(d) > MAX_DIGEST):
                raise WireError("a write's digest is not a short string")
        if path not in WRITE_PATHS:
            raise WireError(f"write path is not one of {sorted(WRITE_PATHS)}")
        if (g, i) not in kv:
            raise WireError(f"write for group {g} block #{i}: not a captured block")
        out[(g, i)] = BlockWrite(path, digest, epoch, served)
    return out


def decode_fingerprint_counts(msg: Mapping[str, Any]) -> tuple[list[tuple[int, str, int]], int]:
    """A ``fingerprints`` message: ``([(group, write path, blocks)], evictions)``, every
    count bounded by :data:`MAX_COUNT_STEP` (a peer's claim, never trusted)."""
    raw = msg.get("blocks", [])
    if not isinstance(raw, list) or len(raw) > 64:
        raise WireError("fingerprint counts are not a short list")
    blocks = []
    for entry in raw:
        if not isinstance(entry, list) or len(entry) != 3 or entry[1] not in WRITE_PATHS:
            raise WireError("a fingerprint count is not [group, write path, blocks]")
        blocks.append((_int(entry[0], "group", 0, 1023), str(entry[1]),
                       _int(entry[2], "blocks", 0, MAX_COUNT_STEP)))
    return blocks, _int(msg.get("evictions", 0), "evictions", 0, MAX_COUNT_STEP)


MAX_KEY_FIELDS = 16
MAX_KEY_FIELD_VALUE = 1024  # characters; a tap sends a digest of a longer value


def decode_key_fields(raw: Any) -> dict[str, str]:
    """An optional ``key_fields`` (a capture's, an SGLang store's): a small map of short
    strings."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_KEY_FIELDS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64
            and len(v) <= MAX_KEY_FIELD_VALUE for k, v in raw.items()):
        raise WireError("key_fields is not a small map of short strings")
    return dict(raw)
