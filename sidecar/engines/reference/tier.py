"""A bounded CPU offload tier under the reference pool (LMCache/vLLM-offload in miniature).

When the pool evicts a cached block, its stored bytes and index metadata spill here instead
of being lost. A later lookup that runs past the pool's hits continues in the tier: every
consecutive block found is *loaded* into a freshly allocated pool block, indexed again and
counted as a hit. The tier is LRU-bounded (``capacity`` blocks) and copies on both ways, so
the pool and the tier never share storage.

The write-time digest of a block (when the engine computes one) travels with it: the load
re-reports the block with the digest of the KV as first written, which is what lets the
sidecar's fingerprint check tell a load that silently failed from one that worked.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.engines.reference.blocks import BlockData, BlockHash, KeyFields


@dataclass(frozen=True)
class TierEntry:
    """One offloaded block: its bytes, what its hash covers, and its write-time digest.
    ``extra`` carries what another component attached at spill time (ground truth)."""

    block_hash: BlockHash
    data: BlockData
    tokens: tuple[int, ...]
    key_fields: KeyFields
    prefix_tokens: int
    kv_digest: str | None = None
    extra: object = None


class CpuTier:
    """LRU store of offloaded blocks keyed by block hash (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"CPU tier capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        self.spills = 0
        self.loads = 0
        self.dropped = 0  # entries pushed out by the LRU bound

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: TierEntry) -> None:
        self._entries[entry.block_hash] = entry
        self._entries.move_to_end(entry.block_hash)
        self.spills += 1
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.dropped += 1

    def match(self, hashes: Sequence[BlockHash]) -> list[TierEntry]:
        """Entries for the longest run of ``hashes`` held here, from the first one. The
        entries are immutable, so they stay valid even if the LRU drops them meanwhile."""
        found: list[TierEntry] = []
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None:
                break
            self._entries.move_to_end(h)
            found.append(entry)
        return found
