"""Fault injection, the base every fault builds on: real cache-manager bugs, reproduced on
demand, by name, under a seed.

Each fault is one small class that overrides one or two engine hooks; the engine calls every
hook on every request and a clean :class:`Fault` does nothing. Hooks run in the engine
thread, with the engine's lock held where they touch the pool. A fault stays dormant until
request index ``start_after`` (so dashboards show a clean start), draws every random choice
from its own seeded RNG (so a run is reproducible), and records each injection as ground
truth for the detection benchmark. See ``/FAULTS.md`` for the catalogue and who should
catch each one.

Adding a fault: subclass :class:`Fault`, set ``name`` and ``description``, override hooks,
declare in ``engine_needs`` any engine setting it cannot act without (a CPU tier, int8
storage), and add it to :data:`~kvtestbed.engines.faults.FAULTS`; ``kv-sidecar bench
detection`` then scores it against the engine's ground truth without further code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvtestbed.engines.model import derive_seed
from kvtestbed.engines.pool import BlockHash, KeyFields

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvtestbed.engines.sequence import EngineView as ReferenceEngine
    from kvtestbed.engines.sequence import RunningSequence


MAX_INJECTIONS = 10_000  # ground-truth records kept (bounded memory on long runs)


@dataclass(frozen=True)
class Injection:
    """One place a fault acted: which request, which block, what it did."""

    request_index: int
    block_id: int | None
    detail: str


class Fault:
    """No fault: the clean engine. Base class of every fault; each hook is a no-op.

    ``corrupts_kv``: the fault changes KV the model decodes over (the others break the
    allocator's accounting instead).
    """

    name: ClassVar[str] = "none"
    description: ClassVar[str] = "no fault: the clean engine"
    corrupts_kv: ClassVar[bool] = False
    default_probability: ClassVar[float] = 1.0
    default_start_after: ClassVar[int] = 20
    # Engine settings the fault needs to act at all (a CPU tier, quantised storage); the
    # engine turns them on where its config left them at their defaults.
    engine_needs: ClassVar[dict[str, Any]] = {}
    # Cache-group kinds (GroupKind values) a hybrid fault acts on; empty: a fault of the
    # plain reference engine (one full-attention group). See applies_to.
    needs_groups: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, seed: int = 0, start_after: int | None = None,
                 probability: float | None = None) -> None:
        self.seed = seed
        self.start_after = self.default_start_after if start_after is None else start_after
        self.probability = self.default_probability if probability is None else probability
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability}")
        self.rng = random.Random(derive_seed("fault", self.name, seed))
        self.injections: list[Injection] = []

    def active(self, request_index: int) -> bool:
        return request_index >= self.start_after

    def chance(self) -> bool:
        return self.rng.random() < self.probability

    def record(self, request_index: int, block_id: int | None, detail: str) -> None:
        if len(self.injections) < MAX_INJECTIONS:
            self.injections.append(Injection(request_index, block_id, detail))

    # ------------------------------------------------------------------ hooks
    def block_hash(self, request_index: int, parent: BlockHash | None, tokens: Sequence[int],
                   key_fields: KeyFields) -> BlockHash | None:
        """Replace the block hash; ``None`` keeps the engine's strong chained hash."""
        return None

    def before_allocate(self, engine: ReferenceEngine, request_index: int) -> None:
        """Before the blocks of request ``request_index`` are allocated."""

    def on_hit(self, engine: ReferenceEngine, seq: RunningSequence,
               block_ids: Sequence[int]) -> None:
        """After a lookup found ``block_ids`` for ``seq`` (ground truth for key faults)."""

    def on_allocate(self, engine: ReferenceEngine, seq: RunningSequence,
                    block_ids: Sequence[int]) -> None:
        """After fresh blocks were allocated for ``seq`` (before anything is written)."""

    def on_block_full(self, engine: ReferenceEngine, seq: RunningSequence,
                      block_id: int) -> None:
        """A block of ``seq`` became full, before it is indexed, digested and reported:
        write-path bugs act here (the write-time digest then certifies the wrong bytes, as
        a real engine's would)."""

    def on_block_stored(self, engine: ReferenceEngine, seq: RunningSequence,
                        block_id: int) -> None:
        """After a full block was indexed and reported (its write-time digest taken)."""

    def tier_key_fields(self, request_index: int, key_fields: KeyFields) -> KeyFields | None:
        """The key fields the CPU tier's key keeps for request ``request_index``; ``None``:
        the device tier's key, every field (the tier key is then the block hash itself)."""
        return None

    def published_hit_tokens(self, request_index: int, total: int, batch: int) -> int:
        """The value the engine's own prefix-cache hit metric shows: ``total`` hit tokens
        since start (a counter); ``batch``: the hit tokens of the current batch."""
        return total

    def load_fails(self, engine: ReferenceEngine, request_index: int, block_id: int) -> bool:
        """Whether the CPU-tier load into ``block_id`` silently fails (the engine reports it
        loaded, indexes it and serves it as a hit either way)."""
        return False

    def load_layers(self, engine: ReferenceEngine, request_index: int, block_id: int,
                    num_layers: int) -> Sequence[int] | None:
        """The layers the CPU-tier load into ``block_id`` copies back; ``None`` = all."""
        return None

    def unawaited_layers(self, engine: ReferenceEngine, request_index: int, block_id: int,
                         num_layers: int) -> int | None:
        """``None``: the engine waits for the CPU-tier load into ``block_id`` before using
        it. A count ``k``: the engine serves the block once ``k`` layers are copied, while
        the load is still in flight (the copy completes after the prefill)."""
        return None

    def release(self, engine: ReferenceEngine, seq: RunningSequence) -> list[int] | None:
        """Release ``seq``'s blocks instead of the engine; ``None`` = the clean release.
        Returns the blocks that left the index (the engine reports them freed)."""
        return None

    # ------------------------------------------------------------------ hybrid hooks
    # Called by HybridEngine only (hybrid_engine.py), with its lock held.
    @classmethod
    def applies_to(cls, group_kinds: frozenset[str]) -> bool:
        """Whether the fault can act on an engine whose groups have ``group_kinds``: plain
        faults on the one-group reference engine, hybrid faults where their groups are."""
        if cls.name == "none":
            return True
        if not cls.needs_groups:
            return group_kinds == frozenset({"full_attention"})
        return bool(cls.needs_groups & group_kinds)

    def on_hybrid_hit(self, engine: Any, seq: RunningSequence, hit_blocks: int) -> None:
        """After a hybrid hit of ``hit_blocks`` blocks was matched and allocated, before
        it is reported and read: block-table bugs rewrite ``seq.block_table`` here
        (through ``engine.swap``)."""

    def state_to_store(self, engine: Any, seq: RunningSequence, index: int,
                       state: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """The recurrent state the engine stores for boundary block ``index`` (``previous``:
        the state it stored for the boundary before, if any)."""
        return state

    def on_group_block_full(self, engine: Any, seq: RunningSequence, group_id: int,
                            block_id: int) -> None:
        """A block of a hybrid group became full, before it is indexed and reported."""
