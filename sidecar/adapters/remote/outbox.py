"""The front's outbox and its shipper (:mod:`.front` has the hooks): what the engine's
thread queued, sent in order by a thread of its own.

The hooks append ``(kind, item)`` tuples to a bounded deque (inline; :meth:`Outbox._post`
past :data:`WAKE_AT`). Every :data:`SHIP_EVERY_S`, or when woken, the shipper drains it:
consecutive events of one kind become one run of an ``events`` message (SGLang's tap's
batch, at most :data:`RUN_ITEMS` items a message), a sampled hit's capture, a mark or a
census goes out alone after everything before it, so the sidecar applies them in the order
the engine made them. Once per ``allocator_every_s`` the shipper also takes the allocator
census under the adapter's time limit. Nothing here raises into the engine: what cannot be
packed or sent is counted by what it was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from itertools import groupby
from operator import itemgetter
from typing import Any

from sidecar.adapters.remote import messages as C
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.wire import capture_fields
from sidecar.config.settings import SidecarConfig
from sidecar.core.capabilities import AllocatorIntrospection
from sidecar.core.protocol import Adapter, BlockKV, Hit, Lookup
from sidecar.core.time_limits import Guard

log = logging.getLogger(__name__)

OUTBOX_LIMIT = 1 << 16  # events waiting for the shipper; past it they are dropped, counted
# How often the shipper drains the outbox when nobody wakes it: a sampled hit wakes it (its
# capture goes out with everything before it), so events need not go sooner. A thread that
# woke every 5-10 ms cost the engine ~5% in GIL hand-overs (as the journal's once did).
SHIP_EVERY_S = 0.25
WAKE_AT = 4096  # outbox length at which the engine's thread wakes the shipper
RUN_ITEMS = 4096  # items per events message (the receiver caps a message at 2**18)

# Outbox kinds: the ``events`` run each goes into (the child's handler of that name).
LOOKUP, STORE, FREE, LIFECYCLE, REQUEST, TIER, CAPTURE, MARK, CENSUS = range(9)
RUN_KINDS = {LOOKUP: "lookups", STORE: "block_stores", FREE: "block_frees",
             LIFECYCLE: "lifecycle", REQUEST: "requests", TIER: "tiers"}
ALLOCATE, RELEASE = 0, 1  # a lifecycle item's op

_KIND = itemgetter(0)


class Outbox:
    """The front's outbox and shipper, a mixin :class:`.front.EngineFront` inherits (its
    hooks append to ``_outbox`` directly: a delegating call would cost every event)."""

    config: SidecarConfig
    adapter: Adapter
    pipe: Pipe
    guard: Guard
    _tables: AllocatorIntrospection | None
    _outbox: deque[tuple[Any, ...]]
    _wake: threading.Event
    _stop: threading.Event
    _shipper: threading.Thread | None
    _captures: int
    captures_shipped: int
    rejected: Counter[tuple[str, str]]
    dropped: Counter[str]
    hook_errors: Counter[str]
    outbox_full: Counter[str]
    ship_errors: int
    _next_census: float

    def _failed(self, hook: str, exc: Exception) -> None:
        raise NotImplementedError  # the front's

    # ------------------------------------------------------------------ outbox
    def _post(self, event: tuple[Any, ...]) -> None:
        """Queue ``event``; past :data:`WAKE_AT` waiting the shipper is woken, past
        :data:`OUTBOX_LIMIT` the event is dropped and counted by what it was. The hooks
        inline the common case (fewer than WAKE_AT waiting: an append)."""
        box = self._outbox
        n = len(box)
        if n >= OUTBOX_LIMIT:
            self.outbox_full["capture" if event[0] == CAPTURE else
                              "lookups" if event[0] == LOOKUP else "events"] += 1
            return
        box.append(event)
        if n >= WAKE_AT and not self._wake.is_set():  # set() takes a lock: once is enough
            self._wake.set()

    # ------------------------------------------------------------------ shipper thread
    def start(self) -> Any:
        if self._shipper is None:
            self._stop.clear()
            self._shipper = threading.Thread(target=self._ship_loop, daemon=True,
                                             name="kvsidecar-front-shipper")
            self._shipper.start()
        return self

    def _ship_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(SHIP_EVERY_S)
            self._wake.clear()
            try:
                self.ship()
                if time.monotonic() >= self._next_census:
                    self._next_census = time.monotonic() + self.config.allocator_every_s
                    self.send_census()
            except Exception:
                self.ship_errors += 1
                log.exception("kv-sidecar front: shipping failed (counted)")

    def ship(self) -> int:
        """Send what waits in the outbox, in order (the shipper's; :meth:`stop` too): runs
        of one kind each, at most :data:`RUN_ITEMS` items a message; a capture, mark or
        census goes out on its own, after everything before it."""
        box = self._outbox
        popleft = box.popleft
        events = [popleft() for _ in range(len(box))]
        runs: list[list[Any]] = []
        total = 0
        for kind, group in groupby(events, key=_KIND):
            if kind >= CAPTURE:  # alone, after what came before
                self._send_runs(runs)
                runs, total = [], 0
                for event in group:
                    self._ship_one(event)
                continue
            run = list(group)
            try:
                if kind == STORE:
                    items = [[b.group_id, b.block_id, b.generation, tokens, b.prefix_tokens,
                              fields, b.parent_block_id, b.kv_digest, b.seq_id,
                              b.prefix_digest, b.write_path] for _, b, tokens, fields in run]
                else:
                    items = [e[1] for e in run]
            except Exception as exc:  # a store whose fields cannot be read: counted, lost
                self.outbox_full["events"] += len(run)
                self._failed("on_store", exc)
                continue
            for at in range(0, len(items), RUN_ITEMS):
                chunk = items[at:at + RUN_ITEMS] if len(items) > RUN_ITEMS else items
                runs.append([RUN_KINDS[kind], {"items": chunk}])
                total += len(chunk)
                if total >= RUN_ITEMS:
                    self._send_runs(runs)
                    runs, total = [], 0
        self._send_runs(runs)
        return len(events)

    def _ship_one(self, event: tuple[Any, ...]) -> None:
        if event[0] == CAPTURE:
            self.captures_shipped += 1
            self._send_capture(*event[1:])
        elif event[0] == MARK:  # with this front's counts: current once a drain returns
            self.pipe.send_message("mark", n=event[1], counts=self.counts())
        else:
            self.send_census()

    def _send_runs(self, runs: list[list[Any]]) -> None:
        if not runs:
            return
        try:
            self.pipe.send_message("events", runs=runs)
        except Exception:  # an item msgpack cannot hold (an int past 64 bits): counted lost
            self.pipe.account_unsent("events", runs=runs)
            self.ship_errors += 1

    def _send_capture(self, lookup: Lookup, hit: Hit, blocks: list[BlockKV]) -> None:
        """One sampled hit; one that cannot be packed is a dropped sample whose lookup is
        still counted (the pipe's rule for a capture it could not send)."""
        try:
            fields = capture_fields(
                f"front-{self._captures}", "hit", None, hit.tokens, lookup.query_tokens,
                lookup.hit_tokens, {g: list(ids) for g, ids in hit.blocks.items()},
                [(b.ref.group_id, b.ref.index, b.ref.block_id, b.key, b.value)
                 for b in blocks])
            fields.update(C.hit_extras(lookup, hit, blocks), key_fields=dict(hit.key_fields))
            self.pipe.send_message("capture", **fields)
        except Exception:
            self.pipe.account_unsent("capture", query_tokens=lookup.query_tokens,
                                     hit_tokens=lookup.hit_tokens)
            self.ship_errors += 1

    def send_census(self) -> None:
        """The allocator's state and block tables, taken now under the adapter's time limit,
        behind every event shipped before; with this front's own counts."""
        state = tables = None
        try:  # each call under the adapter's time limit, as the in-process poller's
            state = self.guard.call("allocator", self.adapter.allocator)
            if self._tables is not None:
                tables = self.guard.call("block_tables", self._tables.block_tables)
        except Exception as exc:
            self._failed("census", exc)
        try:
            self.pipe.send_message("census", **C.census_fields(state, tables, self.counts()))
        except Exception as exc:
            self._failed("census", exc)

    def counts(self) -> dict[str, Any]:
        """What this front counted (totals since start): refused hook input, samples
        dropped, hook errors, events the full outbox refused."""
        return {"rejected": [[h, r, n] for (h, r), n in self.rejected.items()],
                "dropped": dict(self.dropped), "hook_errors": dict(self.hook_errors),
                "outbox_full": dict(self.outbox_full)}

    def sync(self, mark: int) -> None:
        """Queue ``mark`` behind every event so far and ship now (the caller then asks the
        sidecar to wait for it: :meth:`sidecar.adapters.remote.process.SidecarProcess.drain`)."""
        self._outbox.append((MARK, mark))
        self._wake.set()

    def request_census(self) -> None:
        """Queue a census behind every event so far (the shipper takes it)."""
        self._outbox.append((CENSUS,))
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ship what waits, then stop the shipper and close the pipe."""
        self._stop.set()
        self._wake.set()
        if self._shipper is not None:
            self._shipper.join(timeout_s)
            self._shipper = None
        try:
            self.ship()
            self.send_census()
        except Exception:
            self.ship_errors += 1
        self.pipe.close()
