"""Whole-table store de-duplication, for engines that re-report every block table.

Some engines (a hybrid engine with an offload tier, a KV-event stream replayed on
reconnect) announce a sequence's *whole* block table on every store, not just the new
block. Each ``on_store`` bumps the block's epoch in the sidecar (a re-store means new
content), so a block re-announced unchanged would drop its pending samples as
``reused_after_serving``. :class:`StoreDedup` sits between such an engine and the sink:
a block whose ``(group, id)`` was already announced with the same generation, position and
tokens, and not freed since, is not forwarded. O(1) per block; bounded (oldest forgotten
first, which at worst forwards a repeat: the pre-helper behaviour).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from sidecar.core.protocol import EventSink, StoredBlock


class StoreDedup:
    """Forwards ``on_store``/``on_free`` to ``sink``, each unchanged block once."""

    def __init__(self, sink: EventSink, capacity: int = 1 << 20) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.sink = sink
        self.capacity = capacity
        self._seen: OrderedDict[tuple[int, int], tuple[int, int, tuple[int, ...]]] = \
            OrderedDict()
        self.repeats = 0  # stores not forwarded (unchanged re-reports)

    def on_store(self, block: StoredBlock) -> None:
        key = (block.group_id, block.block_id)
        what = (block.generation, block.prefix_tokens, tuple(block.tokens))
        if self._seen.get(key) == what:
            self.repeats += 1
            return
        self._seen[key] = what
        self._seen.move_to_end(key)
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        self.sink.on_store(block)

    def on_store_table(self, blocks: Sequence[StoredBlock]) -> None:
        """A whole block table as the engine re-reports it."""
        for block in blocks:
            self.on_store(block)

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self._seen.pop((group_id, b), None)
        self.sink.on_free(group_id, block_ids)
