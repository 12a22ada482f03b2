"""The journaled hooks (``on_store``, ``on_free``, ``on_allocate``, ``on_release``): one
O(1) door check and one tuple appended to the cache-event journal, inline.

Kept out of :mod:`sidecar.core.monitor` (one job per module) as a mixin the Monitor inherits:
the hooks must read the Monitor's attributes directly, since a delegating call would be a
third of an O(1) hook (issue 22 counts every instruction the engine's process pays).

This module is where the journal's event format lives (:data:`STORE_EVENT` and its kin, and
:func:`store_event`, :func:`free_event`, :func:`lifecycle_event`, the reference form of each
tuple the hooks build inline); :class:`~sidecar.core.journal.CacheEventJournal` applies them,
running the full input checks of :mod:`sidecar.core.hook_input` off the engine's thread.

Bad input never raises out of a hook: anything that fails the door check goes to the full
check, whose reason is counted (``hook_input_rejected_total{hook, reason}``) and the event
dropped; a token list that cannot be hashed is journaled without its digest and rejected
when applied.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sidecar.allocator import LifecycleOp
from sidecar.core import hook_input as HI
from sidecar.core.hook_input import PLAIN_SEQS
from sidecar.core.protocol import SequenceId, StoredBlock
from sidecar.core.store_index import key_fields_snapshot

# Ops as plain strings in the tuples (sidecar.allocator.lifecycle: kept untracked by the GC).
_OP_ALLOCATE, _OP_FREE = LifecycleOp.ALLOCATE.value, LifecycleOp.FREE.value
_MAX_TOKENS, _MAX_GROUP, _MAX_BLOCK_TOKENS = HI.MAX_TOKENS, HI.MAX_GROUP, HI.MAX_BLOCK_TOKENS
_now = time.time

# ---------------------------------------------------------------- the event format
# Each event is a plain tuple (the cheapest thing to build on the engine's thread), its first
# element the kind; ``at`` is wall-clock time.time() when the hook ran:
#   (STORE_EVENT, block: StoredBlock, token_hash: int | None, at, key_fields): the key
#    fields copied at the call (sidecar.core.store_index.key_fields_snapshot)
#   (FREE_EVENT, group_id, block_ids: tuple, at)
#   (LIFECYCLE_EVENT, op: LifecycleOp's value, group_id, seq_id, block_ids: tuple,
#    generations: tuple, length: int | None, at)
#   (AS_IS_LIFECYCLE_EVENT, ...): the same, applied without the per-id check: a sampled hit's
#    (its ids are checked where they are read: the verifier, sidecar.core.hit_input, and the
#    lifecycle's readers, which skip an event whose ids are not ids)
STORE_EVENT, FREE_EVENT, LIFECYCLE_EVENT, AS_IS_LIFECYCLE_EVENT = 0, 1, 2, 3


def store_event(block: StoredBlock) -> tuple[Any, ...]:
    """A store, with the block's own token hash (:func:`sidecar.checks.keys.tokens_hash`),
    so the engine may reuse its token list once the hook returns; ``None`` when the tokens
    cannot be hashed (rejected when applied, never raised)."""
    try:
        digest: int | None = hash(tuple(block.tokens))
    except Exception:
        digest = None
    return (STORE_EVENT, block, digest, _now(), key_fields_snapshot(block.key_fields))


def free_event(group_id: int, block_ids: Sequence[int]) -> tuple[Any, ...]:
    return (FREE_EVENT, group_id, tuple(block_ids), _now())


def lifecycle_event(op: LifecycleOp, group_id: int, seq_id: Any, block_ids: Sequence[int],
                    generations: Sequence[int] = (), length: int | None = None,
                    as_is: bool = False) -> tuple[Any, ...]:
    """A lifecycle-only event (allocate, release, hit), kept in order with the rest;
    ``as_is``: the journal applies it without checking its ids and generations (a sampled
    hit's: checked where they are read)."""
    return (AS_IS_LIFECYCLE_EVENT if as_is else LIFECYCLE_EVENT, op.value, group_id, seq_id,
            tuple(block_ids), tuple(generations), length, _now())


class EventJournal(Protocol):
    """What the hooks need of :class:`~sidecar.core.journal.CacheEventJournal`."""

    wake_at: int

    def nudge(self) -> None: ...


class JournaledHooks:
    """The Monitor's store/free/allocate/release hooks (see the module docstring)."""

    journal: EventJournal
    _journal_events: deque[tuple[Any, ...]]
    _sampler_store: Callable[[StoredBlock], Any] | None
    _sampler_free: Callable[[int, Sequence[int]], Any] | None
    _sampler_release: Callable[[int, SequenceId, Sequence[int]], Any] | None
    _nudge: Callable[[], Any]

    def _reject(self, hook: str, why: HI.InputReject | None) -> bool:
        raise NotImplementedError  # the Monitor's

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        raise NotImplementedError  # the Monitor's

    def on_store(self, block: StoredBlock) -> None:
        try:
            # Checked in O(1) here and fully where the journal applies it (sidecar.core.journal).
            if (type(block) is not StoredBlock or type(block.tokens) not in PLAIN_SEQS
                    or len(block.tokens) > _MAX_BLOCK_TOKENS) \
                    and self._reject("on_store", HI.check_store(block)):
                return
            try:  # the block's own token hash (checks.keys.tokens_hash), inline
                digest: int | None = hash(tuple(block.tokens))
            except Exception:  # unhashable or unreadable tokens: rejected when applied
                digest = None
            kf = block.key_fields  # copied now: the engine may change its mapping after
            fields: dict[str, str] | None = None
            if kf:  # store_index.key_fields_snapshot, inline
                try:
                    fields = kf.copy() if type(kf) is dict else dict(kf)
                except Exception:  # a mapping that cannot be read: refused, not raised
                    self._reject("on_store", HI.InputReject.TYPE)
                    return
            events = self._journal_events  # store_event, inline
            if len(events) >= self.journal.wake_at:
                self.journal.nudge()
            events.append((STORE_EVENT, block, digest, _now(), fields))
            if self._sampler_store is not None:
                self._sampler_store(block)
        except Exception as exc:
            self._hook_failed("on_store", exc)

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        try:
            if (type(group_id) is not int or type(block_ids) not in PLAIN_SEQS
                    or len(block_ids) > _MAX_TOKENS) \
                    and self._reject("on_free", HI.check_blocks(group_id, block_ids)):
                return
            try:
                ids = tuple(block_ids)
            except Exception:  # a sequence that cannot be read: refused, not raised
                self._reject("on_free", HI.InputReject.TYPE)
                return
            events = self._journal_events  # free_event, inline
            if len(events) >= self.journal.wake_at:
                self.journal.nudge()
            events.append((FREE_EVENT, group_id, ids, _now()))
            if self._sampler_free is not None:
                self._sampler_free(group_id, block_ids)
        except Exception as exc:
            self._hook_failed("on_free", exc)

    def on_allocate(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int],
                    generations: Sequence[int]) -> None:
        """Optional lifecycle event (:class:`sidecar.core.protocol.BlockLifecycleSink`)."""
        try:
            # O(1) inline check; the full one (sidecar.core.hook_input) only for strangers.
            if (type(group_id) is not int or type(block_ids) not in PLAIN_SEQS
                    or type(generations) not in PLAIN_SEQS or len(block_ids) > _MAX_TOKENS
                    or len(generations) > _MAX_TOKENS or not 0 <= group_id <= _MAX_GROUP) \
                    and self._reject("on_allocate", HI.check_blocks(group_id, block_ids)
                                     or HI.check_blocks(group_id, generations)):
                return
            try:
                ids, gens = tuple(block_ids), tuple(generations)
            except Exception:  # a sequence that cannot be read: refused, not raised
                self._reject("on_allocate", HI.InputReject.TYPE)
                return
            events = self._journal_events  # lifecycle_event, inline
            if len(events) >= self.journal.wake_at:
                self.journal.nudge()
            events.append((LIFECYCLE_EVENT, _OP_ALLOCATE, group_id, seq_id, ids, gens, None,
                           _now()))
        except Exception as exc:
            self._hook_failed("on_allocate", exc)

    def on_release(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int]) -> None:
        """Optional lifecycle event: a sequence freed its blocks; nudges an invariant
        check, since a release is where premature and double frees happen."""
        try:
            if (type(group_id) is not int or type(block_ids) not in PLAIN_SEQS
                    or len(block_ids) > _MAX_TOKENS or not 0 <= group_id <= _MAX_GROUP) \
                    and self._reject("on_release", HI.check_blocks(group_id, block_ids)):
                return
            try:
                ids = tuple(block_ids)
            except Exception:  # a sequence that cannot be read: refused, not raised
                self._reject("on_release", HI.InputReject.TYPE)
                return
            events = self._journal_events  # lifecycle_event, inline
            if len(events) >= self.journal.wake_at:
                self.journal.nudge()
            events.append((LIFECYCLE_EVENT, _OP_FREE, group_id, seq_id, ids, (), None, _now()))
            if self._sampler_release is not None:
                self._sampler_release(group_id, seq_id, block_ids)
            self._nudge()
        except Exception as exc:
            self._hook_failed("on_release", exc)
