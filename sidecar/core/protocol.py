"""The adapter protocol: the only contract between kv-sidecar and an inference engine.

The core never imports an engine. An engine (or an adapter wrapping it) does two things:

* it *calls* the sidecar with events from its cache manager — ``on_lookup`` with a
  :class:`Lookup` (and the :class:`Hit` when a prefix was found), ``on_store`` with a
  :class:`StoredBlock`, ``on_free`` and ``on_request_done`` — through :class:`EventSink`,
  which :class:`sidecar.core.monitor.Monitor` implements;
* it *answers* the sidecar through :class:`Adapter`: what the engine is (:class:`EngineInfo`
  with its :class:`CacheGroup` list), what KV the cache holds for some blocks of a hit
  (``read``), what KV a from-scratch computation gives for the same blocks (``recompute``),
  and the allocator's state (``allocator``).

Every optional capability (``capture``, ``reread``, ``reference_kind``, ``busy``,
``block_tables``, ``scrub_hit``, ``evict``, a sampler's ``observe_*``, the sink's
``on_allocate``/``on_release``/``on_tier``/``on_captured``) is declared, one Protocol each, in
:mod:`sidecar.core.capabilities`, and resolved once when a Monitor attaches
(:mod:`sidecar.core.attach`). An adapter that offers none still gets every other signal.

Cache groups are in the protocol from the start: a plain model has one full-attention group,
a hybrid model (sliding window + full, recurrent state, offloaded tier...) has several, and a
hit names its blocks per group. Nothing here depends on torch except the tensor type of
:class:`BlockKV`.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: `kv-sidecar --help` need not load torch (~1.4 s)
    import torch



class GroupKind(enum.StrEnum):
    """What a cache group holds; checks that depend on coverage read this."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    COMPRESSED = "compressed"
    RECURRENT_STATE = "recurrent_state"
    SPARSE_INDEX = "sparse_index"
    OFFLOADED_TIER = "offloaded_tier"


class TierState(enum.StrEnum):
    """Where an offload-tier entry is in its life (the tier's state machine):
    ``resident`` (only in device memory) -> ``offloading`` (async copy out in flight) ->
    ``offloaded`` (only in the tier) -> ``loading`` (async copy back in flight) ->
    ``loaded`` (back in device memory, usable) | ``failed`` (the copy back failed; the entry
    must not be served). A hit may only use ``resident`` or ``loaded`` entries."""

    RESIDENT = "resident"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


@dataclass(frozen=True)
class CacheGroup:
    """A set of layers that share one block table (vLLM's KV-cache group).

    * ``sliding_window``: for :attr:`GroupKind.SLIDING_WINDOW` groups, the window in tokens;
      a hit needs only the blocks covering the last ``sliding_window - 1`` positions
      (:func:`sidecar.checks.group_coverage.required_blocks`), the earlier ones are legitimately
      null.
    * ``null_block_ids``: block ids that are padding, never KV (vLLM's null block 0, which
      fills out-of-window and skipped positions of a block table). The sidecar never reads
      them as KV; one at a position the group must cover is an anomaly.
    * :attr:`GroupKind.RECURRENT_STATE` groups keep one state per block *boundary*: block
      ``i`` holds the state after token ``(i + 1) * block_size - 1``, and a hit needs only
      the state at its last boundary. Its :class:`BlockKV` carries the state in ``key``
      (``(layers, *state_shape)``) and a second state component, or an empty tensor, in
      ``value``; recompute returns the state a fresh prefill reaches at the same boundary.
      Missing state: an engine without the state at the hit's last boundary lists fewer
      blocks (the list ends before it: ``missing_group_state``); a null id there is read as
      ``null_block_read``. Earlier boundaries are never needed, so null ids before it are fine.
    """

    group_id: int
    kind: GroupKind
    layers: tuple[int, ...]
    sliding_window: int | None = None
    name: str = ""
    null_block_ids: frozenset[int] = frozenset()

    @property
    def label(self) -> str:
        """Bounded label value for metrics: the group's name, or its id."""
        return self.name or str(self.group_id)


