"""Faults of the radix engine (:mod:`tests.radix_engine`): each overrides one engine step.

The bugs a radix/slot engine has that a paged one phrases differently:

* :class:`ZeroRun`: a freshly inserted node's slot run is zeroed (a memset of the wrong
  range after the write): every later hit on it is served zeros;
* :class:`PrematureFree`: a finished request frees one block's worth of slots too many at
  the front of its duplicate range (``kv[prefix - block : new_prefix]`` instead of
  ``kv[prefix : new_prefix]``): slots the tree still names go back on the free list, the
  next allocation hands them to another request, and hits on the old node read that
  request's KV (stale reuse);
* :class:`KeyMissingField`: the tree's namespace drops the adapter, so requests with
  different adapters share nodes.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.radix_engine import Node, RadixEngine, Request


class RadixFault:
    """No fault: the clean engine."""

    name = "none"

    def namespace(self, request: Request, key: tuple[str, ...]) -> tuple[str, ...]:
        return key

    def after_insert(self, engine: RadixEngine, leaf: Node) -> None:
        return None

    def duplicate_range(self, matched: int, cached: int, block_size: int) -> tuple[int, int]:
        """Which of a finished request's slots to free: those of tokens it computed that
        the tree already had (positions ``matched`` to ``cached``)."""
        return matched, cached


class ZeroRun(RadixFault):
    name = "zero-run"

    def __init__(self, probability: float = 0.3, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.probability = probability
        self.zeroed = 0

    def after_insert(self, engine: RadixEngine, leaf: Node) -> None:
        if len(leaf.slots) >= engine.block_size and self.rng.random() < self.probability:
            engine.pool_k[leaf.slots] = 0
            engine.pool_v[leaf.slots] = 0
            self.zeroed += 1


class PrematureFree(RadixFault):
    name = "premature-free"

    def __init__(self) -> None:
        self.freed = 0

    def duplicate_range(self, matched: int, cached: int, block_size: int) -> tuple[int, int]:
        if matched < block_size:
            return matched, cached
        self.freed += block_size
        return matched - block_size, cached  # the tree still owns [matched - block, matched)


class KeyMissingField(RadixFault):
    name = "key-missing-field"

    def namespace(self, request: Request, key: tuple[str, ...]) -> tuple[str, ...]:
        return key[:1]  # revision only: the adapter is forgotten
