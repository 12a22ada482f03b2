"""What a failed recompute compare means in a hybrid cache: which fault family, per group.

A block that differs from its recompute is a ``recompute_mismatch`` unless the difference
has a shape that names the fault (seed 003):

* a **sliding-window** block equal to the recompute of a *neighbouring* position: the
  window was restored one block off -> ``window_mismatch``;
* a **recurrent** state equal to the state a fresh prefill reaches at an *earlier*
  boundary: the state stored for this boundary belongs to an earlier one ->
  ``stale_recurrent_state``;
* a block that came back through an **offload tier** with some layers right and others
  wrong or all zero: only some layers were copied back -> ``partial_load``.

"Equal" is the same dtype-aware (calibrated) tolerance the compare itself uses. The
neighbour and earlier-boundary recomputes are asked for only on this failure path, in one
adapter call, so clean traffic pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sidecar.checks.base import Finding
from sidecar.checks.recompute import block_error, normalized_error
from sidecar.core.protocol import BlockKV, BlockRef, CacheGroup, GroupKind
from sidecar.signals import AnomalyKind

# Earlier boundaries a recurrent state is compared with before calling it plain wrong.
STALE_LOOKBACK = 4

Recompute = Callable[[Sequence[BlockRef]], Sequence[BlockKV] | None]


def layer_errors(cached: BlockKV, reference: BlockKV) -> list[float]:
    """The normalized error of each layer (dim 0) of K and V together."""
    out = []
    for layer in range(min(cached.key.shape[0], reference.key.shape[0])):
        err = normalized_error(cached.key[layer], reference.key[layer])
        if cached.value.numel() or reference.value.numel():
            err = max(err, normalized_error(cached.value[layer], reference.value[layer]))
        out.append(err)
    return out


def check_partial_zero(block: BlockKV) -> list[Finding]:
    """A tier-loaded block whose K/V is all zero in some layers and not in others: the load
    copied back only some layers (caught before the zero-ratio check, which would call a
    mostly-zero block plain ``zeros``)."""
    key, ref = block.key, block.ref
    if key.dim() < 2 or key.shape[0] < 2 or key.numel() == 0:
        return []
    zero = [not bool(torch.any(key[i])) for i in range(key.shape[0])]
    if any(zero) and not all(zero):
        layers = [i for i, z in enumerate(zero) if z]
        return [Finding(AnomalyKind.PARTIAL_LOAD, ref.group_id, ref.index,
                        f"block {ref.block_id} came back from the tier with layers {layers} "
                        f"all zero and {len(zero) - len(layers)} others filled")]
    return []


def partial_load(cached: BlockKV, reference: BlockKV, tolerance: float) -> Finding | None:
    """Some layers within tolerance, others not: a partial copy back from the tier."""
    errs = layer_errors(cached, reference)
    bad = [i for i, e in enumerate(errs) if not e <= tolerance]
    if bad and len(bad) < len(errs):
        ref = cached.ref
        return Finding(AnomalyKind.PARTIAL_LOAD, ref.group_id, ref.index,
                       f"block {ref.block_id} after a tier load: layers {bad} differ from "
                       f"the recompute, the other {len(errs) - len(bad)} match", max(errs))
    return None


def misplaced(group: CacheGroup | None, ref: BlockRef, stored_at: int, block_size: int,
              finding: Finding) -> Finding:
    """A ``token_mismatch`` because the block was *stored at another position*, read per
    group kind: a sliding-window block stored one block off is the window restored off by
    one (``window_mismatch``); a recurrent block stored at an earlier boundary is that
    boundary's state (``stale_recurrent_state``). Any other finding is returned as is."""
    if group is None or finding.kind is not AnomalyKind.TOKEN_MISMATCH \
            or stored_at % block_size:
        return finding
    at = stored_at // block_size
    if group.kind is GroupKind.SLIDING_WINDOW and abs(at - ref.index) == 1:
        return Finding(AnomalyKind.WINDOW_MISMATCH, ref.group_id, ref.index,
                       f"group {group.label}: position #{ref.index} maps to block "
                       f"{ref.block_id}, stored for position #{at} (window restored "
                       f"{at - ref.index:+d} block off)")
    if group.kind is GroupKind.RECURRENT_STATE and at < ref.index:
        return Finding(AnomalyKind.STALE_RECURRENT_STATE, ref.group_id, ref.index,
                       f"group {group.label}: boundary #{ref.index} maps to block "
                       f"{ref.block_id}, the state stored for the earlier boundary #{at}")
    return finding


def suspects(group: CacheGroup, ref: BlockRef, n_blocks: int) -> list[BlockRef]:
    """Positions whose recompute a failed block of ``group`` is compared with."""
    near: tuple[int, ...]
    if group.kind is GroupKind.SLIDING_WINDOW:
        near = (ref.index - 1, ref.index + 1)
    elif group.kind is GroupKind.RECURRENT_STATE:
        near = tuple(range(ref.index - 1, max(-1, ref.index - 1 - STALE_LOOKBACK), -1))
    else:
        return []
    return [BlockRef(ref.group_id, i, ref.block_id) for i in near if 0 <= i < n_blocks]


def explain(failed: Sequence[tuple[BlockKV, float]], groups: dict[int, CacheGroup],
            tier_loaded: Callable[[BlockRef], bool], references: dict[BlockRef, BlockKV],
            recompute: Recompute, n_blocks: int, tolerance: float,
            detail: Callable[[float], str]) -> list[Finding]:
    """One finding per failed ``(cached block, error)``: partial load, window mismatch,
    stale recurrent state, else recompute mismatch. ``n_blocks`` is how many blocks the
    hit's tokens cover (neighbours past it cannot be recomputed)."""
    out: dict[BlockRef, Finding] = {}
    asked: dict[BlockRef, list[BlockRef]] = {}
    for cached, _ in failed:
        ref = cached.ref
        if tier_loaded(ref) and ref in references:
            found = partial_load(cached, references[ref], tolerance)
            if found is not None:
                out[ref] = found
                continue
        group = groups.get(ref.group_id)
        candidates = suspects(group, ref, n_blocks) if group is not None else []
        if candidates:
            asked[ref] = candidates
    answers: dict[tuple[int, int], BlockKV] = {}
    if asked:
        got = recompute([r for rs in asked.values() for r in rs]) or ()
        answers = {(b.ref.group_id, b.ref.index): b for b in got}
    for cached, err in failed:
        ref = cached.ref
        if ref in out:
            continue
        for near in asked.get(ref, ()):
            other = answers.get((near.group_id, near.index))
            if other is None or block_error(cached, other) > tolerance:
                continue
            group = groups[ref.group_id]
            if group.kind is GroupKind.SLIDING_WINDOW:
                out[ref] = Finding(AnomalyKind.WINDOW_MISMATCH, ref.group_id, ref.index,
                                   f"group {group.label}: block {ref.block_id} at #{ref.index} "
                                   f"holds the KV of position #{near.index} (window restored "
                                   f"{near.index - ref.index:+d} block off)", err)
            else:
                out[ref] = Finding(AnomalyKind.STALE_RECURRENT_STATE, ref.group_id, ref.index,
                                   f"group {group.label}: the state at boundary #{ref.index} "
                                   f"is the state of the earlier boundary #{near.index}", err)
            break
        else:
            out[ref] = Finding(AnomalyKind.RECOMPUTE_MISMATCH, ref.group_id, ref.index,
                               detail(err), err)
    return [out[c.ref] for c, _ in failed]
