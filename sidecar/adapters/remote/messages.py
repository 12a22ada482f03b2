"""What the engine's front (:mod:`.front`) sends besides cache events, and its decoding
in the sidecar process: the allocator census (:class:`AllocatorState` and the
block tables of :class:`BlockTableSnapshot`, as plain lists), the front's own counts, and a
sampled hit's extras for the capture message.

Both ends import this module. Everything decoded is a peer's claim: sizes are bounded,
types checked, and a bad census is a :class:`~sidecar.adapters.vllm.wire.WireError`
(counted and skipped by the receiver, never fatal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.adapters.vllm.wire import WireError
from sidecar.core.protocol import AllocatorState, BlockKV, BlockTableSnapshot, Hit, Lookup

MAX_POOL = 1 << 24  # blocks in one census table
MAX_TABLES = 64
MAX_SEQUENCES = 1 << 20
MAX_COUNT_KEYS = 256  # distinct (hook, reason) and other count keys in one census
STATE_FIELDS = tuple(f.name for f in dataclasses.fields(AllocatorState))
_TABLE_IDS = ("free", "cached", "ref_counts", "generations", "reserved")


def _id(v: Any) -> Any:
    """A sequence id or block hash as msgpack can carry it and the sidecar can hash it:
    an int, str or bytes as it is, anything else by its (bounded) repr."""
    if v is None or type(v) in (int, str, bytes):
        return v
    return f"repr:{v!r}"[:1024]


def hit_extras(lookup: Lookup, hit: Hit, blocks: Sequence[BlockKV]) -> dict[str, Any]:
    """A capture's optional hit fields (:mod:`sidecar.adapters.vllm.wire`): generation stamps
    and tier states per group, the sequence id, the captured blocks' generations."""
    out: dict[str, Any] = {}
    if hit.generations:
        out["generations"] = {g: [int(x) for x in v] for g, v in hit.generations.items()}
    if hit.tier_states:
        out["tier_states"] = {g: [None if s is None else getattr(s, "value", s) for s in v]
                              for g, v in hit.tier_states.items()}
    if lookup.seq_id is not None:
        out["seq_id"] = _id(lookup.seq_id)
    gens = [[b.ref.group_id, b.ref.index, b.generation] for b in blocks
            if b.generation is not None]
    if gens:
        out["kv_generations"] = gens
    return out


def census_fields(state: AllocatorState | None,
                  tables: Sequence[BlockTableSnapshot] | None,
                  counts: Mapping[str, Any]) -> dict[str, Any]:
    """A ``census`` message's fields (``state``/``tables`` absent where the engine gave none)."""
    out: dict[str, Any] = {"counts": dict(counts)}
    if state is not None:
        out["state"] = {f: getattr(state, f) for f in STATE_FIELDS}
    if tables is not None:
        out["tables"] = [_table(t) for t in tables]
    return out


def _table(t: BlockTableSnapshot) -> dict[str, Any]:
    return {"group_id": t.group_id, "num_blocks": t.num_blocks,
            **{k: list(getattr(t, k)) for k in _TABLE_IDS},
            "block_hashes": [_id(h) for h in t.block_hashes],
            "index": [[_id(h), b] for h, b in t.index],
            "sequences": [[_id(s), list(ids)] for s, ids in t.sequences.items()],
            "double_frees": t.double_frees}


# ---------------------------------------------------------------------------- decoding
def _int(v: Any, what: str, hi: int = 2**63 - 1) -> int:
    if type(v) is not int or not 0 <= v <= hi:
        raise WireError(f"census {what} is not an int in [0, {hi}]")
    return v


def _ints(v: Any, what: str, limit: int = MAX_POOL) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > limit or \
            not all(type(x) is int and -2**63 <= x < 2**63 for x in v):
        raise WireError(f"census {what} is not a bounded list of ints")
    return tuple(v)


def _key(v: Any, what: str) -> Any:
    if v is None or type(v) is int or (type(v) in (str, bytes) and len(v) <= 1024):
        return v
    raise WireError(f"census {what} is not an int, a short string or None")


def decode_state(raw: Any) -> AllocatorState | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - set(STATE_FIELDS):
        raise WireError("census state is not a map of AllocatorState fields")
    return AllocatorState(**{k: None if v is None else _int(v, k) for k, v in raw.items()})


def decode_tables(raw: Any) -> tuple[BlockTableSnapshot, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TABLES:
        raise WireError("census tables is not a short list")
    out = []
    for t in raw:
        if not isinstance(t, dict):
            raise WireError("a census table is not a map")
        n = _int(t.get("num_blocks"), "num_blocks", MAX_POOL)
        hashes, index, seqs = t.get("block_hashes"), t.get("index"), t.get("sequences")
        if not isinstance(hashes, list) or len(hashes) > MAX_POOL or \
                not isinstance(index, list) or len(index) > MAX_POOL or \
                not isinstance(seqs, list) or len(seqs) > MAX_SEQUENCES:
            raise WireError("census block_hashes, index or sequences is not a bounded list")
        if not all(isinstance(e, list) and len(e) == 2 for e in (*index, *seqs)):
            raise WireError("a census index or sequence entry is not a pair")
        out.append(BlockTableSnapshot(
            group_id=_int(t.get("group_id"), "group_id", 1023), num_blocks=n,
            free=_ints(t.get("free"), "free"), cached=_ints(t.get("cached"), "cached"),
            ref_counts=_ints(t.get("ref_counts"), "ref_counts"),
            block_hashes=tuple(_key(h, "block hash") for h in hashes),
            index=tuple((_key(h, "index hash"), _int(b, "index block")) for h, b in index),
            sequences={_key(s, "sequence id"): _ints(ids, "sequence table")
                       for s, ids in seqs},
            generations=_ints(t.get("generations", []), "generations"),
            double_frees=_int(t.get("double_frees", 0), "double_frees"),
            reserved=_ints(t.get("reserved", []), "reserved")))
    return tuple(out)


def decode_counts(raw: Any) -> dict[str, Any]:
    """The front's counts: ``rejected`` as ``[[hook, reason, n]]``, the rest maps of
    name -> n; names are bounded strings, the caller checks them against its labels."""
    if not isinstance(raw, dict):
        raise WireError("census counts is not a map")
    out: dict[str, Any] = {}
    rejected = raw.get("rejected", [])
    if not isinstance(rejected, list) or len(rejected) > MAX_COUNT_KEYS or not all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) and len(x) <= 64
                                                        for x in e[:2]) for e in rejected):
        raise WireError("census rejected counts are not [[hook, reason, n]]")
    out["rejected"] = {(h, r): _int(n, "count") for h, r, n in rejected}
    for name in ("dropped", "hook_errors", "outbox_full"):
        m = raw.get(name, {})
        if not isinstance(m, dict) or len(m) > MAX_COUNT_KEYS or \
                not all(isinstance(k, str) and len(k) <= 64 for k in m):
            raise WireError(f"census {name} is not a small map")
        out[name] = {k: _int(v, "count") for k, v in m.items()}
    return out
