"""The shape of a *sampled* hit: checked in two steps, each where its cost belongs.

:func:`sidecar.core.hook_input.check_lookup` is O(1): it looks at a hit's types and lengths,
never inside ``blocks``/``generations``, so an unsampled hit costs the same whatever its
size. A sampled hit is then walked, and a hostile value inside (``{0: 7}`` as the blocks, a
string where a block id belongs, a key that does not sort) used to raise there: a hook
error and a traceback in the engine's log for what is bad input. So the walk is checked
first, and a reason counted (``hook_input_rejected_total{hook, reason}``) instead:

* :func:`check_hit_shape`, on the engine's thread: O(groups), never O(blocks). Every map
  and key, every group's list a sequence of sane length; what the engine's thread reads by
  index (the blocks the sampler picks) is checked as it is picked (:func:`picked_block_id`);
  the rest is only copied there (the lifecycle's hit event), never read;
* :func:`check_sampled_hit`, on the verifier's thread before it reads the hit, and for hits a
  probe captured elsewhere: the shape plus every block id and generation, O(blocks).

Checking every id on the engine's thread cost a sampled 2k-token hit 161k instructions, 40%
of its whole cost (issue 20: a sampled hit must not cost more than before issue 21).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.checks.group_coverage import groups_by_id
from sidecar.core.hook_input import MAX_BLOCK_ID, MAX_GROUP, MAX_TOKENS, check_block_ids
from sidecar.core.protocol import CacheGroup
from sidecar.signals import InputReject

_MAX_GENERATION = 1 << 62
_TEXT = (str, bytes, bytearray)
_PLAIN = (list, tuple, range)


class BadHit(Exception):
    """A sampled hit's id, picked on the engine's thread, is not one: counted, never raised
    into the engine (the Monitor turns it into its ``reason``)."""

    def __init__(self, reason: InputReject) -> None:
        super().__init__(reason.value)
        self.reason = reason


def picked_block_id(ids: Sequence[Any], i: int) -> int:
    """``ids[i]`` as a block id (an integer in ``[0, MAX_BLOCK_ID]``; numpy and torch
    integer scalars too), or :class:`BadHit` with the reason."""
    try:
        b = ids[i]
    except Exception:  # a sequence that lies about its length, or whose getitem raises
        raise BadHit(InputReject.TYPE) from None
    if type(b) is int and 0 <= b <= MAX_BLOCK_ID:
        return b
    why = check_block_ids((b,))
    if why is not None:
        raise BadHit(why)
    return operator.index(b)


def _seq_reason(ids: Any) -> InputReject | None:
    """A sequence of sane length, not text; a stranger (not list/tuple/range) indexed at
    both ends, as the sampler will (a sequence that lies raises here, not later). O(1)."""
    if type(ids) in _PLAIN:  # the common case, without the ABC's isinstance
        return InputReject.ABSURD if len(ids) > MAX_TOKENS else None
    if not isinstance(ids, Sequence) or isinstance(ids, _TEXT):
        return InputReject.TYPE
    if len(ids) > MAX_TOKENS:
        return InputReject.ABSURD
    if len(ids):
        ids[0], ids[len(ids) - 1]
    return None


def _is_map(m: Any) -> bool:
    return type(m) is dict or isinstance(m, Mapping)  # the ABC's isinstance costs ~2k instr


def _ids_reason(ids: Any, hi: int) -> InputReject | None:
    """A sequence of ids, each an integer in ``[0, hi]``. O(ids)."""
    why = _seq_reason(ids)
    if why is not None:
        return why
    for b in ids:  # the common case without a call per id
        if type(b) is not int or not 0 <= b <= hi:
            return check_block_ids(ids, hi) or None
    return None


def _group_map_reason(groups: Any, known: Mapping[int, CacheGroup] | None,
                      ids_hi: int | None) -> InputReject | None:
    """A map of group id -> ids (the hit's ``blocks`` or ``generations``); ``known``: the
    engine's group ids, where it described them (a hit naming another group would be
    refused by the adapter's capture and recompute); ``ids_hi``: check every id against it
    (``None``: the lists' shape only)."""
    if not _is_map(groups):
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
        why = _seq_reason(ids) if ids_hi is None else _ids_reason(ids, ids_hi)
        if why is not None:
            return why
    return None


def _check(hit: Any, groups: Sequence[CacheGroup], every_id: bool) -> InputReject | None:
    try:
        known = groups_by_id(groups) if groups else None
        why = _group_map_reason(hit.blocks, known, MAX_BLOCK_ID if every_id else None) or \
            _group_map_reason(hit.generations, None, _MAX_GENERATION if every_id else None)
        if why is not None:
            return why
        kf = hit.key_fields
        if not _is_map(kf) or len(kf) > MAX_GROUP:
            return InputReject.TYPE
        for k in kf:
            if type(k) is not str:
                return InputReject.TYPE
        ts = hit.tier_states
        if not _is_map(ts) or len(ts) > MAX_GROUP:
            return InputReject.TYPE
        for gid, states in ts.items():
            if type(gid) is not int or (type(states) not in _PLAIN and (
                    not isinstance(states, Sequence) or isinstance(states, _TEXT))):
                return InputReject.TYPE
    except Exception:  # a hostile object's own __len__/__iter__/items raised
        return InputReject.TYPE
    return None


def check_hit_shape(hit: Any, groups: Sequence[CacheGroup] = ()) -> InputReject | None:
    """A hit about to be sampled (already past :func:`~sidecar.core.hook_input.check_lookup`),
    on the engine's thread: every group id an int in range (and in ``groups``, the engine's
    :class:`CacheGroup` list, where given: else ``inconsistent``), every group's block ids
    and generations a sequence of sane length, ``key_fields`` a map keyed by strings,
    ``tier_states`` a map of sequences. O(groups); never raises: a value whose own methods
    raise is a ``type`` reason."""
    return _check(hit, groups, every_id=False)


def check_sampled_hit(hit: Any, groups: Sequence[CacheGroup] = ()) -> InputReject | None:
    """:func:`check_hit_shape` and every block id and generation an integer in range
    (numpy and torch integer scalars too). O(blocks): run off the engine's thread."""
    return _check(hit, groups, every_id=True)
