"""Which hits to verify, and which blocks of a hit.

A sampler decides on the engine's hot path, so ``should_sample`` is O(1) and allocation-free.
Block choice runs only for sampled hits: it always includes the last full block of the hit
(boundary bugs live there: seed 001 §3.3) and fills the rest of the per-sample block budget
with earlier blocks picked by a seeded RNG, so runs are reproducible.
"""

from __future__ import annotations

import random
import threading
from typing import Protocol

from sidecar.protocol import BlockRef, Hit


class Sampler(Protocol):
    """A sampling policy. ``feedback`` lets adaptive policies react to verdicts."""

    def should_sample(self, hit: Hit) -> bool: ...

    def choose(self, hit: Hit, block_size: int, max_blocks: int) -> list[BlockRef]: ...

    def feedback(self, hit: Hit, anomalous: bool) -> None: ...


class UniformSampler:
    """Exactly one hit in every ``every``, from a seeded random phase."""

    def __init__(self, every: int, seed: int = 0) -> None:
        if every < 1:
            raise ValueError(f"sample-every must be >= 1, got {every}")
        self.every = every
        self._rng = random.Random(seed)
        self._countdown = self._rng.randrange(every) + 1
        self._lock = threading.Lock()

    def should_sample(self, hit: Hit) -> bool:
        with self._lock:
            self._countdown -= 1
            if self._countdown > 0:
                return False
            self._countdown = self.every
            return True

    def choose(self, hit: Hit, block_size: int, max_blocks: int) -> list[BlockRef]:
        return choose_blocks(hit, block_size, max_blocks, self._rng)

    def feedback(self, hit: Hit, anomalous: bool) -> None:
        return None


def choose_blocks(hit: Hit, block_size: int, max_blocks: int,
                  rng: random.Random) -> list[BlockRef]:
    """The last full block of the hit in every group, plus up to ``max_blocks - 1`` earlier
    blocks chosen at random (the same indices across groups, so a hybrid hit is checked
    group by group at the same positions)."""
    n_full = hit.hit_tokens // block_size
    if n_full <= 0 or max_blocks <= 0:
        return []
    indices = {n_full - 1}
    earlier = list(range(n_full - 1))
    extra = min(max_blocks - 1, len(earlier))
    if extra > 0:
        indices.update(rng.sample(earlier, extra))
    refs: list[BlockRef] = []
    for group_id, block_ids in sorted(hit.blocks.items()):
        for i in sorted(indices):
            if i < len(block_ids):
                refs.append(BlockRef(group_id=group_id, index=i, block_id=int(block_ids[i])))
    return refs
