"""The cache-event journal: store and free events leave the engine's thread at once.

Indexing a stored block (chaining its token digest, bumping its epoch, keeping the LRU bound,
logging it in the block lifecycle) costs microseconds of Python; the engine's ``on_store`` and
``on_free`` only append one tuple here (plus the block's own token hash, so the engine may
reuse its token list as soon as the hook returns); the other block-lifecycle events
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
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from sidecar.allocator import LifecycleLog, LifecycleOp
from sidecar.checks.keys import tokens_hash
from sidecar.core.hook_input import check_block_ids, check_blocks, check_store
from sidecar.core.protocol import StoredBlock
from sidecar.core.store_index import StoreIndex
from sidecar.signals import InputReject

log = logging.getLogger(__name__)

_STORE, _FREE, _LIFECYCLE = 0, 1, 2
# The hook a lifecycle event came through, for the reject counter's label.
_LIFECYCLE_HOOK = {LifecycleOp.ALLOCATE: "on_allocate", LifecycleOp.FREE: "on_release",
                   LifecycleOp.HIT: "on_lookup"}


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
    def store(self, block: StoredBlock) -> None:
        pending = self._pending
        if len(pending) >= self.wake_at:
            self._nudge()
        try:
            digest: int | None = tokens_hash(block.tokens)
        except TypeError:  # unhashable token values: rejected when applied, never raised
            digest = None
        pending.append((_STORE, block, digest, time.time()))

    def free(self, group_id: int, block_ids: Sequence[int]) -> None:
        pending = self._pending
        if len(pending) >= self.wake_at:
            self._nudge()
        pending.append((_FREE, group_id, tuple(block_ids), time.time()))

    def lifecycle_event(self, op: LifecycleOp, group_id: int, seq_id: Any,
                        block_ids: Sequence[int], generations: Sequence[int] = (),
                        length: int | None = None) -> None:
        """A lifecycle-only event (allocate, release, hit), kept in order with the rest."""
        pending = self._pending
        if len(pending) >= self.wake_at:
            self._nudge()
        pending.append((_LIFECYCLE, op, group_id, seq_id, tuple(block_ids),
                        tuple(generations), length, time.time()))

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
        """Apply every pending event, in order; returns how many."""
        pending = self._pending
        if not pending:
            return 0
        n = 0
        with self._lock:
            index, lifecycle = self.index, self.lifecycle
            while pending:
                try:
                    ev = pending.popleft()
                except IndexError:
                    break
                n += 1
                try:
                    if ev[0] == _STORE:
                        block: StoredBlock = ev[1]
                        if self._reject("on_store", check_store(block) or (
                                InputReject.TYPE if ev[2] is None else None)):
                            continue
                        index.record(block, ev[2])
                        lifecycle.record(LifecycleOp.STORE, block.group_id, block.seq_id,
                                         (block.block_id,), (block.generation,),
                                         block.prefix_tokens + len(block.tokens), at=ev[3])
                    elif ev[0] == _FREE:
                        if self._reject("on_free", check_blocks(ev[1], ev[2])
                                        or check_block_ids(ev[2])):
                            continue
                        index.forget(ev[1], ev[2])
                        lifecycle.record(LifecycleOp.EVICT, ev[1], None, ev[2], at=ev[3])
                    else:
                        _, op, group, seq, ids, gens, length, at = ev
                        if self._reject(_LIFECYCLE_HOOK.get(op, "on_release"),
                                        check_block_ids(ids)
                                        or check_block_ids(gens, 1 << 62)):
                            continue
                        lifecycle.record(op, group, seq, ids, gens, length, at=at)
                except Exception:  # a malformed event: dropped, the rest still applied
                    log.exception("cache event could not be applied (dropped)")
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
