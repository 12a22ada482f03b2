"""Which positions of a hit each cache group must hold real state for.

A prefix-hash hit in a hybrid model only proves the prefix was computed once; every group
must still hold what the next token needs — and no more: a sliding-window group has
legitimately dropped (null) blocks before its window, a recurrent group keeps one state per
boundary and a hit needs only the last. Block choice, completeness and null-block checks
all read this one definition.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.core.protocol import CacheGroup, GroupKind

# Read once: an enum member looked up on its class costs ~1k instructions (a sampled hit).
_SLIDING, _RECURRENT = GroupKind.SLIDING_WINDOW, GroupKind.RECURRENT_STATE


_BY_ID: dict[int, tuple[Sequence[CacheGroup], dict[int, CacheGroup]]] = {}


def groups_by_id(groups: Sequence[CacheGroup]) -> dict[int, CacheGroup]:
    """``groups`` by group id, remembered per list: an engine's list is built once, and a
    sampled hit reads it on the engine's thread. Read only."""
    seen = _BY_ID.get(id(groups))
    if seen is not None and seen[0] is groups:  # the entry holds the list: its id is its own
        return seen[1]
    by_id = {g.group_id: g for g in groups}
    if len(_BY_ID) >= 64:
        _BY_ID.clear()
    _BY_ID[id(groups)] = (groups, by_id)
    return by_id


def required_blocks(group: CacheGroup, hit_tokens: int, block_size: int) -> range:
    """Indices of the hit's full blocks that ``group`` must hold real (non-null) state for.

    Full attention (and kinds without a narrower rule): every full block. Sliding window
    ``w``: the blocks covering positions ``[hit_tokens - (w - 1), hit_tokens)`` — what the
    token at ``hit_tokens`` attends to, as vLLM's sliding-window manager keeps them.
    Recurrent state: the last full block only (the state at the hit's boundary).
    """
    n_full = max(0, hit_tokens // block_size)
    if n_full == 0:
        return range(0)
    kind = group.kind
    if kind is _SLIDING and group.sliding_window:
        first_pos = max(0, hit_tokens - (group.sliding_window - 1))
        return range(min(first_pos // block_size, n_full), n_full)
    if kind is _RECURRENT:
        return range(n_full - 1, n_full)
    return range(n_full)


def is_null(group: CacheGroup, block_id: int) -> bool:
    """Whether ``block_id`` is one of the group's padding (null) blocks."""
    return block_id in group.null_block_ids
