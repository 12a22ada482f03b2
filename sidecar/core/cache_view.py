"""The store index as of now: what the verifier and the scrub read between engine events.

Store and free events reach the :class:`~sidecar.core.store_index.StoreIndex` through the
cache-event journal (:mod:`sidecar.core.journal`), off the engine's thread. A reader that
needs the index to be current — a block's epoch at verification, a sample's records, the
resident set a scrub pass walks — drains the journal first; this view does both, so no
reader needs the Monitor (or the journal) to get there.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.checks.keys import StoreRecord
from sidecar.core.journal import CacheEventJournal
from sidecar.core.protocol import BlockRef
from sidecar.core.store_index import StoreIndex


class CacheView:
    """Drain-then-read access to one Monitor's store index."""

    def __init__(self, journal: CacheEventJournal, stored: StoreIndex) -> None:
        self._drain = journal.drain
        self.stored = stored

    def epoch(self, group_id: int, block_id: int) -> int:
        """A block's epoch with every store/free so far applied."""
        self._drain()
        return int(self.stored.epoch(group_id, block_id))

    def snapshot(self, refs: Sequence[BlockRef]
                 ) -> tuple[dict[BlockRef, StoreRecord | None], dict[BlockRef, int]]:
        """Records and epochs of ``refs``, every store/free so far applied."""
        self._drain()
        return self.stored.snapshot(refs)

    def resident(self) -> list[tuple[int, int, int]]:
        """``(group_id, block_id, prefix_tokens)`` of every resident block, as of now."""
        self._drain()
        return list(self.stored.resident())
