"""Coverage-driven block choice: a per-prefix cursor that rotates through the blocks of a
prefix not yet checked, in bounded memory (used by :func:`sidecar.core.sampling.choose_blocks`).

A random earlier block per sample left a bad middle block of an 8-block prefix unchecked
~29% of the time after 8 samples of that prefix; rotating from a seeded random start checks
every earlier block within ``ceil((B - 1) / picks)`` samples.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict


class BlockCursors:
    """Where the rotation through a prefix's earlier blocks stands, per prefix: a bounded
    LRU of ``(group, last block id, span)`` -> the next offset to check.

    The key is the block the hit ends on, so every hit through the same cached prefix
    (whatever it asks after it) advances the same cursor. A key that is evicted, or a block
    id reused for another prefix, only restarts a rotation somewhere: never a missed check,
    never a false alarm. O(1) per chosen block; called for sampled hits only."""

    def __init__(self, rng: random.Random, capacity: int = 8192) -> None:
        if capacity < 1:
            raise ValueError(f"cursor capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._rng = rng
        self._next: OrderedDict[tuple[int, int, int, int], int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._next)

    def take(self, key: tuple[int, int, int, int], span: range, n: int) -> list[int]:
        """``n`` indices of ``span`` (``n <= len(span)``) continuing the rotation of
        ``key``: consecutive calls cover the whole span every ``ceil(len / n)`` calls."""
        size = len(span)
        with self._lock:
            start = self._next.pop(key, None)
            if start is None:
                start = self._rng.randrange(size)
            self._next[key] = (start + n) % size
            if len(self._next) > self.capacity:  # one key added at a time: one out
                self._next.popitem(last=False)
        if n == 1:  # the default (two blocks per sample): no comprehension
            return [span[start]]
        return [span[(start + j) % size] for j in range(n)]


