"""Validation of what an engine hands the hooks: cheap, O(1), and never raising.

One bad value from an engine integration must not poison the sidecar's state: a ``None``
latency used to make ``/status`` fail until 10,000 more requests passed, a NaN query length
left ``query_tokens_total`` at NaN for good. Each hook asks the matching ``check_*`` first;
a non-``None`` answer is an :class:`InputReject` reason, counted in
``kvsidecar_hook_input_rejected_total{hook, reason}`` by :func:`reject`, and the event is
dropped. Checks look at types, signs and sizes only (``len()`` is O(1)): they never iterate
a hit's tokens or blocks, so the unsampled path stays O(1) in the hit's size.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar import signals as S
from sidecar.core.protocol import AllocatorState, Hit, Lookup, StoredBlock
from sidecar.signals import InputReject

# Larger than any context window an engine serves today (10M tokens), small enough that a
# counter increment of it is meaningful. Past it a value is a bug, not a workload.
MAX_TOKENS = 1 << 24
MAX_GROUP = 1 << 10
MAX_BLOCK_ID = 1 << 40
MAX_BLOCK_TOKENS = 1 << 16  # tokens of one block
MAX_LATENCY_S = 86_400.0  # a request that took a day is a clock bug
# The sequences taken without the ABC's isinstance (~2k instructions each): exact types only.
PLAIN_SEQS = (list, tuple, range)


def _int_reason(v: Any, hi: int) -> InputReject | None:
    if type(v) is not int:  # bool, float, None, numpy scalars: not a count
        if isinstance(v, float) and math.isnan(v):
            return InputReject.NAN
        return InputReject.TYPE
    if v < 0:
        return InputReject.NEGATIVE
    if v > hi:
        return InputReject.ABSURD
    return None


def check_lookup(lookup: Any) -> InputReject | None:
    """A :class:`Lookup`: counts are ints in range, a hit (if any) is a :class:`Hit` whose
    tokens cover its length."""
    try:
        if not isinstance(lookup, Lookup):
            return InputReject.TYPE
        why = _int_reason(lookup.query_tokens, MAX_TOKENS) or \
            _int_reason(lookup.hit_tokens, MAX_TOKENS)
        if why is not None:
            return why
        if lookup.hit_tokens > lookup.query_tokens:
            return InputReject.INCONSISTENT
        hit = lookup.hit
        if hit is None:
            return None
        # Exact types first: the ABCs' isinstance costs ~2k instructions each.
        if not isinstance(hit, Hit) or not (
                type(hit.blocks) is dict or isinstance(hit.blocks, Mapping)) or not (
                type(hit.tokens) in PLAIN_SEQS or isinstance(hit.tokens, Sequence)) or not (
                type(hit.generations) is dict or isinstance(hit.generations, Mapping)):
            return InputReject.TYPE
        why = _int_reason(hit.hit_tokens, MAX_TOKENS)
        if why is not None:
            return why
        if len(hit.blocks) > MAX_GROUP:  # tokens may be empty: unsampled probe lookups
            return InputReject.INCONSISTENT
        return None
    except Exception:  # a hostile object's own __len__/attributes raised
        return InputReject.TYPE


def check_store(block: Any) -> InputReject | None:
    """A :class:`StoredBlock` with ids, generation and lengths in range."""
    try:
        if not isinstance(block, StoredBlock) or not isinstance(block.tokens, Sequence):
            return InputReject.TYPE
        return (_int_reason(block.group_id, MAX_GROUP)
                or _int_reason(block.block_id, MAX_BLOCK_ID)
                or _int_reason(block.generation, 1 << 62)
                or _int_reason(block.prefix_tokens, MAX_TOKENS)
                or (InputReject.ABSURD if len(block.tokens) > MAX_BLOCK_TOKENS else None))
    except Exception:  # a hostile object's own __len__/attributes raised
        return InputReject.TYPE


def check_blocks(group_id: Any, block_ids: Any) -> InputReject | None:
    """``on_free``/``on_allocate``/``on_release`` arguments: a group id and a sequence of
    block ids (its length only: the ids themselves are checked where they are used)."""
    try:
        why = _int_reason(group_id, MAX_GROUP)
        if why is not None:
            return why
        if not isinstance(block_ids, Sequence) or isinstance(block_ids, (str, bytes)):
            return InputReject.TYPE
        return InputReject.ABSURD if len(block_ids) > MAX_TOKENS else None
    except Exception:  # a hostile object's own __len__/attributes raised
        return InputReject.TYPE


def to_block_ids(block_ids: Sequence[Any], hi: int = MAX_BLOCK_ID
                 ) -> tuple[tuple[int, ...], InputReject | None]:
    """Each id of an already length-checked sequence as a plain ``int`` in ``[0, hi]``,
    converted once (numpy and torch integer scalars, int subclasses: ``operator.index``),
    and ``None``; or ``()`` and the reason. Never raises for a bad id: an ``__index__`` that
    raises (a float tensor's) is a ``type`` reason. O(n): run off the engine's thread."""
    out: list[int] = []
    for b in block_ids:
        if type(b) is not int:
            if isinstance(b, bool) or not hasattr(type(b), "__index__"):
                return (), (InputReject.NAN if isinstance(b, float) and math.isnan(b)
                            else InputReject.TYPE)
            try:
                b = operator.index(b)  # an exact int since Python 3.10
            except Exception:
                return (), InputReject.TYPE
        if b < 0:
            return (), InputReject.NEGATIVE
        if b > hi:
            return (), InputReject.ABSURD
        out.append(b)
    return tuple(out), None


def check_latency(seconds: Any) -> InputReject | None:
    """A request latency: a finite, non-negative number of seconds under a day."""
    if type(seconds) not in (float, int):
        return InputReject.TYPE
    if seconds != seconds:
        return InputReject.NAN
    if seconds < 0:
        return InputReject.NEGATIVE
    if seconds > MAX_LATENCY_S:  # inf included
        return InputReject.ABSURD
    return None


def reject(metrics: Any, hook: str, why: InputReject | None) -> bool:
    """Count a rejected hook input; True when the hook must drop the event. One call per
    hook: ``if reject(self.metrics, "on_lookup", check_lookup(lookup)): return``."""
    if why is None:
        return False
    metrics.inc(S.HOOK_INPUT_REJECTED, hook=hook, reason=why.value)
    return True


HOOKS = ("on_lookup", "on_captured", "on_store", "on_free", "on_allocate", "on_release",
         "on_request_done")


def init_series(metrics: Any) -> None:
    """Every (hook, reason) series at 0, so a first rejection is a rate, not a new series."""
    for hook in HOOKS:
        for why in InputReject:
            metrics.inc(S.HOOK_INPUT_REJECTED, 0, hook=hook, reason=why.value)


_STATE_COUNTS = ("total_blocks", "free_blocks", "cached_blocks", "used_blocks",
                 "largest_free_run", "allocations", "allocation_failures", "allocated_slots",
                 "filled_slots")


def check_allocator_state(state: Any) -> InputReject | None:
    """What ``adapter.allocator()`` returned: an :class:`AllocatorState` of non-negative
    ints. Anything else would be stored and then fail every scrape (the registry's
    collector reads it), so it is refused at the poll."""
    if state is None:
        return None
    if not isinstance(state, AllocatorState):
        return InputReject.TYPE
    for name in (*_STATE_COUNTS, "live_sequences", "held_blocks", "hit_tokens"):
        v = getattr(state, name)  # None: the engine does not know (never exported as 0)
        why = None if v is None else _int_reason(v, 1 << 62)
        if why is not None:
            return why
    return None


def reject_adapter_output(metrics: Any, op: str, why: InputReject | None) -> bool:
    """Count adapter output refused as garbage (``adapter_errors_total{op, reason=
    "garbage"}``); True when the caller must drop it."""
    if why is None:
        return False
    metrics.inc(S.ADAPTER_ERRORS, op=op, reason="garbage")
    return True
