"""Faults of hybrid caches (sliding window + full, recurrent state + full), engine side.

Each reproduces a class of public bug reports where one cache group of a hybrid model held
missing or stale state on a hit (vLLM 43559, RFC 47812; SGLang 31108, 31218; Mooncake 2236):
the prefix hash matched, the full-attention group was right, and another group was not.
They act through :class:`~kvtestbed.engines.hybrid_engine.HybridEngine`'s hooks
(``on_hybrid_hit``, ``state_to_store``, ``on_group_block_full``), always on group 1 (the
sliding-window or recurrent group), and record every injection. ``needs_groups`` says which
group kinds a fault needs; the detection benchmark runs it only on models that have them.
The offload-tier faults (failed load, partial load) live with the tier.

What the sidecar reports for each (measured with the hybrid checks merged, float32):
window-mismatch -> window_mismatch; null-block-read -> null_block_read;
stale-recurrent-state -> stale_recurrent_state; missing-group-state, evicted-between-match-
and-read, group-layout-mismatch -> recompute_mismatch on group 1 (the served block holds some
other content; the evicted one sometimes stale_recurrent_state, its donor being an earlier
boundary's state); recurrent-double-apply -> recompute_mismatch on group 1;
recurrent-splice-skip -> stale_recurrent_state on group 1 (the state of an earlier boundary).
Importing the
package (``kvtestbed.engines``) imports this module, which adds these faults to
:data:`~kvtestbed.engines.faults.FAULTS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvtestbed.engines.faults import FAULTS, Fault

if TYPE_CHECKING:
    from kvtestbed.engines.sequence import RunningSequence

OTHER_GROUP = 1  # the hybrid engine's non-full group (sliding window or recurrent state)
_SLIDING, _RECURRENT = "sliding_window", "recurrent_state"


def _required(engine: Any, seq: RunningSequence, hit_blocks: int) -> range:
    req: range = engine.required(OTHER_GROUP, hit_blocks * engine.block_size)
    return req


class WindowMismatch(Fault):
    name = "window-mismatch"
    description = ("a sliding-window hit's window is restored one block off: every in-window "
                   "position holds the block of the position before it")
    corrupts_kv = True
    default_probability = 0.3
    needs_groups = frozenset({_SLIDING})

    def on_hybrid_hit(self, engine: Any, seq: RunningSequence, hit_blocks: int) -> None:
        req = _required(engine, seq, hit_blocks)
        if not (self.active(seq.seq_id) and len(req) and req.start >= 1 and self.chance()):
            return
        pool = engine.pools[OTHER_GROUP]
        earlier = [pool.find(seq.block_hashes[i - 1]) for i in req]
        if any(b is None for b in earlier):
            return  # the block before the window was evicted: nothing to shift onto
        for i, b in zip(req, earlier, strict=True):
            engine.swap(seq, OTHER_GROUP, i, b)
        self.record(seq.seq_id, engine.table(seq, OTHER_GROUP)[req.start],
                    f"window blocks {req.start}..{req.stop - 1} hold blocks "
                    f"{req.start - 1}..{req.stop - 2}")


class NullBlockRead(Fault):
    name = "null-block-read"
    description = ("an in-window (or the boundary-state) position of a hybrid hit is served "
                   "from the group's null block")
    corrupts_kv = True
    default_probability = 0.3
    needs_groups = frozenset({_SLIDING, _RECURRENT})

    def on_hybrid_hit(self, engine: Any, seq: RunningSequence, hit_blocks: int) -> None:
        req = _required(engine, seq, hit_blocks)
        if not (self.active(seq.seq_id) and len(req) and self.chance()):
            return
        i = req.start
        engine.swap(seq, OTHER_GROUP, i, engine.null_block(OTHER_GROUP))
        self.record(seq.seq_id, engine.null_block(OTHER_GROUP),
                    f"required block {i} of group {OTHER_GROUP} mapped to the null block")


class MissingGroupState(Fault):
    name = "missing-group-state"
    description = ("a hit is matched on the full-attention group alone: the other group's "
                   "state for the hit's last block was evicted and a fresh, unwritten block "
                   "is served in its place")
    corrupts_kv = True
    default_probability = 0.3
    needs_groups = frozenset({_SLIDING, _RECURRENT})

    def on_hybrid_hit(self, engine: Any, seq: RunningSequence, hit_blocks: int) -> None:
        if not (self.active(seq.seq_id) and hit_blocks and self.chance()):
            return
        fresh = engine.fresh_block(seq, OTHER_GROUP)
        if fresh is None:
            return
        engine.swap(seq, OTHER_GROUP, hit_blocks - 1, fresh)
        self.record(seq.seq_id, fresh, f"group {OTHER_GROUP} block {hit_blocks - 1} served "
                    "from a fresh block (state evicted)")


class EvictedBetweenMatchAndRead(Fault):
    name = "evicted-between-match-and-read"
    description = ("a matched block of the other group is evicted and reused by another "
                   "request between the match and the read (the reference was taken late)")
    corrupts_kv = True
    default_probability = 0.3
    needs_groups = frozenset({_SLIDING, _RECURRENT})

    def on_hybrid_hit(self, engine: Any, seq: RunningSequence, hit_blocks: int) -> None:
        req = _required(engine, seq, hit_blocks)
        if not (self.active(seq.seq_id) and len(req) and self.chance()):
            return
        i = req.stop - 1
        b = engine.table(seq, OTHER_GROUP)[i]
        if engine.pools[OTHER_GROUP].blocks[b].ref_count != 1:
            return  # held by a running sequence too: it could not have been evicted
        donor = engine.clobber(OTHER_GROUP, b, self.rng)
        if donor is not None:
            self.record(seq.seq_id, b, f"group {OTHER_GROUP} block {i} evicted and rewritten "
                        f"with block {donor}'s content before the read")


class StaleRecurrentState(Fault):
    name = "stale-recurrent-state"
    description = ("the recurrent state stored for a block boundary is the one of the "
                   "boundary before (an off-by-one in which snapshot is copied)")
    corrupts_kv = True
    default_probability = 0.2
    needs_groups = frozenset({_RECURRENT})

    def state_to_store(self, engine: Any, seq: RunningSequence, index: int,
                       state: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        if previous is None or not (self.active(seq.seq_id) and self.chance()):
            return state
        self.record(seq.seq_id, engine.table(seq, OTHER_GROUP)[index],
                    f"boundary {index} stored with the state of boundary {index - 1}")
        return previous


class RecurrentDoubleApply(Fault):
    name = "recurrent-double-apply"
    description = ("the recurrent checkpoint at a prompt that ends on an exact block multiple "
                   "already includes the last token, and the engine applies that token's "
                   "state transition again (LMCache 5151): the conv window shifts twice")
    corrupts_kv = True
    default_probability = 1.0  # every exact-multiple checkpoint: the bug is deterministic
    needs_groups = frozenset({_RECURRENT})

    def state_to_store(self, engine: Any, seq: RunningSequence, index: int,
                       state: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        bs = engine.block_size
        end = (index + 1) * bs
        if end != seq.prompt_len or not (self.active(seq.seq_id) and self.chance()):
            return state
        # A short convolution's state is its last L inputs (last dim): applying the last
        # input again shifts the window once more and repeats that input.
        twice = torch.cat([state[..., 1:], state[..., -1:]], dim=-1)
        if torch.equal(twice, state):
            return state
        self.record(seq.seq_id, engine.table(seq, OTHER_GROUP)[index],
                    f"boundary {index} (prompt end, {end} tokens) stored with the last "
                    "token's transition applied twice")
        return twice


class RecurrentSpliceSkip(Fault):
    name = "recurrent-splice-skip"
    description = ("a hit's full-attention blocks reach a deeper boundary than the recurrent "
                   "state it restores: the state of a shorter prefix is spliced in at the "
                   "hit's last boundary, skipping the transitions in between (LMCache PR "
                   "4843)")
    corrupts_kv = True
    default_probability = 0.5
    needs_groups = frozenset({_RECURRENT})

    def on_hybrid_hit(self, engine: Any, seq: RunningSequence, hit_blocks: int) -> None:
        if hit_blocks < 2 or not (self.active(seq.seq_id) and self.chance()):
            return
        last = hit_blocks - 1
        pool = engine.pools[OTHER_GROUP]
        # The shorter prefix's snapshot: any earlier boundary of this prompt still indexed
        # (a block the group released as the sequence advanced stays findable).
        shorter = [(i, b) for i in range(last) if (b := pool.find(seq.block_hashes[i]))
                   is not None and b != engine.null_block(OTHER_GROUP)]
        if not shorter:
            return
        i, b = self.rng.choice(shorter)
        engine.swap(seq, OTHER_GROUP, last, b)
        self.record(seq.seq_id, b, f"boundary {last} restored with the state of boundary {i}: "
                    f"{last - i} block(s) of transitions skipped")


class GroupLayoutMismatch(Fault):
    name = "group-layout-mismatch"
    description = ("one cache group only (sliding window or recurrent state) writes its "
                   "blocks in the wrong layout (token-major bytes in a head-major block); "
                   "the full-attention group stays right")
    corrupts_kv = True
    default_probability = 0.3
    needs_groups = frozenset({_SLIDING, _RECURRENT})

    def on_group_block_full(self, engine: Any, seq: RunningSequence, group_id: int,
                            block_id: int) -> None:
        if group_id != OTHER_GROUP or not (self.active(seq.seq_id) and self.chance()):
            return
        pool = engine.pools[group_id]
        blk = pool.key[:, block_id]
        before = blk.clone()
        pool.key[:, block_id] = blk.transpose(1, 2).contiguous().view(blk.shape)
        if not torch.equal(before, pool.key[:, block_id]):
            self.record(seq.seq_id, block_id, f"group {group_id} block written transposed")


HYBRID_FAULTS: tuple[type[Fault], ...] = (
    WindowMismatch, MissingGroupState, StaleRecurrentState, NullBlockRead,
    EvictedBetweenMatchAndRead, GroupLayoutMismatch, RecurrentDoubleApply,
    RecurrentSpliceSkip)
FAULTS.update({cls.name: cls for cls in HYBRID_FAULTS})  # listed with every other fault

# The cache-group kinds of each model the reference engine runs (``--model``).
MODEL_GROUP_KINDS: dict[str, frozenset[str]] = {
    "reference": frozenset({"full_attention"}),
    "hybrid": frozenset({"full_attention", "sliding_window"}),
    "recurrent": frozenset({"full_attention", "recurrent_state"}),
}


def fault_applies(name: str, model: str) -> bool:
    """Whether fault ``name`` can act on ``model`` (hybrid faults need their groups)."""
    return name in FAULTS and model in MODEL_GROUP_KINDS \
        and FAULTS[name].applies_to(MODEL_GROUP_KINDS[model])
