"""Ground truth for the detection benchmark: which cached blocks hold the wrong KV.

Independent of the sidecar and of how each fault works, so the benchmark can score a fault
it has never seen. Per physical block of the pool it keeps:

* a **shadow copy** of the bytes the clean write path would have stored: every write and
  every tier load goes to the shadow as well, but faults only ever touch the real pool, so
  ``real != shadow`` (bit for bit) means something changed the block's bytes;
* an **identity**: the strong chained hash (tokens + key fields, never a fault's weak hash)
  of the prefix the block's content was computed for, so a block reused while indexed, or
  reached through a colliding or incomplete key, is wrong for a hit even with exact bytes;
* a **taint** flag: the content was computed while its sequence attended over a wrong
  block (a request that decoded over a zeroed block writes wrong KV with exact bytes).

A block is *corrupt* for a hit when its bytes differ from the shadow or its identity is not
the hit's own prefix: what the fault did. It is *tainted* when its bytes and identity are
right but were computed over a wrong past: a side effect that may be large (KV computed over
a zeroed block) or nil (a NaN in the last layer never reaches another block's KV), so the
benchmark neither counts it as a miss when unflagged nor as a false alarm when flagged. The
engine feeds this tracker only when
``EngineConfig.track_truth`` is set (it costs a second copy of the pool and a comparison
of every block a sequence attends over).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtestbed.engines.blocks import BlockData, BlockHash, KeyFields, chain_hash
from kvtestbed.engines.pool import BlockPool
from sidecar.core.protocol import Hit

if TYPE_CHECKING:
    from kvtestbed.engines.sequence import RunningSequence

Identity = BlockHash | tuple[str, int] | None  # chained hash; ("partial", seq id); unknown

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN with the same payload, 0.0 != -0.0)."""
    view = _INT_VIEW[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


@dataclass(frozen=True)
class BlockTruth:
    """What travels with a block through the offload tier."""

    shadow: BlockData
    identity: Identity
    tainted: bool


class GroundTruth:
    """Shadow pool, identities and taints of one cache group (see the module docstring)."""

    def __init__(self, pool: BlockPool, key_field_names: Sequence[str]) -> None:
        self.pool = pool
        self.key_field_names = tuple(key_field_names)
        layers, num_blocks, heads, bs, dim = pool.key.shape
        self.shadow = BlockPool(num_blocks, bs, layers, heads, dim, pool.dtype,
                                kv_storage=pool.kv_storage)
        self.identity: list[Identity] = [None] * num_blocks
        self.tainted = [False] * num_blocks
        self._seq_tainted: dict[int, bool] = {}
        self._chains: dict[int, list[BlockHash]] = {}

    # ------------------------------------------------------------------ engine feed
    def allocated(self, seq_id: int, block_ids: Sequence[int]) -> None:
        """Fresh blocks: nothing valid in them until their new owner fills them."""
        for b in block_ids:
            self.identity[b] = ("partial", seq_id)
            self.tainted[b] = False

    def written(self, seq: RunningSequence, start: int, keys: torch.Tensor,
                values: torch.Tensor) -> None:
        """The clean write (no skipped blocks, no faulty scale) goes to the shadow."""
        self.shadow.write(seq.blocks, start, keys, values)
        if self._seq_tainted.get(seq.seq_id, False):
            bs = self.pool.block_size
            first, last = start // bs, (start + int(keys.shape[2]) - 1) // bs
            for b in seq.blocks[first:last + 1]:
                self.tainted[b] = True

    def gathered(self, seq: RunningSequence, num_tokens: int) -> None:
        """``seq`` attends over its first ``num_tokens`` positions: if any block it reads is
        bad, everything it computes from now on is tainted."""
        if self._seq_tainted.get(seq.seq_id, False):
            return
        bs = self.pool.block_size
        full = num_tokens // bs
        chain = self._chain(seq.seq_id, seq.tokens, seq.key_fields, full)
        for i in range(-(-num_tokens // bs)):
            b = seq.blocks[i]
            if i < full:
                ok = self._valid(b, chain[i], bs)
            else:
                ok = self._valid(b, ("partial", seq.seq_id), num_tokens - full * bs)
            if not ok:
                self._seq_tainted[seq.seq_id] = True
                return

    def filled(self, seq: RunningSequence, index: int, block_id: int) -> None:
        """Block ``index`` of ``seq`` is full: its content now stands for seq's prefix."""
        self.identity[block_id] = self._chain(seq.seq_id, seq.tokens, seq.key_fields,
                                              index + 1)[index]

    def finished(self, seq_id: int) -> None:
        self._seq_tainted.pop(seq_id, None)
        self._chains.pop(seq_id, None)

    def spill(self, block_id: int) -> BlockTruth:
        return BlockTruth(self.shadow.export_block(block_id), self.identity[block_id],
                          self.tainted[block_id])

    def loaded(self, block_id: int, truth: object) -> None:
        """A tier load into ``block_id``: the shadow gets what the load should have put."""
        if not isinstance(truth, BlockTruth):
            self.identity[block_id] = None  # spilled before tracking began: unknown
            return
        self.shadow.import_block(block_id, truth.shadow)
        self.identity[block_id] = truth.identity
        self.tainted[block_id] = truth.tainted

    # ------------------------------------------------------------------ queries
    def bad_blocks(self, hit: Hit, group_id: int = 0) -> list[int]:
        """Indices (within the hit) of the hit's blocks that do not hold the KV the hit's
        own tokens and key fields need, corrupt or tainted. Call it while the hit is current
        (at lookup)."""
        corrupt, tainted = self.classify(hit, group_id)
        return sorted(corrupt + tainted)

    def classify(self, hit: Hit, group_id: int = 0) -> tuple[list[int], list[int]]:
        """(corrupt, tainted) block indices of the hit (see the module docstring)."""
        ids = hit.blocks.get(group_id, ())
        bs = self.pool.block_size
        fields = tuple((n, str(hit.key_fields.get(n, ""))) for n in self.key_field_names)
        chain = _extend_chain([], hit.tokens, fields, len(ids), bs)
        corrupt: list[int] = []
        tainted: list[int] = []
        for i, b in enumerate(ids):
            if not self._exact(int(b), chain[i], bs):
                corrupt.append(i)
            elif self.tainted[int(b)]:
                tainted.append(i)
        return corrupt, tainted

    def _valid(self, block_id: int, identity: Identity, slots: int) -> bool:
        return not self.tainted[block_id] and self._exact(block_id, identity, slots)

    def _exact(self, block_id: int, identity: Identity, slots: int) -> bool:
        """The block's bytes are the clean write's and stand for ``identity``."""
        if self.identity[block_id] != identity:
            return False
        real, shadow = self.pool, self.shadow
        pairs = [(real.key, shadow.key), (real.value, shadow.value)]
        if real.kv_storage is not None:
            pairs += [(real.key_scale, shadow.key_scale), (real.value_scale, shadow.value_scale)]
        return all(_bits_equal(a[:, block_id, :, :slots], b[:, block_id, :, :slots])
                   for a, b in pairs)

    def _chain(self, seq_id: int, tokens: Sequence[int], key_fields: KeyFields,
               n: int) -> list[BlockHash]:
        chain = self._chains.setdefault(seq_id, [])
        return _extend_chain(chain, tokens, key_fields, n, self.pool.block_size)


def _extend_chain(chain: list[BlockHash], tokens: Sequence[int], key_fields: KeyFields,
                  n: int, block_size: int) -> list[BlockHash]:
    for i in range(len(chain), n):
        chain.append(chain_hash(chain[i - 1] if i else None,
                                tokens[i * block_size:(i + 1) * block_size], key_fields))
    return chain
