"""Which hits to verify, and which blocks of a hit.

A sampler decides on the engine's hot path, so ``should_sample`` is O(1) and allocation-free.
Block choice runs only for sampled hits: it always includes the last full block of the hit
(boundary bugs live there: seed 001 §3.3) and fills the rest of the per-sample block budget
with earlier blocks. Those are **coverage-driven** (:class:`BlockCursors`): consecutive
samples of the same prefix rotate through the earlier blocks not yet checked, from a seeded
random start, so a bad middle block of a ``B``-block prefix is checked within ``B - 1``
samples of that prefix (a random pick left one of 8 blocks unchecked ~29% of the time after
8 samples). The cursors live in a bounded LRU keyed by the prefix's last block.

Three policies, all with the same long-run budget of one hit in ``every``:

* :class:`UniformSampler`: exactly one hit in every N;
* :class:`BoundaryBiasedSampler`: favours hits whose cached prefix ends where an earlier
  sequence ended exactly on a block boundary, where boundary bugs bite;
* :class:`AdaptiveSampler`: after an anomaly, favours hits of the same cache groups and
  length class for a while (corruption clusters: one bad shared block spoils every hit
  through it).

The two weighted policies spend the same credit as the uniform one (one sample per
``every`` hits) but let a favoured hit take its sample early, so favouring some hits takes
samples from the others instead of adding to the budget (:class:`WeightedSampler`).
``kv-sidecar bench detection`` compares them at equal budget.

**Start burst** (:class:`Burst`): for the first ``burst_hits`` hits after start, and again
after :meth:`~Burst.rearm` (an engine restart, a probe reporting a new version, layout or
kernel), every policy samples 1 in ``burst_every`` instead of 1 in N, then decays to its
normal rate. A broken upgrade breaks every hit at once; a burst catches it in the first
hundred hits instead of the first thousands. The burst is accounted on the sampled branch
only, so the unsampled fast path costs what it did.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from sidecar.checks.group_coverage import groups_by_id, is_null, required_blocks
from sidecar.core.burst import Burst
from sidecar.core.coverage_cursor import BlockCursors
from sidecar.core.hit_input import picked_block_id
from sidecar.core.protocol import BlockRef, CacheGroup, Hit, SequenceId, StoredBlock


class Sampler(Protocol):
    """A sampling policy. ``feedback`` lets adaptive policies react to verdicts."""

    def should_sample(self, hit: Hit) -> bool: ...

    def choose(self, hit: Hit, block_size: int, max_blocks: int,
               groups: Sequence[CacheGroup] = ()) -> list[BlockRef]: ...

    def feedback(self, hit: Hit, anomalous: bool) -> None: ...


__all__ = ["AdaptiveSampler", "BlockCursors", "BoundaryBiasedSampler", "Burst", "Rearmable",
           "Sampler", "UniformSampler", "WeightedSampler", "choose_blocks", "length_class"]


@runtime_checkable
class Rearmable(Protocol):
    """A sampler with a :class:`Burst` (every policy here): ``rearm`` starts a burst,
    ``current_every`` is the rate in force (the expected-detection gauge reads it)."""

    burst: Burst

    def rearm(self, reason: str) -> None: ...

    @property
    def current_every(self) -> int: ...


class UniformSampler:
    """Exactly one hit in every ``every``, from a seeded random phase (1 in
    ``burst.every`` during a :class:`Burst`)."""

    def __init__(self, every: int, seed: int = 0, last_block: bool = True,
                 burst: Burst | None = None) -> None:
        if every < 1:
            raise ValueError(f"sample-every must be >= 1, got {every}")
        self.every = every
        self.burst = burst or Burst()
        self.last_block = last_block  # False: blocks uniformly at random (a baseline only)
        self._rng = random.Random(seed)
        self.cursors = BlockCursors(self._rng)
        self._countdown = self._rng.randrange(every) + 1
        if self.burst.left > 0:
            self._countdown = self._rng.randrange(self.burst.current_every(every)) + 1
        self._lock = threading.Lock()

    def should_sample(self, hit: Hit) -> bool:
        # No lock: the engine's hook thread is the only writer, and a decrement lost to a
        # second hook thread shifts one sample by one hit, which no budget notices.
        self._countdown -= 1
        if self._countdown > 0:
            return False
        self._countdown = self.burst.step(self.every)
        return True

    def rearm(self, reason: str) -> None:
        """Start a burst now (the next hit is sampled)."""
        self.burst.rearm(reason)
        if self.burst.left > 0:
            self._countdown = 1

    @property
    def current_every(self) -> int:
        return self.burst.current_every(self.every)

    def choose(self, hit: Hit, block_size: int, max_blocks: int,
               groups: Sequence[CacheGroup] = ()) -> list[BlockRef]:
        return choose_blocks(hit, block_size, max_blocks, self._rng, self.last_block, groups,
                             self.cursors if self.last_block else None)

    def feedback(self, hit: Hit, anomalous: bool) -> None:
        return None


class WeightedSampler:
    """One hit in ``every``, exactly in the long run, with favoured hits sampled early.

    A credit grows by one per hit up to ``every``; a sample costs ``every``. An ordinary hit
    (weight 1) is sampled once the credit is full, as :class:`UniformSampler` does; a hit
    of weight ``w`` may take the sample as soon as the credit reaches ``every / w``. The
    credit then goes negative and the next samples wait for it to refill, so favouring some
    hits takes samples from the others and never adds to the budget: over ``n`` hits there
    are at most ``n / every + 2`` samples. Deterministic under a seed.
    """

    def __init__(self, every: int, seed: int = 0, burst: Burst | None = None) -> None:
        if every < 1:
            raise ValueError(f"sample-every must be >= 1, got {every}")
        self.every = every
        self.burst = burst or Burst()
        self._burst_countdown = 1
        self._rng = random.Random(seed)
        self._credit = self._rng.random() * every  # random phase, as UniformSampler
        self._lock = threading.Lock()
        self.cursors = BlockCursors(self._rng)

    def weight(self, hit: Hit) -> float:
        """How much sooner than an ordinary hit this one may be checked (>= 1)."""
        return 1.0

    def rearm(self, reason: str) -> None:
        with self._lock:
            self.burst.rearm(reason)
            self._burst_countdown = 1

    @property
    def current_every(self) -> int:
        return self.burst.current_every(self.every)

    def should_sample(self, hit: Hit) -> bool:
        with self._lock:  # weight() may update policy state; feedback() takes the lock too
            if self.burst.left > 0:  # a burst samples evenly; the credit waits for it
                self.weight(hit)
                self._burst_countdown -= 1
                if self._burst_countdown > 0:
                    return False
                self._burst_countdown = self.burst.step(self.every)
                return True
            w = max(self.weight(hit), 1.0)
            self._credit = min(self._credit + 1.0, float(self.every))
            if self._credit < self.every / w:
                return False
            self._credit -= self.every
            return True

    def choose(self, hit: Hit, block_size: int, max_blocks: int,
               groups: Sequence[CacheGroup] = ()) -> list[BlockRef]:
        return choose_blocks(hit, block_size, max_blocks, self._rng, groups=groups,
                             cursors=self.cursors)

    def feedback(self, hit: Hit, anomalous: bool) -> None:
        return None


class BoundaryBiasedSampler(WeightedSampler):
    """Boundary-biased: favours hits whose cached prefix ends on a sequence boundary that is
    also a block boundary, where release and reuse off-by-ones act (seed 001 §3.3).

    A hit weighs ``boost`` times an ordinary hit when its prompt is an exact multiple of
    the block size, or when its last full block is a *boundary block*: the last block of a
    finished sequence whose length was a multiple of the block size (the sequence stored
    it, then released it as its tail). The next turn of that conversation hits exactly up
    to that block, and a release that frees one block too many frees exactly that one.
    Boundary blocks are learnt from the cache events (:meth:`observe_store`,
    :meth:`observe_release`, :meth:`observe_free`), in bounded memory; without those events
    only the prompt-length cue is left. The last full block of every sampled hit is always
    checked (:func:`choose_blocks`).
    """

    def __init__(self, every: int, block_size: int, seed: int = 0, boost: float = 8.0,
                 memory: int = 65_536, burst: Burst | None = None) -> None:
        super().__init__(every, seed, burst)
        if block_size < 1 or boost < 1 or memory < 1:
            raise ValueError("block_size, boost and memory must be >= 1")
        self.block_size = block_size
        self.boost = boost
        self.memory = memory
        self._stored_by: OrderedDict[tuple[int, int], SequenceId] = OrderedDict()
        self._boundary: OrderedDict[tuple[int, int], None] = OrderedDict()

    def weight(self, hit: Hit) -> float:
        if len(hit.tokens) % self.block_size == 0:
            return self.boost
        last = hit.hit_tokens // self.block_size - 1
        for group_id, ids in hit.blocks.items():
            if 0 <= last < len(ids) and (group_id, int(ids[last])) in self._boundary:
                return self.boost
        return 1.0

    # Cache events (O(1) each; the Monitor forwards them where the sampler has them).
    def observe_store(self, block: StoredBlock) -> None:
        if block.seq_id is not None:
            with self._lock:
                _remember(self._stored_by, (block.group_id, block.block_id), block.seq_id,
                          self.memory)

    def observe_release(self, group_id: int, seq_id: SequenceId,
                        block_ids: Sequence[int]) -> None:
        """A sequence released its block table: if it had stored its tail block, its length
        was a multiple of the block size and the tail is a boundary block."""
        if not block_ids:
            return
        tail = (group_id, int(block_ids[-1]))
        with self._lock:
            if self._stored_by.get(tail) == seq_id:
                _remember(self._boundary, tail, None, self.memory)

    def observe_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        """Blocks that left the index are no boundary any more."""
        with self._lock:
            for b in block_ids:
                self._boundary.pop((group_id, int(b)), None)
                self._stored_by.pop((group_id, int(b)), None)


def _remember(store: OrderedDict[tuple[int, int], Any], key: tuple[int, int], value: Any,
              limit: int) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > limit:
        store.popitem(last=False)


def length_class(hit: Hit) -> Hashable:
    """The cache groups of a hit and its length in blocks, rounded to a power of two: hits
    through the same corrupted shared block fall in one class."""
    sizes = [len(ids) for _, ids in sorted(hit.blocks.items())]
    return tuple(sorted(hit.blocks)), max(sizes, default=0).bit_length()


class AdaptiveSampler(WeightedSampler):
    """Adaptive: after an anomalous verdict, hits of the same :func:`length_class` weigh
    ``boost`` times an ordinary hit for the next ``window`` hits of that class."""

    def __init__(self, every: int, seed: int = 0, boost: float = 8.0,
                 window: int | None = None, burst: Burst | None = None) -> None:
        super().__init__(every, seed, burst)
        if boost < 1:
            raise ValueError(f"boost must be >= 1, got {boost}")
        self.boost = boost
        self.window = window if window is not None else 4 * every
        self._hot: dict[Hashable, int] = {}  # class -> hits left in its boosted window

    def weight(self, hit: Hit) -> float:
        key = length_class(hit)
        left = self._hot.get(key)
        if left is None:
            return 1.0
        if left <= 1:
            self._hot.pop(key, None)
        else:
            self._hot[key] = left - 1
        return self.boost

    def feedback(self, hit: Hit, anomalous: bool) -> None:
        if anomalous:
            with self._lock:
                self._hot[length_class(hit)] = self.window


def choose_blocks(hit: Hit, block_size: int, max_blocks: int,
                  rng: random.Random, last_block: bool = True,
                  groups: Sequence[CacheGroup] = (),
                  cursors: BlockCursors | None = None) -> list[BlockRef]:
    """Per cache group: the last block the group must hold, plus up to ``max_blocks - 1``
    earlier ones (rotating through the prefix with ``cursors``, else at random), all among
    the positions the group must cover
    (:func:`sidecar.checks.group_coverage.required_blocks`: a sliding-window group's window, a
    recurrent
    group's last boundary) and never one of its null (padding) blocks, which hold no KV.
    A null block or a gap where a group must hold state is not chosen but found by the
    verifier's coverage check, which looks at the whole hit. A picked id that is not a block
    id raises :class:`sidecar.core.hit_input.BadHit` (the hit's other ids are not read here:
    the verifier checks them all, off the engine's thread).

    ``groups`` is the engine's :class:`CacheGroup` list (``EngineInfo.groups``); a group the
    hit names that is not in it (or no list at all) is treated as full attention.
    ``last_block=False`` picks every block at random (a baseline for the benchmark, not a
    production policy)."""
    n_full = hit.hit_tokens // block_size
    if n_full <= 0 or max_blocks <= 0:
        return []
    by_id = groups_by_id(groups)
    refs: list[BlockRef] = []
    for group_id, block_ids in sorted(hit.blocks.items()):
        group = by_id.get(group_id)
        span = required_blocks(group, hit.hit_tokens, block_size) if group is not None \
            else range(n_full)
        span = range(span.start, min(span.stop, len(block_ids)))
        if not span:
            continue
        key = (group_id, picked_block_id(block_ids, span[-1]), span.start, span.stop)
        for i in sorted(_pick(span, max_blocks, rng, last_block, cursors, key)):
            b = picked_block_id(block_ids, i)
            if group is None or not is_null(group, b):
                refs.append(BlockRef(group_id=group_id, index=i, block_id=b))
    return refs


def _pick(span: range, max_blocks: int, rng: random.Random, last_block: bool,
          cursors: BlockCursors | None = None,
          key: tuple[int, int, int, int] = (0, 0, 0, 0)) -> set[int]:
    """Indices of ``span`` to check: its last one plus earlier ones, rotating through them
    with ``cursors`` or at random without (or all at random: ``last_block=False``).
    O(picked), whatever the hit's length."""
    if last_block:
        picked = {span[-1]}
        extra = min(max_blocks - 1, len(span) - 1)
        if extra > 0:
            picked.update(cursors.take(key, span[:-1], extra) if cursors is not None
                          else rng.sample(span[:-1], extra))
        return picked
    return set(rng.sample(span, min(max_blocks, len(span))))
