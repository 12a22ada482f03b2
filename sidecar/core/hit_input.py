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
* :func:`sanitized_hit`, on the verifier's thread before it reads the hit, and for hits a
  probe captured elsewhere: the shape plus every block id, generation and tier state,
  O(blocks); the verifier then reads its copy (plain dicts and tuples of plain ints), never
  the engine's objects again (a map whose ``get`` raises, an ``__index__`` that answers
  differently twice, a numpy id that would reach an evidence file as a string).

Checking every id on the engine's thread cost a sampled 2k-token hit 161k instructions, 40%
of its whole cost (issue 20: a sampled hit must not cost more than before issue 21).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from sidecar.checks.group_coverage import groups_by_id
from sidecar.core.hook_input import (
    MAX_BLOCK_ID,
    MAX_GROUP,
    MAX_TOKENS,
    PLAIN_SEQS,
    to_block_ids,
)
from sidecar.core.protocol import CacheGroup, Hit, TierState
from sidecar.signals import InputReject

_MAX_GENERATION = 1 << 62
_TEXT = (str, bytes, bytearray)


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
    ints, why = to_block_ids((b,))  # converted once: an __index__ may answer differently
    if why is not None:
        raise BadHit(why)
    return ints[0]


def _seq_reason(ids: Any) -> InputReject | None:
    """A sequence of sane length, not text; a stranger (not list/tuple/range) indexed at
    both ends, as the sampler will (a sequence that lies raises here, not later). O(1)."""
    if type(ids) in PLAIN_SEQS:  # the common case, without the ABC's isinstance
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


def _group_map_reason(groups: Any, known: Mapping[int, CacheGroup] | None
                      ) -> InputReject | None:
    """A map of group id -> ids (the hit's ``blocks`` or ``generations``), each list's shape
    (:func:`_seq_reason`); ``known``: the engine's groups, where it described them (a hit
    naming another group would be refused by the adapter's capture and recompute)."""
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
        why = _seq_reason(ids)
        if why is not None:
            return why
    return None


def _shape(hit: Any, groups: Sequence[CacheGroup]) -> InputReject | None:
    try:
        known = groups_by_id(groups) if groups else None
        why = _group_map_reason(hit.blocks, known) or _group_map_reason(hit.generations, None)
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
            if type(gid) is not int or (type(states) not in PLAIN_SEQS and (
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
    return _shape(hit, groups)


def check_sampled_hit(hit: Any, groups: Sequence[CacheGroup] = ()) -> InputReject | None:
    """:func:`sanitized_hit`'s reason only."""
    return sanitized_hit(hit, groups)[1]


def sanitized_hit(hit: Any, groups: Sequence[CacheGroup] = ()
                  ) -> tuple[Hit | None, InputReject | None]:
    """:func:`check_hit_shape` and every block id and generation an integer in range
    (numpy and torch integer scalars too), every tier state a :class:`TierState` or
    ``None``; O(blocks), run off the engine's thread (the verifier). Returns a copy to read
    instead of the engine's objects (plain dicts, tuples of plain ints: each hostile map or
    sequence is read once, here, and never again), or ``None`` and the reason."""
    why = _shape(hit, groups)
    if why is not None:
        return None, why
    try:
        blocks: dict[int, tuple[int, ...]] = {}
        gens: dict[int, tuple[int, ...]] = {}
        for src, dst, hi in ((hit.blocks, blocks, MAX_BLOCK_ID),
                             (hit.generations, gens, _MAX_GENERATION)):
            for gid, ids in list(src.items()):
                dst[gid], why = to_block_ids(tuple(ids), hi)
                if why is not None:
                    return None, why
        tiers: dict[int, tuple[TierState | None, ...]] = {}
        for gid, states in list(hit.tier_states.items()):
            tiers[gid] = tuple(states)
            if not all(st is None or isinstance(st, TierState) for st in tiers[gid]):
                return None, InputReject.TYPE
        copy = replace(hit, blocks=blocks, generations=gens, tier_states=tiers,
                       key_fields=dict(hit.key_fields.items()))
    except Exception:  # a hostile object's own methods raised
        return None, InputReject.TYPE
    why = _shape(copy, groups)  # what a second read of a hostile map gave, checked again
    return (None, why) if why is not None else (copy, None)