@dataclass(frozen=True)
class EngineInfo:
    """What the sidecar needs to know about an engine, from ``Adapter.describe()``.

    ``dtype`` is the dtype the KV is *read back as* (a torch dtype name such as
    ``"bfloat16"``); ``kv_storage`` names a lossy storage format (``"int8"``, ``"fp8"``)
    when the cache quantises, so tolerances can widen for it.
    """

    engine: str
    model: str
    revision: str
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    groups: tuple[CacheGroup, ...]
    key_fields: tuple[str, ...] = ()
    kv_storage: str | None = None

    def group(self, group_id: int) -> CacheGroup:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise KeyError(f"engine {self.engine!r} has no cache group {group_id}")


# A live sequence (request) as the engine names it: an int in the reference engine, a
# request-id string in vLLM. Only used in logs and evidence, never in a metric label.
SequenceId = int | str


@dataclass(frozen=True)
class Lookup:
    """One prefix-cache lookup: how many prompt tokens were asked for, how many were found.

    ``hit`` is set when at least one block was found. Cheap to build: it holds references
    to sequences the engine already has, never copies.
    """

    query_tokens: int
    hit_tokens: int
    hit: Hit | None = None
    seq_id: SequenceId | None = None  # the looking-up sequence, for the block lifecycle log


