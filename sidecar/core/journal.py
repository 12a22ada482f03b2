"""The cache-event journal: store and free events leave the engine's thread at once.

Indexing a stored block (chaining its token digest, bumping its epoch, keeping the LRU bound,
logging it in the block lifecycle) costs microseconds of Python; the engine's ``on_store`` and
``on_free`` only append one tuple here, with the block's own token hash so the engine may
reuse its token list as soon as the hook returns (the tuples' format lives in
:mod:`sidecar.core.journal_hooks`); the other block-lifecycle events
(allocate, release, hit) go through it too, so the lifecycle log keeps the engine's order.
The journal is applied, in order, to the :class:`~sidecar.core.store_index.StoreIndex` and the
lifecycle log by a sidecar thread every ``interval_s`` (or as soon as ``wake_at`` events
wait), and by anyone who needs the index current before reading it: a sampled hit (match
time), the verifier's epoch check, a verdict's evidence. Applying holds one lock, so events
are applied exactly once and in the engine's order.

Bounded: past ``max_pending`` events not yet applied (the sidecar thread starved), the
journal and the index are reset and the reset counted. Records then go missing and epochs
move, so in-flight samples are dropped and unrecorded blocks skip the key checks: the safe
direction, never a false alarm.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from sidecar.allocator import LifecycleLog, LifecycleOp
from sidecar.core.hook_input import (
    MAX_BLOCK_ID,
    MAX_GROUP,
    MAX_TOKENS,
    check_blocks,
    check_store,
    to_block_ids,
)
from sidecar.core.journal_hooks import AS_IS_LIFECYCLE_EVENT as _AS_IS
from sidecar.core.journal_hooks import FREE_EVENT as _FREE
from sidecar.core.journal_hooks import STORE_EVENT as _STORE
from sidecar.core.protocol import StoredBlock
from sidecar.core.store_index import StoreIndex
from sidecar.signals import InputReject

log = logging.getLogger(__name__)

# The hook a lifecycle event came through, for the reject counter's label.
_LIFECYCLE_HOOK = {LifecycleOp.ALLOCATE: "on_allocate", LifecycleOp.FREE: "on_release",
                   LifecycleOp.HIT: "on_lookup"}
# Plain strings in the lifecycle tuples (sidecar.allocator.lifecycle: kept untracked).
_OP_STORE, _OP_EVICT = LifecycleOp.STORE.value, LifecycleOp.EVICT.value
_MAX_GENERATION = 1 << 62  # as sidecar.core.hook_input.check_store


def _plain_ids(ids: tuple[Any, ...], hi: int) -> bool:
    """Every id a plain ``int`` in ``[0, hi]``: the common case, checked without a call per
    id (anything else goes to :func:`~sidecar.core.hook_input.to_block_ids`: plain ints, or
    the reason)."""
    for b in ids:  # noqa: SIM110 (a loop: all() over a generator costs 3x per id)
        if type(b) is not int or not 0 <= b <= hi:
            return False
    return True


class CacheEventJournal:
    def __init__(self, index: StoreIndex, lifecycle: LifecycleLog,
                 max_pending: int = 65_536, interval_s: float = 0.25,
                 wake_at: int = 8_192,
                 reject: Callable[[str, InputReject | None], bool] | None = None) -> None:
        self.index = index
        # Full input checks (sidecar.core.hook_input) run here, off the engine's thread: a
        # rejected event is counted under its hook and not applied.
        self._reject = reject or (lambda hook, why: why is not None)
        self.lifecycle = lifecycle
        self.max_pending = max_pending
        # Woken every interval_s, or early once wake_at events wait: a thread that woke
        # every few ms cost the engine's thread ~5% in GIL hand-overs (bench perf).
        self.interval_s = interval_s
        self.wake_at = wake_at
        self._wake = threading.Event()
        self._pending: deque[tuple[Any, ...]] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.resets = 0
        self.applied = 0

    # ------------------------------------------------------------------ engine thread
    # The event tuples are built by sidecar.core.journal_hooks (where their format lives):
    # inline in the Monitor's hooks, or with its store_event/free_event/lifecycle_event.
    def append(self, event: tuple[Any, ...]) -> None:
        """Journal one event built by :mod:`sidecar.core.journal_hooks`."""
        pending = self._pending
        if len(pending) >= self.wake_at:
            self._nudge()
        pending.append(event)

    @property
    def events(self) -> deque[tuple[Any, ...]]:
        """The pending events, for hooks that append their tuples inline (engine thread
        only; check ``len(events) >= wake_at`` first and call :meth:`nudge`)."""
        return self._pending

    def nudge(self) -> None:
        self._nudge()

    def _nudge(self) -> None:
        """Many events wait: wake the thread now; past max_pending, reset (bounded)."""
        if len(self._pending) >= self.max_pending:
            self._overflow()
        elif not self._wake.is_set():
            self._wake.set()

    def _overflow(self) -> None:
        with self._lock:
            self._pending.clear()
            self.index.reset()
            self.resets += 1
        if self.resets == 1 or self.resets % 100 == 0:  # a starved thread: not a log flood
            log.warning("cache-event journal full (%d events not applied): store index "
                        "reset (%d resets)", self.max_pending, self.resets)

    # ------------------------------------------------------------------ applying
    def drain(self) -> int:
        """Apply every pending event, in order; returns how many.

        One pass under the index's lock (:meth:`StoreIndex.locked`), the input checks done
        inline for the common case (plain ints in range); anything else goes to
        :mod:`sidecar.core.hook_input`'s full checks, which name the reason it is rejected for
        (counted under its hook, never raised). The lifecycle events are appended as one
        batch (:meth:`LifecycleLog.extend`): per event, only the work the event needs."""
        pending = self._pending
        if not pending:
            return 0
        n = 0
        reject = self._reject
        with self._lock:
            index, lifecycle = self.index, self.lifecycle
            number = lifecycle.events
            batch: list[tuple[Any, ...]] = []
            add = batch.append
            popleft = pending.popleft
            with index.locked():
                record, forget = index.record_locked, index.forget_locked
                while pending:
                    try:
                        ev = popleft()
                    except IndexError:
                        break
                    n += 1
                    try:
                        kind = ev[0]
                        if kind == _STORE:
                            block: StoredBlock = ev[1]
                            g, b = block.group_id, block.block_id
                            gen, prefix = block.generation, block.prefix_tokens
                            if not (type(g) is int and 0 <= g <= MAX_GROUP
                                    and type(b) is int and 0 <= b <= MAX_BLOCK_ID
                                    and type(gen) is int and 0 <= gen <= _MAX_GENERATION
                                    and type(prefix) is int and 0 <= prefix <= MAX_TOKENS
                                    and ev[2] is not None) \
                                    and reject("on_store", check_store(block) or (
                                        InputReject.TYPE if ev[2] is None else None)):
                                continue
                            record(block, ev[2], ev[4])
                            number += 1
                            add((number, ev[3], _OP_STORE, g, block.seq_id, (b,), (gen,),
                                 prefix + len(block.tokens)))
                        elif kind == _FREE:
                            g, ids = ev[1], ev[2]
                            if not (type(g) is int and 0 <= g <= MAX_GROUP
                                    and len(ids) <= MAX_TOKENS
                                    and _plain_ids(ids, MAX_BLOCK_ID)):
                                why = check_blocks(g, ids)
                                if why is None:  # numpy/torch scalars become plain ints
                                    ids, why = to_block_ids(ids)
                                if reject("on_free", why):
                                    continue
                            forget(g, ids)
                            number += 1
                            add((number, ev[3], _OP_EVICT, g, None, ids, (), None))
                        else:
                            _, op, group, seq, ids, gens, length, at = ev
                            if kind != _AS_IS and not (_plain_ids(ids, MAX_BLOCK_ID)
                                    and _plain_ids(gens, _MAX_GENERATION)):
                                ids, why = to_block_ids(ids)
                                if why is None:
                                    gens, why = to_block_ids(gens, _MAX_GENERATION)
                                if reject(_LIFECYCLE_HOOK.get(op, "on_release"), why):
                                    continue
                            number += 1
                            add((number, at, op, group, seq, ids, gens, length))
                    except Exception:  # a malformed event: dropped, the rest still applied
                        log.exception("cache event could not be applied (dropped)")
            lifecycle.extend(batch)
            self.applied += n
        return n

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvsidecar-journal",
                                            daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.drain()
            except Exception:
                log.exception("cache-event journal drain failed (retried)")

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.drain()
