"""The block lifecycle log: allocate / store / hit / free / evict, per block, readable back.

Seed 001 §3.2 found its bug by logging every allocation and release with block id, sequence
id and length, and reading the path of one block back; §7.3 asks for a sampling rate so the
log stays affordable, and full detail around an anomaly. This module does both:

* a **window**: the last ``window`` events at full rate, in memory only (a bounded deque);
  when a content anomaly or an invariant violation fires, the window's events naming the
  bad blocks go into the evidence record, so the path that led there is kept;
* a **sampled log**: 1 event in ``round(1 / sample_rate)`` goes to the
  ``sidecar.allocator.lifecycle`` logger (INFO) and a bounded ring (``kept``);
* a **burst**: after an anomaly, the next ``burst`` events are logged at full rate, so what
  happens to the bad blocks next is on record too ("always on around an anomaly").

``record`` is the hot path: one plain tuple appended to a bounded deque (atomic in CPython)
and a countdown, no lock; readers turn tuples into :class:`LifecycleEvent` off the engine's
thread. The op goes in the tuple as its plain string (``"store"``): a tuple of ints,
floats, strings and such tuples is dropped from the garbage collector's tracking in the
young generations, while one holding an enum member stays tracked, and a window of
tracked tuples living past the young generations brings on full collections of the whole
heap (measured: ~2 us per applied store event in ``bench perf``).

Hits are recorded for sampled hits only (the Monitor's choice): a hit names every
block of its prefix, and copying those on every lookup would make the hot path O(prefix).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.core.hook_input import to_block_ids
from sidecar.core.protocol import SequenceId

log = logging.getLogger(__name__)


class LifecycleOp(enum.StrEnum):
    ALLOCATE = "allocate"  # fresh blocks handed to a sequence (new generation)
    STORE = "store"  # a full block written and indexed
    HIT = "hit"  # a lookup matched indexed blocks for a sequence
    FREE = "free"  # a sequence released its references
    EVICT = "evict"  # blocks left the prefix index (evicted or dropped)


_OPS = {op.value: op for op in LifecycleOp}  # a tuple's plain op string -> the op
_HIT = LifecycleOp.HIT.value


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    n: int  # event number since start: orders events recorded within one clock tick
    time: float
    op: LifecycleOp
    group_id: int
    seq_id: SequenceId | None
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    length: int | None  # tokens: the hit's or the stored prefix's end; None when unknown

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "time": self.time, "op": self.op.value, "group": self.group_id,
                "seq": self.seq_id, "blocks": list(self.block_ids),
                "generations": list(self.generations), "length": self.length}

    def names(self, group_id: int, blocks: frozenset[int]) -> bool:
        return self.group_id == group_id and not blocks.isdisjoint(self.block_ids)

    def __str__(self) -> str:
        gens = f" gen={list(self.generations)}" if self.generations else ""
        length = f" len={self.length}" if self.length is not None else ""
        return (f"{self.op.value} group={self.group_id} seq={self.seq_id} "
                f"blocks={list(self.block_ids)}{gens}{length} t={self.time:.6f}")


class LifecycleLog:
    """See the module docstring. ``sample_rate`` 0 logs nothing outside bursts."""

    def __init__(self, sample_rate: float = 0.01, window: int = 2048, kept: int = 4096,
                 burst: int = 256) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        if min(window, kept) < 1 or burst < 0:
            raise ValueError("window and kept must be >= 1, burst >= 0")
        self.every = round(1 / sample_rate) if sample_rate > 0 else 0
        self.burst = burst
        self._window: deque[tuple[Any, ...]] = deque(maxlen=window)
        self._kept: deque[tuple[Any, ...]] = deque(maxlen=kept)
        self._countdown = self.every
        self._burst_left = 0
        self._lock = threading.Lock()
        self.events = 0
        # Called before every read: whoever records events late (the cache-event journal)
        # applies them first, so a read sees every event recorded so far.
        self.before_read: Callable[[], object] | None = None

    def record(self, op: LifecycleOp, group_id: int, seq_id: SequenceId | None,
               block_ids: Sequence[int], generations: Sequence[int] = (),
               length: int | None = None, at: float | None = None) -> None:
        """One event (hot path: see the module docstring); ``at``: when it happened, where
        it is recorded later than that (the cache-event journal)."""
        self.events = n = self.events + 1
        ev = (n, time.time() if at is None else at, op.value, group_id, seq_id, tuple(block_ids),
              tuple(generations), length)
        self._window.append(ev)
        if self._burst_left > 0:
            self._burst_left -= 1
        elif self.every:
            self._countdown -= 1
            if self._countdown > 0:
                return
            self._countdown = self.every
        else:
            return
        self._kept.append(ev)
        if log.isEnabledFor(logging.INFO):
            for event in _readable((ev,)):
                log.info("block lifecycle: %s", event)

    def extend(self, events: Sequence[tuple[Any, ...]]) -> None:
        """Events already numbered and stamped, in :meth:`record`'s tuple form and order
        (``n`` counting on from :attr:`events`): the cache-event journal's batch. Same
        window, burst and 1-in-``every`` log as one :meth:`record` each, at one deque
        extend and two slices per batch instead of a call per event."""
        k = len(events)
        if not k:
            return
        self.events = events[-1][0]
        self._window.extend(events)
        burst = min(self._burst_left, k)
        if burst:
            self._burst_left -= burst
        rest = events[burst:]
        kept = list(events[:burst])
        if self.every and rest:
            c, every = self._countdown, self.every  # c: events until the next kept one
            kept.extend(rest[c - 1::every])
            r = len(rest)
            self._countdown = c - r if r < c else every - (r - c) % every
        if not kept:
            return
        self._kept.extend(kept)
        if log.isEnabledFor(logging.INFO):
            for event in _readable(kept):
                log.info("block lifecycle: %s", event)

    def trigger(self) -> None:
        """An anomaly fired: log the next ``burst`` events at full rate."""
        with self._lock:
            self._burst_left = self.burst

    def path(self, group_id: int, block_ids: Iterable[int],
             limit: int = 64) -> list[dict[str, Any]]:
        """The last ``limit`` events (window and sampled log) naming any of ``block_ids``,
        oldest first: how those blocks got where they are."""
        return self.path_and_cut(group_id, block_ids, limit)[0]

    def path_and_cut(self, group_id: int, block_ids: Iterable[int],
                     limit: int = 64) -> tuple[list[dict[str, Any]], int]:
        """:meth:`path`, and how many older events on record for those blocks it left out
        (a path cut to ``limit`` can start at a free: evidence says so)."""
        blocks = frozenset(block_ids)
        self._catch_up()
        with self._lock:
            raw = {e[0]: e for e in _copy(self._kept)}
            raw.update((e[0], e) for e in _copy(self._window))
        events = _readable(raw.values())
        hits = sorted((e for e in events if e.names(group_id, blocks)), key=lambda e: e.n)
        return [e.as_dict() for e in hits[-limit:]], max(len(hits) - limit, 0)

    def recent(self, n: int = 50) -> list[dict[str, Any]]:
        """The newest ``n`` sampled (or burst) events."""
        self._catch_up()
        with self._lock:
            kept = _copy(self._kept)[-n:]
        return [e.as_dict() for e in _readable(kept)]


    def _catch_up(self) -> None:
        if self.before_read is not None:
            self.before_read()


def _copy(events: deque[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A list copy of a deque the engine thread appends to without a lock: ``list(deque)``
    raises if an append lands mid-copy, so retry (appends are short and rare enough)."""
    for _ in range(100):
        try:
            return list(events)
        except RuntimeError:
            continue
    return []


def readable(ev: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """An event as readers get it. A sampled hit's event is applied as it is, its ids
    unchecked (checking 2 x 128 ids on the engine's thread cost more than the rest of a
    sampled hit; the verifier checks them off it and counts a bad hit): here its ids and
    generations become plain ints (numpy/torch scalars, int subclasses), or it is left out
    when they are not ids. Every other event's ids were made plain when the journal applied
    it."""
    if ev[2] != _HIT:
        return ev
    ids, why = to_block_ids(ev[5])
    gens, why2 = to_block_ids(ev[6], 1 << 62)
    if why is not None or why2 is not None:
        return None
    return (*ev[:5], ids, gens, *ev[7:])


def _readable(events: Iterable[tuple[Any, ...]]) -> list[LifecycleEvent]:
    return [LifecycleEvent(r[0], r[1], _OPS[r[2]], *r[3:])
            for r in map(readable, events) if r is not None]
