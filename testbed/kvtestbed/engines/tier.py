"""A bounded CPU offload tier under the reference pool (LMCache/vLLM-offload in miniature),
with an explicit state machine per entry and asynchronous loads.

When the pool evicts a cached block its bytes and index metadata spill here instead of being
lost; a later lookup that runs past the pool's hits continues in the tier and *loads* each
consecutive entry found into a freshly allocated pool block. Every entry goes through
:class:`~sidecar.core.protocol.TierState`:

    resident -> offloading -> offloaded -> loading -> loaded | failed

* **offload** happens at eviction, where the pool hands the block to a new owner in the same
  allocation: the copy out cannot wait, so it is taken on the engine thread and the entry
  passes resident -> offloading -> offloaded at once (a real engine that offloads at store
  time would run it on the worker instead).
* **load** runs on the copy worker (:mod:`.tier_worker`, one thread, bounded queue), layer
  by layer like a layerwise connector. The entry is ``loading`` while the copy is in flight
  and is not servable: the engine waits for the load (:meth:`Load.wait`) before the request
  may use the block, and a load that ends ``failed`` is recovered by recomputing.
* ``failed`` is terminal (the entry leaves the tier); a ``loaded`` entry stays until the LRU
  drops it or the block spills again, which starts a fresh entry.

A transition the table (:data:`LEGAL`) does not allow raises :class:`IllegalTierTransition`
and is counted: that is a bug in whoever drives the tier. Every transition is queued as a
:class:`TierEvent` (``seconds`` = recovery latency on the end of a load) for the engine to
report on its own thread (``on_tier``). Entries are keyed by ``(group_id, block hash)`` so
one tier can serve every cache group of a hybrid model.

The write-time digest of a block travels with it: the load re-reports the block with the
digest of the KV as first written, which is what lets the sidecar's fingerprint check tell a
load that silently failed from one that worked.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtestbed.engines.blocks import BlockData, BlockHash, KeyFields
from kvtestbed.engines.pool import BlockPool
from kvtestbed.engines.tier_worker import CopyWorker
from sidecar.core.protocol import TierState

S = TierState
# state -> the states it may move to; None is "no entry yet".
LEGAL: dict[TierState | None, frozenset[TierState]] = {
    None: frozenset({S.RESIDENT}),
    S.RESIDENT: frozenset({S.OFFLOADING}),
    S.OFFLOADING: frozenset({S.OFFLOADED, S.FAILED}),
    S.OFFLOADED: frozenset({S.LOADING}),
    S.LOADING: frozenset({S.LOADED, S.FAILED}),
    S.LOADED: frozenset(),
    S.FAILED: frozenset(),
}
SERVABLE = frozenset({S.RESIDENT, S.LOADED})  # states a hit may use
IN_FLIGHT = frozenset({S.OFFLOADING, S.LOADING})  # a copy is running: never dropped


class IllegalTierTransition(RuntimeError):
    """An entry was asked to move where the state machine does not go (a tier driver bug)."""


class TierCopyError(RuntimeError):
    """A copy between the tier and the pool did not complete."""


@dataclass(frozen=True)
class TierEvent:
    """One transition, for the sink's ``on_tier``: the entry's group, the pool block it
    was copied from or into, its new state, and for the end of a load its latency."""

    group_id: int
    block_id: int
    state: TierState
    seconds: float | None = None


@dataclass(eq=False)
class TierEntry:
    """One offloaded block: its bytes, what its hash covers, and its write-time digest.
    ``extra`` carries what another component attached at spill time (ground truth);
    ``tier_key`` the tier's own key where it differs from the block hash (a tier that keys
    on fewer fields than the device index). ``state`` and ``block_id`` (the pool block it
    last left or entered) change under the tier's lock only; the rest never changes."""

    block_hash: BlockHash
    data: BlockData
    tokens: tuple[int, ...]
    key_fields: KeyFields
    prefix_tokens: int
    kv_digest: str | None = None
    extra: object = None
    group_id: int = 0
    block_id: int = -1
    state: TierState | None = None
    tier_key: BlockHash | None = None

    @property
    def key(self) -> tuple[int, BlockHash]:
        """What the tier files the entry under: (group, tier key or block hash)."""
        return self.group_id, self.block_hash if self.tier_key is None else self.tier_key


