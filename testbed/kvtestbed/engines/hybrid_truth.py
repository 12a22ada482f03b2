"""Ground truth of the hybrid engine, per cache group: which hit blocks hold wrong state.

The same three facts as :mod:`.truth` keeps for the plain engine, per group: a **shadow**
copy of what the clean write path stored (faults only touch the real pools), an
**identity** (the strong chained hash of the prefix a block's content stands for), and a
**taint** (computed while its sequence read a wrong block). A hit block is *corrupt* when it
sits at a position its group must cover (:func:`sidecar.checks.group_coverage.required_blocks`) and
is
the null block, or stands for another prefix, or its bytes differ from the shadow. Null
blocks outside the coverage are correct by definition: that is the hybrid cache working.
Results are ``(group_id, index)`` pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvtestbed.engines.blocks import BlockHash
from kvtestbed.engines.pool import BlockPool
from kvtestbed.engines.sequence import KEY_FIELD_NAMES
from kvtestbed.engines.truth import Identity, _bits_equal, _extend_chain
from sidecar.core.protocol import Hit

if TYPE_CHECKING:
    from kvtestbed.engines.sequence import RunningSequence
    from sidecar.core.protocol import CacheGroup


class HybridView(Protocol):
    """What the truth reads of the hybrid engine (its pools, groups and coverage rule)."""

    pools: dict[int, BlockPool]
    groups: tuple[CacheGroup, ...]
    block_size: int

    def required(self, group_id: int, hit_tokens: int) -> range: ...

GroupIndex = tuple[int, int]


class HybridTruth:
    """Shadow pools, identities and taints of every group of a hybrid engine."""

    def __init__(self, engine: HybridView) -> None:
        self.engine = engine
        self.shadow: dict[int, BlockPool] = {}
        self.identity: dict[int, list[Identity]] = {}
        self.tainted: dict[int, list[bool]] = {}
        for g, pool in engine.pools.items():
            layers, num_blocks, heads, slots, dim = pool.key.shape
            self.shadow[g] = BlockPool(num_blocks, slots, layers, heads, dim, pool.dtype)
            self.identity[g] = [None] * num_blocks
            self.tainted[g] = [False] * num_blocks
        self._seq_tainted: dict[int, bool] = {}
        self._chains: dict[int, list[BlockHash]] = {}  # per live sequence, grown as it runs

    # ------------------------------------------------------------------ engine feed
    def allocated(self, group_id: int, seq_id: int, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self.identity[group_id][b] = ("partial", seq_id)
            self.tainted[group_id][b] = False

    def admitted(self, seq: RunningSequence, hit: Hit) -> None:
        """A sequence that starts from a wrong hit block computes everything over it."""
        corrupt, tainted = self.classify(hit)
        if corrupt or tainted:
            self._seq_tainted[seq.seq_id] = True

    def written(self, group_id: int, seq: RunningSequence, start: int, keys: torch.Tensor,
                values: torch.Tensor) -> None:
        table = seq.block_table[group_id]
        self.shadow[group_id].write(table, start, keys, values,
                                    skip=frozenset({0}) if group_id else frozenset())
        if self._seq_tainted.get(seq.seq_id, False):
            bs = self.engine.block_size
            for b in table[start // bs:(start + int(keys.shape[2]) - 1) // bs + 1]:
                self.tainted[group_id][b] = True

    def state_written(self, block_id: int, state: torch.Tensor) -> None:
        self.shadow[1].key[:, block_id, :, :, 0] = state

    def filled(self, group_id: int, seq: RunningSequence, index: int, block_id: int) -> None:
        chain = _extend_chain(self._chains.setdefault(seq.seq_id, []), seq.tokens,
                              seq.key_fields, index + 1, self.engine.block_size)
        self.identity[group_id][block_id] = chain[index]
        if self._seq_tainted.get(seq.seq_id, False):
            self.tainted[group_id][block_id] = True

    def clobbered(self, group_id: int, block_id: int) -> None:
        """Another request's content: stands for nothing this cache indexed."""
        self.identity[group_id][block_id] = None

    def gathered(self, seq: RunningSequence, num_tokens: int) -> None:
        """``seq`` attends over its first ``num_tokens`` positions (every group but the
        recurrent one, whose state was checked at admission): a wrong full block taints it.
        """
        if self._seq_tainted.get(seq.seq_id, False):
            return
        bs = self.engine.block_size
        full = num_tokens // bs
        chain = _extend_chain(self._chains.setdefault(seq.seq_id, []), seq.tokens,
                              seq.key_fields, full, bs)
        for g, group in enumerate(self.engine.groups):
            if group.kind.value == "recurrent_state":
                continue
            for i in range(self.engine.required(g, num_tokens).start, full):
                if not self._exact(g, seq.block_table[g][i], chain[i]):
                    self._seq_tainted[seq.seq_id] = True
                    return

    def finished(self, seq_id: int) -> None:
        self._seq_tainted.pop(seq_id, None)
        self._chains.pop(seq_id, None)

    # ------------------------------------------------------------------ queries
    def classify(self, hit: Hit, group_id: int | None = None,
                 ) -> tuple[list[GroupIndex], list[GroupIndex]]:
        """(corrupt, tainted) ``(group, index)`` pairs of the hit's required blocks."""
        fields = tuple((n, str(hit.key_fields.get(n, ""))) for n in KEY_FIELD_NAMES)
        n_blocks = hit.hit_tokens // self.engine.block_size
        chain = self._chain(hit.tokens, fields, n_blocks)
        corrupt: list[GroupIndex] = []
        tainted: list[GroupIndex] = []
        for g, group in enumerate(self.engine.groups):
            ids = hit.blocks.get(g, ())
            for i in self.engine.required(g, hit.hit_tokens):
                if i >= len(ids):
                    corrupt.append((g, i))
                    continue
                b = int(ids[i])
                if (g and b in group.null_block_ids) or not self._exact(g, b, chain[i]):
                    corrupt.append((g, i))
                elif self.tainted[g][b]:
                    tainted.append((g, i))
        return corrupt, tainted

    def _exact(self, group_id: int, block_id: int, identity: Identity) -> bool:
        if self.identity[group_id][block_id] != identity:
            return False
        real, shadow = self.engine.pools[group_id], self.shadow[group_id]
        return (_bits_equal(real.key[:, block_id], shadow.key[:, block_id])
                and _bits_equal(real.value[:, block_id], shadow.value[:, block_id]))

    def _chain(self, tokens: Sequence[int], key_fields: tuple[tuple[str, str], ...],
               n: int) -> list[BlockHash]:
        return _extend_chain([], tokens, key_fields, n, self.engine.block_size)