@dataclass(frozen=True)
class Hit:
    """A prefix hit as the engine is about to use it.

    * ``tokens``: the request's prompt token ids (at least ``hit_tokens`` of them). The
      hit covers ``tokens[:hit_tokens]``; recompute needs the tokens, nothing else.
    * ``blocks``: group id -> physical block ids covering the hit, in order.
    * ``generations``: group id -> allocation generation of each block *at match time*;
      a block handed out again gets a new generation, so a mismatch with the generation
      recorded at store time means the hash map points at a reused block.
    * ``key_fields``: the request's own values of the fields the engine's key should cover
      (model revision, adapter, cache salt...). Compared with what was recorded at store.
    """

    tokens: Sequence[int]
    hit_tokens: int
    blocks: Mapping[int, Sequence[int]]
    generations: Mapping[int, Sequence[int]] = field(default_factory=dict)
    key_fields: Mapping[str, str] = field(default_factory=dict)
    # group id -> the offload-tier state of each block at match time, where the block came
    # through a tier. Absent = device-resident, per block: a group not listed, a list that
    # ends before the block, or ``None`` at its position (no padding with RESIDENT).
    # Served while not resident/loaded = anomaly.
    tier_states: Mapping[int, Sequence[TierState | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredBlock:
    """A full block written and indexed by the engine (an entry was added to the cache).

    A *block* is whatever unit the engine indexes and the adapter can read back by
    ``(group_id, block_id)``: a page of a paged pool (vLLM, the reference engine), a
    block_size-aligned run of a path's token slots in a slot/radix engine (SGLang-style:
    ``block_id`` is the slot of the run's *last* token; the first slot is shared by two
    paths that part inside the block, and node ids change when a node splits), or an entry
    of an offload tier. The sidecar never
    interprets the id; it only asks the adapter about it and keeps an epoch per id (see
    :mod:`sidecar.core.store_index`).

    ``tokens`` are the tokens of this block only; ``prefix_tokens`` the number of tokens
    before it (so block ``i`` has ``prefix_tokens == i * block_size``). How the sidecar
    learns what precedes the block, so a hit's tokens can be checked against it (any one):

    * ``prefix_digest``: the sidecar's chained digest of the tokens before the block
      (:func:`sidecar.checks.keys.prefix_digest`), for engines that know the whole prefix
      (radix trees) and no parent block;
    * ``parent_block_id``: the block before it, whose own store the sidecar saw (paged
      engines); the sidecar chains digests itself;
    * neither: the block's key fields and content are still checked, its tokens only when
      it is the first block.

    ``kv_digest`` is an optional write-time fingerprint of the block's KV bytes
    (:mod:`sidecar.checks.fingerprint`); ``write_path`` which engine path wrote them
    (:class:`WritePath`: ``prefill``, ``decode``, or ``all`` where the engine does not say;
    the tolerance is calibrated per path, and a prefill-written block is compared bit-exactly
    where the engine's own recompute is exact). ``generation`` is the engine's allocation stamp
    where it keeps one (0 where it does not: the sidecar's own epochs make stamps an
    optimisation, not a requirement).
    """

    group_id: int
    block_id: int
    generation: int
    tokens: Sequence[int]
    prefix_tokens: int
    key_fields: Mapping[str, str] = field(default_factory=dict)
    parent_block_id: int | None = None
    kv_digest: str | None = None
    seq_id: SequenceId | None = None  # the sequence that wrote it, for the lifecycle log
    prefix_digest: int | None = None
    write_path: str = "all"  # a WritePath value; anything else is recorded as "all"


class BlockRef(NamedTuple):
    """One block chosen for verification: which group, which position in the hit.

    A named tuple, not a frozen dataclass: a sampled hit creates, hashes and compares a
    few of these on the engine's thread, and a tuple's C hash and init cost half as much
    (issue 20 counts every instruction there). ``index`` hides ``tuple.index``, which
    nothing calls on a BlockRef."""

    group_id: int
    index: int  # type: ignore[assignment]  # block index within the hit (0 = first block)
    block_id: int

    def token_range(self, block_size: int) -> tuple[int, int]:
        return self.index * block_size, (self.index + 1) * block_size


class WritePath(enum.StrEnum):
    """Which engine path wrote a block's KV: the tolerance is calibrated per path, since a
    prefill recompute of a block a decode step wrote differs by the two kernels' rounding."""

    ALL = "all"  # the engine does not say
    PREFILL = "prefill"  # every position computed by a prefill (prompt tokens only)
    DECODE = "decode"  # holds generated tokens: completed by a decode step


@dataclass(frozen=True)
class BlockWrite:
    """What the engine side recorded when a block was last written (an in-engine probe's
    write-time fingerprint): the path, the digest of its KV bytes where one was taken
    (:mod:`sidecar.checks.fingerprint`), and the write's sequence number. ``served_digest``:
    the same digest of the bytes the hit was served, taken where they live when the probe
    has one (over the engine's own layout, like the first); without it the sidecar recomputes
    ``kv_digest`` from the captured block."""

    write_path: str = WritePath.ALL.value
    kv_digest: str | None = None
    epoch: int = 0
    served_digest: str | None = None


@dataclass
class BlockKV:
    """K and V of one block for the layers of its group.

    ``key`` and ``value`` have shape ``(layers, kv_heads, tokens, head_dim)``; ``generation``
    is the block's allocation generation observed while it was read (``None`` when the
    engine has no generation stamps or for recomputed KV).
    """

    ref: BlockRef
    key: torch.Tensor
    value: torch.Tensor
    generation: int | None = None


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot of the engine's block allocator, from ``Adapter.allocator()``.

    Every field may be ``None``: *unknown*, which is never exported as 0 (a series the engine
    cannot give is absent, so a dashboard shows "no data" rather than a measured zero).
    Counters (``allocations``, ``allocation_failures``) are totals since the engine started;
    the sidecar turns them into rates. ``largest_free_run`` is the most free blocks one
    allocation can take (all free blocks for a paged pool; the longest run of consecutive
    free ids where contiguity matters). Units are the engine's allocation unit: blocks for a
    paged pool, token slots for a slot/radix engine.
    """

    total_blocks: int | None = None
    free_blocks: int | None = None
    cached_blocks: int | None = None  # evictable: unreferenced but still indexed
    used_blocks: int | None = None  # referenced by live sequences
    largest_free_run: int | None = None
    allocations: int | None = None
    allocation_failures: int | None = None
    allocated_slots: int | None = None  # token slots in blocks held by live sequences
    filled_slots: int | None = None  # of those, slots holding a token
    # For the leak trend test (sidecar.allocator.leak), where the engine knows them:
    live_sequences: int | None = None  # sequences holding blocks now
    held_blocks: int | None = None  # distinct blocks named by live sequences' block tables
    # The engine's own prefix-cache hit counter (prompt tokens, total since start, what its
    # metrics export), for the hit-counter audit (sidecar.allocator.hit_counter).
    hit_tokens: int | None = None


@dataclass(frozen=True)
class BlockTableSnapshot:
    """One cache group's block pool as its allocator keeps it, taken at one instant (under
    the engine's lock), for the sidecar's allocator invariant checks
    (:mod:`sidecar.allocator.invariants`).

    Generic on purpose: a paged allocator keeps exactly these facts (vLLM's ``BlockPool``:
    ``free_block_queue``, ``KVCacheBlock.ref_cnt`` and ``block_hash``,
    ``cached_block_hash_to_block``; its ``KVCacheManager``: each request's block list).
    The sidecar never trusts the engine's own verdict on them; it recomputes who holds
    what from the live sequences' block tables and compares.

    * ``free``: ids on the free list (unreferenced, not indexed), in allocation order. An
      id listed twice there is a double free.
    * ``cached``: ids unreferenced but still indexed (evictable), in eviction order. An
      engine with one queue for both (vLLM) splits it by whether the block has a hash.
    * ``ref_counts``, ``block_hashes``, ``generations``: per block id. ``block_hashes[b]``
      is the hash block ``b``'s current content was indexed under (``None`` when it is not
      a cached full block); ``generations`` may be empty where the engine has none.
    * ``index``: the prefix hash map as ``(hash, block id)`` entries (a hash may name several
      blocks where the engine keeps duplicates).
    * ``sequences``: each live sequence's block table in this group, in order; a block listed
      twice is held twice. These are the *holders* the invariants count.
    * ``double_frees``: releases the engine itself refused or detected as double frees,
      total since start (0 where it does not count them).
    * ``reserved``: ids kept out of circulation (vLLM's null block), skipped by the checks.
    """

    group_id: int
    num_blocks: int
    free: tuple[int, ...]
    cached: tuple[int, ...]
    ref_counts: tuple[int, ...]
    block_hashes: tuple[Hashable | None, ...]
    index: tuple[tuple[Hashable, int], ...]
    sequences: Mapping[SequenceId, tuple[int, ...]]
    generations: tuple[int, ...] = ()
    double_frees: int = 0
    reserved: tuple[int, ...] = ()


class AdapterError(RuntimeError):
    """Raised (or wrapped) when an adapter cannot answer; counted, never fatal."""


@runtime_checkable
class Adapter(Protocol):
    """What an engine offers the sidecar. Every call is made off the engine's hot path,
    from the verifier's worker, under a time limit (see :mod:`sidecar.core.time_limits`)."""

    def describe(self) -> EngineInfo:
        """Engine identity, dtype, block size and cache groups."""
        ...

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """The KV the cache holds now for ``refs``, with the generation seen while reading.

        A block that is gone (freed, evicted, reused since the match): leave its ref out,
        or return whatever its slots hold now. Either way the sidecar drops it as
        ``evicted_before_read`` when it saw the block freed or stored again since the match
        (``on_free``/``on_store``, or a changed generation); a ref left out that it did not
        see go is a ``missing_block`` adapter error. Raise only when nothing can be read:
        that drops the whole sample."""
        ...

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """Reference KV for ``refs``, computed from scratch for ``hit.tokens`` with the hit's
        own key fields (adapter, salt...): never through the cache being checked."""
        ...

    def allocator(self) -> AllocatorState | None:
        """The allocator's state, or ``None`` where the engine does not expose one."""
        ...


class EventSink(Protocol):
    """What engines call. Implementations must be O(1) and must never raise.

    Ordering the engine must keep: ``on_lookup`` for a hit *before* it gathers the hit's KV
    for the forward (a capture then copies what the request is served), and ``on_store``
    after the block's KV is written. Hooks may be called with the engine's lock held or
    after releasing it; the sidecar never calls back into the engine from a hook except
    through ``capture`` (on the same thread, so an engine lock held around ``on_lookup``
    must be re-entrant if ``capture`` takes it). Snapshots of block tables are confirmed on
    a second snapshot, so hooks that lag the lock do not read as leaks."""

    def on_lookup(self, lookup: Lookup) -> None: ...

    def on_store(self, block: StoredBlock) -> None: ...

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None: ...

    def on_request_done(self, latency_seconds: float) -> None: ...