def copy_layer(pool: BlockPool, block_id: int, data: BlockData, layer: int) -> None:
    """Copy one layer of ``data`` into pool block ``block_id`` (scales too when quantised)."""
    pool.key[layer, block_id].copy_(data.key[layer])
    pool.value[layer, block_id].copy_(data.value[layer])
    if pool.kv_storage is not None and data.key_scale is not None \
            and data.value_scale is not None:
        pool.key_scale[layer, block_id].copy_(data.key_scale[layer])
        pool.value_scale[layer, block_id].copy_(data.value_scale[layer])


def hit_tier_states(group_id: int, num_hit: int, loaded: Sequence[TierState]
                    ) -> dict[int, tuple[TierState | None, ...]]:
    """``Hit.tier_states`` for a hit of ``num_hit`` blocks whose last ``len(loaded)`` came
    through the tier; the pool's own hits before them are ``None`` (device-resident: the
    protocol's "absent = resident", no padding with RESIDENT); empty when none did."""
    if not loaded:
        return {}
    return {group_id: (None,) * (num_hit - len(loaded)) + tuple(loaded)}


def finish(loads: Sequence[Load], timeout_s: float) -> None:
    """Let loads served while paused complete, and wait for them (cancelled on timeout)."""
    for load in loads:
        load.resume()
    for load in loads:
        if not load.done.wait(timeout_s):
            load.cancel()


@dataclass(eq=False)
class Load:
    """One asynchronous load of ``entry`` into pool block ``block_id`` (a copy job).

    ``layers``: the layers the copy writes (all of them unless a fault cuts it short);
    ``fails``: the copy errors out before writing anything (a fault's broken backend);
    ``hold_after``: the copy stops after that many layers, still ``loading``, and goes on
    only after :meth:`resume` (a fault that serves the block without awaiting the copy
    reads it exactly there). The pause leaves the worker free for the next copies.
    """

    tier: CpuTier
    entry: TierEntry
    pool: BlockPool
    block_id: int
    layers: tuple[int, ...]
    fails: bool = False
    hold_after: int | None = None
    submitted: float = field(default_factory=time.perf_counter)
    outcome: TierState | None = None  # loaded | failed once the copy ended
    seconds: float | None = None
    error: Exception | None = None
    cancelled: bool = False
    resumed: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    parked: threading.Event = field(default_factory=threading.Event)
    _next: int = -1  # index in ``layers`` to copy next; -1 before the copy started

    def run(self) -> None:
        """The worker's side: loading, the per-layer copy, then loaded or failed."""
        if self._next < 0:
            try:
                self.tier.transition(self.entry, S.LOADING)
            except IllegalTierTransition as exc:
                self._end(None, exc)
                return
            self._next = 0
        try:
            if self.fails:
                raise TierCopyError("the tier backend failed the copy back")
            while self._next < len(self.layers):
                if self._next == self.hold_after and not self.resumed:
                    self.parked.set()  # readable here; the rest waits for resume()
                    return
                if self.cancelled:
                    raise TierCopyError("cancelled: the engine stopped waiting")
                copy_layer(self.pool, self.block_id, self.entry.data, self.layers[self._next])
                self._next += 1
            outcome = S.LOADED
            error = None
        except Exception as exc:  # a damaged tier copy (wrong shape...), or the above
            outcome, error = S.FAILED, exc
        self.seconds = time.perf_counter() - self.submitted
        try:
            self.tier.transition(self.entry, outcome, self.seconds)
        except IllegalTierTransition as exc:
            error = exc
        self._end(outcome, error)

    def _end(self, outcome: TierState | None, error: Exception | None) -> None:
        self.outcome = outcome if error is None or outcome is S.FAILED else S.FAILED
        self.error = error
        self.parked.set()
        self.done.set()

    def wait(self, timeout_s: float) -> bool:
        """Until the block may be read: the end of the copy, or (``hold_after``) the pause.
        ``False`` on timeout: the caller must not serve it (see :meth:`cancel`)."""
        return (self.done if self.hold_after is None else self.parked).wait(timeout_s)

    def resume(self) -> None:
        """Let a paused copy finish (queued on the worker again)."""
        if self.hold_after is not None and not self.resumed:
            self.resumed = True
            self.tier.worker.submit(self)

    def cancel(self) -> None:
        """Stop a copy the engine no longer waits for before it writes another layer."""
        self.cancelled = True
        if self.parked.is_set() and not self.done.is_set():
            self.resume()  # a paused copy ends failed instead of waiting forever


