"""Coverage of a hybrid hit, group by group: does every cache group the engine declares hold
real, usable state for the positions it must cover? No adapter call, no bytes read.

A prefix-hash hit only proves the prefix was computed once. In a hybrid model the request
is served by every group together (vLLM's hybrid intersection), so for each group of
:attr:`EngineInfo.groups` and each position :func:`sidecar.checks.group_coverage.required_blocks`
says
it must hold:

* no block at all (the group is absent from the hit, or its list stops short) ->
  ``missing_group_state`` (evicted between match and use, a group forgotten);
* the group's null (padding) block -> ``null_block_read``: the engine would read padding as
  KV;
* an offload-tier entry that is not ``resident``/``loaded`` at match time ->
  ``tier_not_loaded`` (served while still loading, or after a failed load).

Positions a group need not cover are never judged here: a sliding-window group's blocks
before its window are legitimately null or freed, and a *real* block there is fine too (an
engine may free out-of-window blocks lazily; attention never reads them, so their content
cannot hurt the request). A recurrent group needs only its last boundary. A group of kind
``offloaded_tier`` is judged only on hits that list it (a tier is where blocks may come
from, not state every hit holds); tier entries of the other groups come as
``Hit.tier_states``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sidecar.checks.base import Finding
from sidecar.checks.group_coverage import is_null, required_blocks
from sidecar.core.protocol import CacheGroup, EngineInfo, GroupKind, Hit, TierState
from sidecar.signals import AnomalyKind

# Tier states a hit may be served from (see TierState).
USABLE_TIER_STATES = frozenset({TierState.RESIDENT, TierState.LOADED})


def check_coverage(hit: Hit, info: EngineInfo) -> list[Finding]:
    """Findings for every group of ``info`` that cannot serve ``hit``; at most one
    ``missing_group_state`` per group (its first missing position), one finding per
    null or unloaded position. O(required blocks); runs only for sampled hits."""
    out: list[Finding] = []
    for group in info.groups:
        if group.kind is GroupKind.OFFLOADED_TIER and group.group_id not in hit.blocks:
            continue  # a tier is where blocks may come from, not state every hit holds
        need = required_blocks(group, hit.hit_tokens, info.block_size)
        if need:
            out.extend(_group_coverage(hit, group, need))
    return out


def _group_coverage(hit: Hit, group: CacheGroup, need: range) -> list[Finding]:
    ids = hit.blocks.get(group.group_id)
    what = f"group {group.label} ({group.kind.value})"
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)) \
            or len(ids) <= need.start:
        return [Finding(AnomalyKind.MISSING_GROUP_STATE, group.group_id, need.start,
                        f"{what} has no block for positions {need.start}..{need.stop - 1} "
                        "of the hit: the hit cannot be served by this group")]
    out: list[Finding] = []
    if len(ids) < need.stop:
        out.append(Finding(AnomalyKind.MISSING_GROUP_STATE, group.group_id, len(ids),
                           f"{what} holds {len(ids)} blocks, the hit needs blocks up to "
                           f"#{need.stop - 1}"))
    states = _tier_states(hit, group.group_id) or ()
    for i in range(need.start, min(need.stop, len(ids))):
        try:
            block_id = int(ids[i])
        except (TypeError, ValueError):
            continue  # not an id: the read will say so
        if is_null(group, block_id):
            out.append(Finding(AnomalyKind.NULL_BLOCK_READ, group.group_id, i,
                               f"{what} maps position #{i} it must cover to null block "
                               f"{block_id} (padding, no KV)"))
        elif i < len(states) and states[i] is not None \
                and states[i] not in USABLE_TIER_STATES:  # None/absent: device-resident
            out.append(Finding(AnomalyKind.TIER_NOT_LOADED, group.group_id, i,
                               f"{what} block {block_id} at #{i} was served from a tier "
                               f"entry in state {_state(states[i])}, not resident/loaded"))
    return out


def _state(state: object) -> str:
    return state.value if isinstance(state, TierState) else repr(state)


def tier_state_at(hit: Hit, group_id: int, index: int) -> TierState | None:
    """The tier state of a hit's block at match time; ``None`` when it is device-resident
    (never went through a tier)."""
    states = _tier_states(hit, group_id)
    if not states or index >= len(states):
        return None
    state = states[index]
    return state if isinstance(state, TierState) else None


def _tier_states(hit: Hit, group_id: int) -> Sequence[object] | None:
    """The hit's tier states of one group; ``None`` for anything but a sequence (an
    engine bug is no reason to fail the verification)."""
    tiers = hit.tier_states
    states = tiers.get(group_id) if isinstance(tiers, Mapping) else None
    return states if isinstance(states, Sequence) else None
