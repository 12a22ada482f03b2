"""The shape of a *sampled* hit, checked before anything on the engine's thread walks it.

:func:`sidecar.core.hook_input.check_lookup` is O(1): it looks at a hit's types and lengths,
never inside ``blocks``/``generations``, so an unsampled hit costs the same whatever its
size. A sampled hit is then walked on the engine's thread — its blocks logged in the block
lifecycle, some of them chosen and converted with ``int()``, its maps read — so a hostile
value inside (``{0: 7}`` as the blocks, a string where a block id belongs, a key that does
not sort) used to raise there: a hook error and a traceback in the engine's log for what is
bad input. :func:`check_sampled_hit` looks at every group's list and ids first (O(blocks),
the walk a sampled hit pays anyway) and names the reason, so the hook counts a drop
(``hook_input_rejected_total{hook, reason}``) and returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.core.hook_input import MAX_BLOCK_ID, MAX_GROUP, MAX_TOKENS, check_block_ids
from sidecar.core.protocol import CacheGroup
from sidecar.signals import InputReject

_MAX_GENERATION = 1 << 62
_TEXT = (str, bytes, bytearray)
_PLAIN = (list, tuple, range)


def _ids_reason(ids: Any, hi: int) -> InputReject | None:
    """A sequence of ids, each an integer in ``[0, hi]``."""
    if not isinstance(ids, Sequence) or isinstance(ids, _TEXT):
        return InputReject.TYPE
    if len(ids) > MAX_TOKENS:
        return InputReject.ABSURD
    if type(ids) not in _PLAIN and len(ids):  # a stranger: indexed as the sampler will
        ids[0], ids[len(ids) - 1]  # raises for a sequence that lies
    for b in ids:  # the common case without a call per id
        if type(b) is not int or not 0 <= b <= hi:
            return check_block_ids(ids, hi) or None
    return None


def _group_map_reason(groups: Any, hi: int, known: frozenset[int] | None = None
                      ) -> InputReject | None:
    """A map of group id -> ids (the hit's ``blocks`` or ``generations``); ``known``: the
    engine's group ids, where it described them (a hit naming another group would be
    refused by the adapter's capture and recompute)."""
    if not isinstance(groups, Mapping):
        return InputReject.TYPE
    if len(groups) > MAX_GROUP:
        return InputReject.ABSURD
    for gid, ids in groups.items():
        if type(gid) is not int:
            return InputReject.TYPE
        if not 0 <= gid <= MAX_GROUP:
            return InputReject.NEGATIVE if gid < 0 else InputReject.ABSURD
        if known and gid not in known:
            return InputReject.INCONSISTENT
        why = _ids_reason(ids, hi)
        if why is not None:
            return why
    return None


def check_sampled_hit(hit: Any, groups: Sequence[CacheGroup] = ()) -> InputReject | None:
    """A hit about to be sampled (already past :func:`~sidecar.core.hook_input.check_lookup`):
    every group id an int in range, every group's block ids and generations sequences of
    ints in range, ``key_fields`` a map keyed by strings, ``tier_states`` a map of
    sequences. Never raises:
    a value whose own methods raise is a ``type`` reason. ``groups``: the engine's
    :class:`CacheGroup` list (``EngineInfo.groups``); a group outside it is ``inconsistent``."""
    try:
        known = frozenset(g.group_id for g in groups) if groups else None
        why = _group_map_reason(hit.blocks, MAX_BLOCK_ID, known) or \
            _group_map_reason(hit.generations, _MAX_GENERATION)
        if why is not None:
            return why
        kf = hit.key_fields
        if not isinstance(kf, Mapping) or len(kf) > MAX_GROUP:
            return InputReject.TYPE
        for k in kf:
            if type(k) is not str:
                return InputReject.TYPE
        ts = hit.tier_states
        if not isinstance(ts, Mapping) or len(ts) > MAX_GROUP:
            return InputReject.TYPE
        for gid, states in ts.items():
            if type(gid) is not int or not isinstance(states, Sequence) \
                    or isinstance(states, _TEXT):
                return InputReject.TYPE
    except Exception:  # a hostile object's own __len__/__iter__/items raised
        return InputReject.TYPE
    return None
