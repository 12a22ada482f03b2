"""The adapter contract's optional half: every capability beyond :class:`Adapter`, declared.

:mod:`sidecar.core.protocol` holds what every adapter must give (``describe``, ``read``,
``recompute``, ``allocator``) and what every engine calls (:class:`EventSink`). Everything
optional is declared here, one :class:`typing.Protocol` each, and listed in
:data:`CAPABILITIES` with who offers it (the adapter, the sampler, or the sidecar's own sink)
and, for a value, the values it may take.

Why a Protocol each rather than a declaration inside ``describe()``: the member *is* the
declaration, so an adapter cannot declare a capability it does not implement (or implement
one it forgot to declare); mypy checks an adapter written against the Protocols; and the
conformance check (:mod:`sidecar.core.conformance`) compares each member's signature with the
Protocol's the same way it does for :class:`Adapter`. What a declaration in ``describe()``
would add, a closed list of names, :data:`CAPABILITIES` gives: a member whose name looks like
one of them (``refrence_kind``) is reported as a probable misspelling.

The sidecar never probes for a capability with ``getattr`` on its own: it resolves them once,
when a Monitor attaches (:func:`sidecar.core.attach.resolve`), refuses a wrongly shaped one
with a message naming it, and runs without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sidecar.core.protocol import (
    BlockKV,
    BlockRef,
    BlockTableSnapshot,
    BlockWrite,
    Hit,
    Lookup,
    SequenceId,
    StoredBlock,
    TierState,
)

# What an adapter's recompute is (``reference_kind``), for the per-reference tolerance
# (:mod:`sidecar.checks.tolerance` takes its list from here).
# "engine": the engine's own kernels or model, *including an in-process recompute through
# the engine's own model object* (same weights, same attention backend: an error in them is
# shared by cache and reference); "independent": another implementation (a plain-torch
# forward, a separate transformers model) that shares nothing but the weights.
REFERENCE_KINDS: tuple[str, ...] = ("independent", "engine")


# ---------------------------------------------------------------- adapter capabilities
@runtime_checkable
class RemoteReference(Protocol):
    """``dispatch = "process"`` (:mod:`sidecar.adapters.remote`): a picklable factory the sidecar
    process calls once to build the reference it recomputes with (an object with this
    adapter's ``recompute`` and, optionally, ``reference_kind``). For an in-process engine
    whose recompute runs its own model: a factory of that model from its config and seed."""

    def remote_reference(self) -> Callable[[], object]: ...


@runtime_checkable
class Capture(Protocol):
    """Copy the KV the request is served *at match time*, on the engine's thread, before the
    hook returns (bounded by ``capture_max_bytes``). Ordering requirement on the engine: it
    calls ``on_lookup`` before it gathers the hit's KV for the forward; otherwise the capture
    may see bytes the forward already changed, or miss bytes it read."""

    def capture(self, hit: Hit, refs: Sequence[BlockRef]) -> Sequence[BlockKV]: ...


@runtime_checkable
class Rereads(Protocol):
    """``reread = False``: the adapter can only copy KV at match time (an out-of-process
    probe); captured blocks are judged without a later ``read``. Default: True."""

    reread: bool


@runtime_checkable
class ReferenceKind(Protocol):
    """``reference_kind``: one of :data:`REFERENCE_KINDS` (default ``"independent"``). Read
    per verification (an adapter may swap its reference), checked when the Monitor attaches;
    a value outside the list is refused there, and counted as ``"independent"`` later."""

    reference_kind: str


@runtime_checkable
class Busy(Protocol):
    """``busy()``: True while the engine is under load, so the background scrub waits."""

    def busy(self) -> bool: ...


@runtime_checkable
class AllocatorIntrospection(Protocol):
    """The allocator's block-level state, so the sidecar can check its invariants (a free
    block still indexed, a ref count below its holders, a leak, a double free). Without it
    the count-level signals of ``Adapter.allocator()`` remain. Snapshot consistency: each
    snapshot is taken under the engine's lock; where the engine changes ref counts under its
    lock but calls hooks after releasing it, a violation is reported only when a second
    snapshot confirms it (:mod:`sidecar.allocator.poll_health`)."""

    def block_tables(self) -> Sequence[BlockTableSnapshot]:
        """One snapshot per cache group with a block pool, each taken atomically."""
        ...


@runtime_checkable
class ScrubSource(Protocol):
    """Rebuild a :class:`Hit` for a block nobody is hitting, so the background scrub can
    verify it like a sampled hit."""

    def scrub_hit(self, group_id: int, block_id: int) -> Hit | None:
        """A hit ending with ``block_id`` (its full prefix tokens, the block ids and
        generations of the prefix, the key fields it was stored under), or ``None`` when
        the block is not indexed any more, is held by a live sequence now, or its prefix
        cannot be rebuilt. Takes the engine's lock only for bookkeeping, never a forward."""
        ...