class CpuTier:
    """LRU store of offloaded blocks keyed by (group, block hash), with per-entry states
    and a copy worker for loads (see the module docstring)."""

    def __init__(self, capacity: int, queue_depth: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"CPU tier capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.worker = CopyWorker(queue_depth)
        self._entries: OrderedDict[tuple[int, BlockHash], TierEntry] = OrderedDict()
        self._events: deque[TierEvent] = deque()
        self._lock = threading.Lock()
        self.spills = 0
        self.loads = 0  # loads the engine served
        self.failed_loads = 0
        self.dropped = 0  # entries pushed out by the LRU bound
        self.illegal_transitions = 0

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ state machine
    def transition(self, entry: TierEntry, state: TierState,
                   seconds: float | None = None) -> None:
        """Move ``entry`` to ``state`` and queue the event; raises (counted) when the state
        machine has no such edge."""
        with self._lock:
            if state not in LEGAL[entry.state]:
                self.illegal_transitions += 1
                raise IllegalTierTransition(
                    f"tier entry of block {entry.block_id} (group {entry.group_id}): "
                    f"{entry.state} -> {state} is not a legal transition")
            entry.state = state
            if state is S.FAILED:
                self.failed_loads += 1
                key = entry.key
                if self._entries.get(key) is entry:
                    del self._entries[key]  # terminal: never matched again
            self._events.append(TierEvent(entry.group_id, entry.block_id, state, seconds))

    def drain_events(self) -> list[TierEvent]:
        """Transitions since the last call, in order (for the engine to report)."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    # ------------------------------------------------------------------ offload
    def put(self, entry: TierEntry) -> bool:
        """Offload an evicted block (its bytes already copied into ``entry.data``): a fresh
        entry goes resident -> offloading -> offloaded and replaces a settled one under the
        same key. ``False`` (nothing stored) when that key has a copy in flight."""
        key = entry.key
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.state in IN_FLIGHT:
                return False
        for state in (S.RESIDENT, S.OFFLOADING, S.OFFLOADED):
            self.transition(entry, state)
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            self.spills += 1
            self._bound()
        return True

    def _bound(self) -> None:
        """Drop least recently used entries over capacity, never one with a copy in flight."""
        over = len(self._entries) - self.capacity
        victims: list[tuple[int, BlockHash]] = []
        for key, e in self._entries.items():  # oldest first; usually one step
            if len(victims) >= over:
                break
            if e.state not in IN_FLIGHT:
                victims.append(key)
        for key in victims:
            del self._entries[key]
        self.dropped += len(victims)

    # ------------------------------------------------------------------ lookup and load
    def match(self, group_id: int, hashes: Sequence[BlockHash]) -> list[TierEntry]:
        """Entries for the longest run of ``hashes`` (tier keys) this tier can load, from
        the first one (``offloaded`` entries: a loaded one is back in the pool, one in
        flight is not ready)."""
        found: list[TierEntry] = []
        with self._lock:
            for h in hashes:
                entry = self._entries.get((group_id, h))
                if entry is None or entry.state is not S.OFFLOADED:
                    break
                self._entries.move_to_end((group_id, h))
                found.append(entry)
        return found

    def load(self, entry: TierEntry, pool: BlockPool, block_id: int,
             layers: Sequence[int] | None = None, fails: bool = False,
             hold_after: int | None = None) -> Load:
        """Start loading ``entry`` into ``block_id`` on the copy worker; the returned
        :class:`Load` says when the block may be read. Blocks while the queue is full."""
        with self._lock:
            entry.block_id = block_id
        all_layers = tuple(range(int(pool.key.shape[0])))
        job = Load(self, entry, pool, block_id, all_layers if layers is None else tuple(layers),
                   fails=fails, hold_after=hold_after)
        self.worker.submit(job)
        return job
