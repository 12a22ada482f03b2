"""What the sidecar remembers of stored blocks: a bounded LRU of :class:`StoreRecord`.

At store time each block's allocation generation, chained token digest, key fields and
optional KV digest are recorded; at a sampled hit the records of the chosen blocks are
snapshotted so the verifier compares the hit with what was written, not with what the
block holds by the time the worker gets to it. Bounded: the oldest records go first, and a
block without a record simply skips the key checks (never a false alarm).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from sidecar.checks.keys import StoreRecord, token_digest
from sidecar.protocol import BlockRef, StoredBlock


class StoreIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: OrderedDict[tuple[int, int], StoreRecord] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, block: StoredBlock) -> None:
        """Remember a stored block, chaining its token digest on its parent's record."""
        key = (block.group_id, block.block_id)
        with self._lock:
            parent = (self._records.get((block.group_id, block.parent_block_id))
                      if block.parent_block_id is not None else None)
            first = block.prefix_tokens == 0
            # A digest is only comparable when the whole chain up to it was seen.
            chained = first or (parent is not None and parent.chained
                                and parent.prefix_tokens + len(block.tokens)
                                == block.prefix_tokens)
            digest = token_digest(None if first or parent is None else parent.digest,
                                  block.tokens)
            self._records[key] = StoreRecord(block.generation, digest, chained,
                                             block.prefix_tokens, dict(block.key_fields),
                                             block.kv_digest)
            self._records.move_to_end(key)
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)

    def forget(self, group_id: int, block_ids: Iterable[int]) -> None:
        """Blocks that left the engine's index: their records no longer describe them."""
        with self._lock:
            for b in block_ids:
                self._records.pop((group_id, int(b)), None)

    def snapshot(self, refs: Sequence[BlockRef]) -> dict[BlockRef, StoreRecord | None]:
        with self._lock:
            return {r: self._records.get((r.group_id, r.block_id)) for r in refs}