@runtime_checkable
class Evictor(Protocol):
    """Quarantine: drop blocks from the engine's prefix index so later requests recompute
    them. Blocks held by live sequences stay for them; only the index entry goes."""

    def evict(self, group_id: int, block_ids: Sequence[int]) -> int:
        """Remove ``block_ids`` from the index; returns how many were removed."""
        ...


# ---------------------------------------------------------------- sampler capabilities
class ObservesStores(Protocol):
    """A sampling policy that learns from stores (boundary-biased sampling)."""

    def observe_store(self, block: StoredBlock) -> None: ...


class ObservesFrees(Protocol):
    def observe_free(self, group_id: int, block_ids: Sequence[int]) -> None: ...


class ObservesReleases(Protocol):
    def observe_release(self, group_id: int, seq_id: SequenceId,
                        block_ids: Sequence[int]) -> None: ...


# ---------------------------------------------------------------- sink capabilities
class BlockLifecycleSink(Protocol):
    """Optional events an engine may send besides :class:`EventSink`'s, for the block
    lifecycle log (allocate / store / hit / free / evict). The Monitor has them (a test
    holds it to these signatures). O(1) per block, never raising."""

    def on_allocate(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int],
                    generations: Sequence[int]) -> None:
        """Fresh blocks handed to ``seq_id``, with their new generations."""
        ...

    def on_release(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int]) -> None:
        """``seq_id`` dropped its references to ``block_ids`` (its blocks were freed)."""
        ...


class TierSink(Protocol):
    """An engine with an offload tier reports each entry's move to ``state``. A load
    (recovery) ends in ``loaded`` or ``failed`` with ``seconds`` = its duration, which fills
    the recovery histogram. Per-block tier state on a hit: ``Hit.tier_states[g]`` lists the
    state of the blocks that came through a tier; a block past its end, a group absent, is
    device-resident (no padding with ``RESIDENT``)."""

    def on_tier(self, group_id: int, block_id: int, state: TierState,
                seconds: float | None = None) -> None: ...


class CapturedSink(Protocol):
    """A hit sampled and captured elsewhere (an out-of-process probe), with its blocks."""

    def on_captured(self, lookup: Lookup, blocks: Sequence[BlockKV],
                    writes: Mapping[BlockRef, BlockWrite] | None = None) -> object: ...


@dataclass(frozen=True)
class Capability:
    """One optional capability: its member ``name`` on its ``owner`` ("adapter", "sampler"
    or "sink"), the Protocol declaring it, and for a value, the values it may take."""

    name: str
    owner: str
    protocol: type
    values: tuple[object, ...] | None = None  # a value capability's allowed values


CAPABILITIES: tuple[Capability, ...] = (
    Capability("capture", "adapter", Capture),
    Capability("reread", "adapter", Rereads, (True, False)),
    Capability("reference_kind", "adapter", ReferenceKind, REFERENCE_KINDS),
    Capability("busy", "adapter", Busy),
    Capability("block_tables", "adapter", AllocatorIntrospection),
    Capability("scrub_hit", "adapter", ScrubSource),
    Capability("evict", "adapter", Evictor),
    Capability("remote_reference", "adapter", RemoteReference),
    Capability("observe_store", "sampler", ObservesStores),
    Capability("observe_free", "sampler", ObservesFrees),
    Capability("observe_release", "sampler", ObservesReleases),
    Capability("on_allocate", "sink", BlockLifecycleSink),
    Capability("on_release", "sink", BlockLifecycleSink),
    Capability("on_tier", "sink", TierSink),
    Capability("on_captured", "sink", CapturedSink),
)


def declared(owner: str) -> tuple[Capability, ...]:
    """The capabilities an ``owner`` ("adapter", "sampler", "sink") may offer."""
    return tuple(c for c in CAPABILITIES if c.owner == owner)

