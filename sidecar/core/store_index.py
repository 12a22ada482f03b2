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
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from sidecar.checks.keys import ROOT_DIGEST, StoreRecord, tokens_hash
from sidecar.core.protocol import BlockRef, StoredBlock, WritePath

_new_record = tuple.__new__
_NO_FIELDS: Mapping[str, str] = MappingProxyType({})
# A write path outside the enum is recorded as "all" (never exact; a bounded label).
_PATHS = {p.value: p.value for p in WritePath}


class StoreIndex:
    def __init__(self, capacity: int, max_epochs: int | None = None) -> None:
        self.capacity = capacity
        self.max_epochs = max_epochs if max_epochs is not None else 4 * capacity
        self._records: dict[tuple[int, int], StoreRecord] = {}
        self._epochs: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self.epoch_resets = 0

    def __len__(self) -> int:
        return len(self._records)

    def record(self, block: StoredBlock, own_hash: int | None = None) -> None:
        """Remember a stored block, chaining its token digest on its parent's record (or on
        the prefix digest the engine gave). ``own_hash``: the block's
        :func:`~sidecar.checks.keys.tokens_hash`, when taken earlier (the journal takes it on
        the engine's thread)."""
        with self._lock:
            self.record_locked(block, own_hash)

    def locked(self) -> threading.Lock:
        """The index's lock, for a caller applying many events in one hold (the journal):
        inside it, call :meth:`record_locked` and :meth:`forget_locked`."""
        return self._lock

    def record_locked(self, block: StoredBlock, own_hash: int | None = None) -> None:
        """:meth:`record`, the lock already held."""
        gid = block.group_id
        key = (gid, block.block_id)
        prefix = block.prefix_tokens
        records = self._records
        if prefix == 0:
            parent_digest, chained = None, True
        elif block.prefix_digest is not None:
            parent_digest, chained = block.prefix_digest, True
        else:
            pid = block.parent_block_id
            parent = records.get((gid, pid)) if pid is not None else None
            # A digest is only comparable when the whole chain up to it was seen.
            chained = (parent is not None and parent.chained
                       and parent.prefix_tokens + len(block.tokens) == prefix)
            parent_digest = parent.digest if parent is not None else None
        epochs = self._epochs
        epoch = epochs.get(key, 0) + 1
        epochs[key] = epoch
        records.pop(key, None)  # re-inserted last: LRU order
        kf = block.key_fields
        if own_hash is None:
            own_hash = tokens_hash(block.tokens)
        path = block.write_path
        path = _PATHS.get(path, "all") if isinstance(path, str) else "all"
        # tuple.__new__ builds the NamedTuple without its Python-level __new__ (4x
        # cheaper on the store hook); fields in StoreRecord's order. The chained digest
        # is token_digest's, inline.
        records[key] = _new_record(StoreRecord, (
            block.generation,
            hash((ROOT_DIGEST if parent_digest is None else parent_digest, own_hash)),
            chained, prefix, dict(kf) if kf else _NO_FIELDS, block.kv_digest, epoch, path))
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
        for b in block_ids:
            key = (group_id, int(b))
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
        return self._epochs.get((group_id, block_id), 0)

    def snapshot(self, refs: Sequence[BlockRef]
                 ) -> tuple[dict[BlockRef, StoreRecord | None], dict[BlockRef, int]]:
        """Records and epochs of ``refs`` as they are now (at match time)."""
        with self._lock:
            recs = {r: self._records.get((r.group_id, r.block_id)) for r in refs}
            epochs = {r: self._epochs.get((r.group_id, r.block_id), 0) for r in refs}
        return recs, epochs

    def resident(self) -> list[tuple[int, int, int]]:
        """``(group_id, block_id, prefix_tokens)`` of every block with a record now, oldest
        store first: the resident set the background scrub walks (:mod:`sidecar.checks.scrub`).
        O(records) under the lock; called from the scrub's schedule, never a hook."""
        with self._lock:
            return [(g, b, r.prefix_tokens) for (g, b), r in self._records.items()]
