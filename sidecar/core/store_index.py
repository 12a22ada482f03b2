"""What the sidecar remembers of stored blocks: a bounded LRU of :class:`StoreRecord`, and
an epoch per block id.

At store time each block's allocation generation, chained token digest, key fields,
optional KV digest and write path are recorded; at a sampled hit the records of the chosen
blocks are snapshotted so the verifier compares the hit with what was written, not with what
the block holds by the time the worker gets to it. Bounded: the oldest records go first, and a
block without a record simply skips the key checks (never a false alarm).

**Epochs are the sidecar's own, not the engine's.** Every ``on_store`` and ``on_free`` of a
block id bumps its epoch. A sample notes each block's epoch at match time; when the verifier
reads the block later and the epoch moved, the block was freed or stored again in between:
legitimate reuse, so the read is dropped (``evicted_before_read``), never compared. Engines
need no generation stamps for this (stamps still catch a different bug: a block handed out
again *while still indexed*). The epoch table is bounded too; when it is cleared, every
in-flight sample sees a moved epoch and is dropped, the safe direction.

Hot path: ``record`` and ``forget`` are O(block tokens) and O(ids) in C-level work (a dict
update, a tuple hash) under one uncontended lock.

**Records are kept as plain tuples**, made into :class:`StoreRecord` only when read (a
snapshot at a sampled hit). The garbage collector stops tracking a plain tuple of ints and
strings in the young generations; a ``StoreRecord`` (a tuple subclass), or a tuple holding
a dict, it tracks for good. Every stored block's record outlives the young generations, so
a tracked one counted toward the next full collection of the engine's whole heap:
measured, ~2 us of a store's ~5 us (hook + applying it) was the collector's (``bench
perf``'s on_store process figure; 4.9 -> 2.8 us with plain records).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from sidecar.checks.keys import ROOT_DIGEST, StoreRecord, tokens_hash
from sidecar.core.protocol import BlockRef, StoredBlock, WritePath

_as_record = tuple.__new__
_NO_FIELDS: Mapping[str, str] = MappingProxyType({})
# A raw record: StoreRecord's fields in its order, key_fields as one flat tuple (names,
# then values) or None for none. A dict in the record would keep it tracked for good; a
# tuple inside is untracked at the record's first collection and the record at its second
# (the collector drops a tuple only once nothing in it is tracked, and checks what a
# survivor holds after the survivor): the second is the middle generation's, before the
# old one. A tuple of pairs would take a third. See the module docstring.
_Raw = tuple[int, int, bool, int, "tuple[str, ...] | None", "str | None", int, str]


class _Unset:
    """The type of :data:`_UNSET`: no snapshot given (None is one: no key fields)."""


_UNSET = _Unset()
_DIGEST: Final = 1
_CHAINED: Final = 2
_PREFIX: Final = 3
_FIELDS: Final = 4


def key_fields_snapshot(fields: Mapping[str, str] | None) -> dict[str, str] | None:
    """A block's key fields copied now (None for none). The store hook takes the copy on
    the engine's thread (inline: one C call for a dict, atomic under the GIL), so a mapping
    the engine changes after the hook returns changes nothing (an outside check got false
    key-field anomalies from one); the index flattens it when the journal is applied.
    Raises what the mapping raises (the hook rejects the store)."""
    if not fields:
        return None
    return fields.copy() if type(fields) is dict else dict(fields)


def _record(raw: _Raw | None) -> StoreRecord | None:
    """The :class:`StoreRecord` a raw record stands for."""
    if raw is None:
        return None
    rec: StoreRecord = _as_record(StoreRecord, raw)
    fields = raw[_FIELDS]
    if fields is None:
        return rec._replace(key_fields=_NO_FIELDS)
    half = len(fields) // 2
    return rec._replace(key_fields=dict(zip(fields[:half], fields[half:], strict=True)))


# A block's key in the index: its group and id in one int (ids are at most MAX_BLOCK_ID, 41
# bits, checked before they get here): no tuple to build, hash and keep per block.
_ID_BITS: Final = 41
_ID_MASK: Final = (1 << _ID_BITS) - 1


def _key(group_id: int, block_id: int) -> int:
    """The key of a block named from outside (a hit's refs, an epoch query): -1, which no
    stored block has, for an id that is not one (a hit's ids are checked after this)."""
    try:
        g, b = operator.index(group_id), operator.index(block_id)
    except TypeError:
        return -1
    return (g << _ID_BITS) | b if 0 <= b <= _ID_MASK and g >= 0 else -1


# A write path outside the enum is recorded as "all" (never exact; a bounded label).
_PATHS = {p.value: p.value for p in WritePath}


class StoreIndex:
    def __init__(self, capacity: int, max_epochs: int | None = None) -> None:
        self.capacity = capacity
        self.max_epochs = max_epochs if max_epochs is not None else 4 * capacity
        self._records: dict[int, _Raw] = {}  # by _key(group, block), oldest store first
        self._epochs: dict[int, int] = {}
        self._lock = threading.Lock()
        self.epoch_resets = 0

    def __len__(self) -> int:
        return len(self._records)

    def record(self, block: StoredBlock, own_hash: int | None = None,
               fields: dict[str, str] | _Unset | None = _UNSET) -> None:
        """Remember a stored block, chaining its token digest on its parent's record (or on
        the prefix digest the engine gave). ``own_hash``: the block's
        :func:`~sidecar.checks.keys.tokens_hash`, and ``fields``: its
        :func:`key_fields_snapshot`, when taken earlier (the store hook takes both on the
        engine's thread)."""
        with self._lock:
            self.record_locked(block, own_hash, fields)

    def locked(self) -> threading.Lock:
        """The index's lock, for a caller applying many events in one hold (the journal):
        inside it, call :meth:`record_locked` and :meth:`forget_locked`."""
        return self._lock

    def record_locked(self, block: StoredBlock, own_hash: int | None = None,
                      fields: dict[str, str] | _Unset | None = _UNSET) -> None:
        """:meth:`record`, the lock already held."""
        gid = block.group_id << _ID_BITS
        key = gid | block.block_id
        prefix = block.prefix_tokens
        records = self._records
        if prefix == 0:
            parent_digest, chained = None, True
        elif block.prefix_digest is not None:
            parent_digest, chained = block.prefix_digest, True
        else:
            pid = block.parent_block_id  # not checked before here: _key for anything odd
            parent = None if pid is None else records.get(
                gid | pid if type(pid) is int and 0 <= pid <= _ID_MASK
                else _key(block.group_id, pid))
            # A digest is only comparable when the whole chain up to it was seen.
            chained = (parent is not None and parent[_CHAINED]
                       and parent[_PREFIX] + len(block.tokens) == prefix)
            parent_digest = parent[_DIGEST] if parent is not None else None
        epochs = self._epochs
        epoch = epochs.get(key, 0) + 1
        epochs[key] = epoch
        records.pop(key, None)  # re-inserted last: LRU order
        if isinstance(fields, _Unset):
            fields = key_fields_snapshot(block.key_fields)
        if own_hash is None:
            own_hash = tokens_hash(block.tokens)
        path = block.write_path
        path = _PATHS.get(path, "all") if isinstance(path, str) else "all"
        # A plain tuple, fields in StoreRecord's order (see _Raw). The chained digest is
        # token_digest's, inline.
        records[key] = (
            block.generation,
            hash((ROOT_DIGEST if parent_digest is None else parent_digest, own_hash)),
            chained, prefix, (*fields, *fields.values()) if fields else None,
            block.kv_digest, epoch, path)
        if len(records) > self.capacity:
            del records[next(iter(records))]
        if len(epochs) > self.max_epochs:
            self._reset_epochs()

    def forget(self, group_id: int, block_ids: Iterable[int]) -> None:
        """Blocks that left the engine's index: their records no longer describe them."""
        with self._lock:
            self.forget_locked(group_id, block_ids)

    def forget_locked(self, group_id: int, block_ids: Iterable[int]) -> None:
        """:meth:`forget`, the lock already held."""
        records, epochs = self._records, self._epochs
        gid = group_id << _ID_BITS
        for b in block_ids:
            key = gid | int(b)
            records.pop(key, None)
            epochs[key] = epochs.get(key, 0) + 1
        if len(epochs) > self.max_epochs:
            self._reset_epochs()

    def _reset_epochs(self) -> None:
        self._epochs.clear()
        self.epoch_resets += 1

    def reset(self) -> None:
        """Forget everything (events were lost): no record, every epoch moved. In-flight
        samples are then dropped and blocks without records skip the key checks: the safe
        direction, never a false alarm."""
        with self._lock:
            self._records.clear()
            self._reset_epochs()

    def epoch(self, group_id: int, block_id: int) -> int:
        """The block's current epoch (0 when never seen, or after a reset)."""
        return self._epochs.get(_key(group_id, block_id), 0)

    def snapshot(self, refs: Sequence[BlockRef]
                 ) -> tuple[dict[BlockRef, StoreRecord | None], dict[BlockRef, int]]:
        """Records and epochs of ``refs`` as they are now (at match time)."""
        with self._lock:
            keys = [(r, _key(r.group_id, r.block_id)) for r in refs]
            raw = {r: self._records.get(k) for r, k in keys}
            epochs = {r: self._epochs.get(k, 0) for r, k in keys}
        return {r: _record(x) for r, x in raw.items()}, epochs

    def resident(self) -> list[tuple[int, int, int]]:
        """``(group_id, block_id, prefix_tokens)`` of every block with a record now, oldest
        store first: the resident set the background scrub walks (:mod:`sidecar.checks.scrub`).
        O(records) under the lock; called from the scrub's schedule, never a hook."""
        with self._lock:
            return [(k >> _ID_BITS, k & _ID_MASK, r[_PREFIX])
                    for k, r in self._records.items()]
