"""Bounded ids for LMCache chunks: what the Monitor calls a block id.

The Monitor keys everything (store records, epochs, evidence) by an int block id, and its
memory is bounded; LMCache names a chunk by a ``CacheEngineKey`` (model, world size, worker,
chained chunk hash, dtype). :class:`ChunkIds` hands out ids ``0 .. capacity-1`` and resolves
them back to keys. When it is full the least recently used id is recycled; its previous
chunk is reported as freed, so the Monitor's epoch for that id moves and an in-flight sample
of the old chunk is dropped, never compared with the new one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable


class ChunkIds:
    """Key <-> id, LRU-bounded; ``on_recycle(id)`` is called when an id changes owner."""

    def __init__(self, capacity: int, on_recycle: Callable[[int], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"chunk id capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.on_recycle = on_recycle
        self._ids: OrderedDict[Hashable, int] = OrderedDict()
        self._keys: dict[int, Hashable] = {}
        self._lock = threading.Lock()
        self.recycled = 0

    def __len__(self) -> int:
        return len(self._ids)

    def id_for(self, key: Hashable) -> int:
        """The chunk's id, assigning one (and recycling the oldest) if it has none."""
        recycled: int | None = None
        with self._lock:
            cid = self._ids.get(key)
            if cid is not None:
                self._ids.move_to_end(key)
                return cid
            if len(self._ids) < self.capacity:
                cid = len(self._ids)
            else:
                _, cid = self._ids.popitem(last=False)
                del self._keys[cid]
                recycled = cid
                self.recycled += 1
            self._ids[key] = cid
            self._keys[cid] = key
        if recycled is not None and self.on_recycle is not None:
            self.on_recycle(recycled)
        return cid

    def key_of(self, chunk_id: int) -> Hashable | None:
        """The key id ``chunk_id`` stands for now (``None`` when unassigned)."""
        with self._lock:
            return self._keys.get(chunk_id)
