"""Strict decoding of vLLM's KV event stream (msgpack over ZMQ), without importing vLLM.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): each message is three frames,
``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian unsigned counter per publisher,
``payload`` a msgpack array ``[ts, events, data_parallel_rank?]`` (msgspec ``array_like``,
trailing defaults omitted) whose events are maps tagged by ``"type"``:

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``, optional ``extra_keys`` (one entry per block),
  ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, ...;
* ``BlockRemoved``: ``block_hashes``, ``medium``, optional ``group_idx``;
* ``AllBlocksCleared``: nothing.

Anything that does not fit is a :class:`EventDecodeError` with a bounded ``reason`` (frames,
payload, schema) that the caller counts and logs; it is never fatal. Fields vLLM may add in
later versions are ignored, fields we rely on are type-checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from sidecar.adapters.vllm.hashing import ExternalHash

END_SEQ = -1  # the replay socket's end-of-stream marker (signed)


class EventDecodeError(ValueError):
    """A message that is not a valid KV event batch; ``reason`` is a metric label value."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
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

    def block_tokens(self, i: int) -> tuple[int, ...]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]


@dataclass(frozen=True)
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


def decode_payload(seq: int, payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise EventDecodeError("payload", f"not msgpack: {type(exc).__name__}: {exc}") from exc
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
    raise EventDecodeError("schema", f"unknown event type {kind!r}")


def _decode_stored(raw: dict[str, Any]) -> BlockStored:
    hashes = _hashes(raw, "block_hashes")
    parent = raw.get("parent_block_hash", _MISSING)
    if parent is _MISSING or not (parent is None or _is_hash(parent)):
        raise EventDecodeError("schema", "BlockStored.parent_block_hash missing or not a hash")
    tokens = raw.get("token_ids")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise EventDecodeError("schema", "BlockStored.token_ids is not an int array")
    block_size = raw.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise EventDecodeError("schema", "BlockStored.block_size is not a positive int")
    if len(tokens) != len(hashes) * block_size:
        raise EventDecodeError("schema", f"{len(tokens)} token ids for {len(hashes)} blocks "
                                         f"of {block_size}")
    extra = raw.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes) or \
                not all(k is None or isinstance(k, list) for k in extra):
            raise EventDecodeError("schema", "BlockStored.extra_keys is not one entry per block")
        extra = tuple(extra)
    return BlockStored(hashes, parent, tuple(tokens), block_size, _opt_str(raw, "medium"),
                       _opt_str(raw, "lora_name"), extra, _group(raw),
                       _opt_str(raw, "kv_cache_spec_kind"))


_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _is_hash(v: Any) -> bool:
    return (_is_int(v) and v >= 0) or (isinstance(v, bytes) and len(v) > 0)


def _hashes(raw: dict[str, Any], key: str) -> tuple[ExternalHash, ...]:
    v = raw.get(key)
    if not isinstance(v, list) or not v or not all(_is_hash(h) for h in v):
        raise EventDecodeError("schema", f"{key} is not a non-empty array of hashes")
    return tuple(v)


def _opt_str(raw: dict[str, Any], key: str) -> str | None:
    v = raw.get(key)
    if v is not None and not isinstance(v, str):
        raise EventDecodeError("schema", f"{key} is not a string")
    return v


def _group(raw: dict[str, Any]) -> int:
    v = raw.get("group_idx")
    if v is None:
        return 0  # single-group engines and older vLLMs omit it
    if not _is_int(v) or v < 0:
        raise EventDecodeError("schema", "group_idx is not a non-negative int")
    return int(v)


def encode_batch(seq: int, batch: list[Any]) -> list[bytes]:
    """Encode a raw batch the way vLLM's publisher does (tests and fixtures use this)."""
    return [b"", seq.to_bytes(8, "big"), msgpack.packb(batch, use_bin_type=True)]
