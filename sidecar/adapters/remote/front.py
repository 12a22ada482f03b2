"""The engine's side of ``dispatch = "process"``: the Monitor's hooks, with everything after
the hook done by another process.

An in-process Monitor applies every store, free, allocation and release on the engine's
process (its journal thread, under the engine's GIL), verifies there and serves /metrics
there: issue 22 counted ~6 us of the engine's process CPU per store. :class:`EngineFront`
keeps only what must happen in the engine's process:

* the hooks' O(1) door checks and a tuple appended to a bounded deque (the *outbox*);
* the sampler's countdown, and for a sampled hit the choice of blocks and the capture of
  the KV the request is served (it must be copied before the hook returns);
* a **shipper** thread that drains the outbox every few milliseconds in order, packs it into
  ``events`` messages (the SGLang tap's batch: runs of one kind each) and sends them over
  the vLLM probe's bounded, never-blocking pipe (:class:`sidecar.adapters.vllm.pipe.Pipe`);
  once per ``allocator_every_s`` it also takes the allocator census (``allocator()`` and
  ``block_tables()`` under a time limit) and ships it behind the events before it.

The sidecar process (:mod:`sidecar.adapters.remote.child`) runs the real Monitor: journal apply,
verification against a reference it builds itself, reporting, HTTP. What a full outbox or
a full pipe loses is counted by what it was (lookups, captures, other events) and rides on
the next message, as the probe's losses do. Hostile hook input is refused by the same door
checks as the Monitor's and counted; what passes them but cannot be packed (a foreign
number type) is sent as a marker string the sidecar's full checks refuse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any

from sidecar.adapters.remote import messages as C
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.wire import capture_fields
from sidecar.config.settings import SidecarConfig
from sidecar.core import attach
from sidecar.core import hook_input as HI
from sidecar.core.hit_input import check_hit_shape
from sidecar.core.protocol import (
    Adapter,
    BlockKV,
    EngineInfo,
    Hit,
    Lookup,
    SequenceId,
    StoredBlock,
    TierState,
)
from sidecar.core.sampling import Burst, UniformSampler
from sidecar.core.time_limits import Guard
from sidecar.signals import DropReason

log = logging.getLogger(__name__)

OUTBOX_LIMIT = 1 << 16  # events waiting for the shipper; past it they are dropped, counted
SHIP_EVERY_S = 0.01  # how often the shipper drains the outbox when nobody wakes it
WAKE_AT = 4096  # outbox length at which the engine's thread wakes the shipper
RUN_ITEMS = 4096  # items per events message (the receiver caps a message at 2**18)

# Outbox kinds: the ``events`` run each goes into (the child's handler of that name).
LOOKUP, STORE, FREE, LIFECYCLE, REQUEST, TIER, CAPTURE, MARK, CENSUS = range(9)
RUN_KINDS = {LOOKUP: "lookups", STORE: "block_stores", FREE: "block_frees",
             LIFECYCLE: "lifecycle", REQUEST: "requests", TIER: "tiers"}
ALLOCATE, RELEASE = 0, 1  # a lifecycle item's op

_PLAIN, _MAX_TOKENS, _MAX_BLOCK = HI.PLAIN_SEQS, HI.MAX_TOKENS, HI.MAX_BLOCK_TOKENS
_KIND = itemgetter(0)


class EngineFront:
    """Implements :class:`sidecar.core.protocol.EventSink` (and the optional lifecycle and
    tier sinks) for an engine whose sidecar runs in another process (module docstring).
    ``hits_allowed`` is always true: protective actions need the Monitor in-process."""

    hits_allowed = True

    def __init__(self, adapter: Adapter, info: EngineInfo, config: SidecarConfig,
                 endpoint: str, pipe_hwm: int = 256) -> None:
        self.info = info
        self.config = config
        self.adapter = adapter
        self.sampler = UniformSampler(config.sample_every, config.seed,
                                      burst=Burst(config.burst_hits, config.burst_every))
        caps = attach.resolve(adapter, self.sampler)
        self._capture: Callable[[Hit, Sequence[Any]], Sequence[BlockKV]] = (
            caps.capture or adapter.read)  # copied now: the sidecar cannot read later
        self._tables = caps.introspection
        self._observe_store, self._observe_free = caps.observe_store, caps.observe_free
        self._observe_release = caps.observe_release
        self.pipe = Pipe(endpoint, pipe_hwm)
        self.guard = Guard(config.adapter_timeout_s)
        self._outbox: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._shipper: threading.Thread | None = None
        self._captures = 0  # taken, and of those handed to the pipe (sent or not):
        self.captures_shipped = 0
        # Counted here, shipped with every census (the sidecar adds the growth):
        self.rejected: Counter[tuple[str, str]] = Counter()  # (hook, reason)
        self.dropped: Counter[str] = Counter()  # samples dropped here, by DropReason value
        self.hook_errors: Counter[str] = Counter()
        # events lost before the pipe, by kind: the full outbox refused them, or (events)
        # a store whose fields could not be read for shipping
        self.outbox_full = Counter[str]()
        self.shipped_events = 0
        self.ship_errors = 0
        self._next_census = 0.0
        self.marks_sent = 0
        self.requests_posted = 0

    # ------------------------------------------------------------------ hooks (engine)
    def on_lookup(self, lookup: Lookup) -> None:
        try:
            if type(lookup) is not Lookup:
                self._refuse("on_lookup", HI.InputReject.TYPE)
                return
            q, h = lookup.query_tokens, lookup.hit_tokens
            if (type(q) is not int or type(h) is not int or not 0 <= h <= q <= HI.MAX_TOKENS) \
                    and self._refuse("on_lookup", HI.check_lookup(lookup)):
                return
            hit = lookup.hit
            if h > 0 and hit is not None and self.sampler.should_sample(hit):
                self._sampled(lookup, hit)
                return
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)((LOOKUP, (q, h)))
        except Exception as exc:
            self._failed("on_lookup", exc)

    def on_store(self, block: StoredBlock) -> None:
        try:
            if (type(block) is not StoredBlock or type(block.tokens) not in _PLAIN
                    or len(block.tokens) > _MAX_BLOCK) \
                    and self._refuse("on_store", HI.check_store(block)):
                return
            # the tokens copied now: the engine may reuse its list once the hook returns
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)((STORE, block, tuple(block.tokens)))
            if self._observe_store is not None:
                self._observe_store(block)
        except Exception as exc:
            self._failed("on_store", exc)

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        try:
            if (type(group_id) is not int or type(block_ids) not in _PLAIN
                    or len(block_ids) > _MAX_TOKENS) \
                    and self._refuse("on_free", HI.check_blocks(group_id, block_ids)):
                return
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)((FREE, (group_id, tuple(block_ids))))
            if self._observe_free is not None:
                self._observe_free(group_id, block_ids)
        except Exception as exc:
            self._failed("on_free", exc)

    def on_allocate(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int],
                    generations: Sequence[int]) -> None:
        try:
            if (type(group_id) is not int or type(block_ids) not in _PLAIN
                    or type(generations) not in _PLAIN or len(block_ids) > _MAX_TOKENS
                    or len(generations) > _MAX_TOKENS) \
                    and self._refuse("on_allocate", HI.check_blocks(group_id, block_ids)
                                     or HI.check_blocks(group_id, generations)):
                return
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)(
                (LIFECYCLE, (ALLOCATE, group_id, seq_id, tuple(block_ids), tuple(generations))))
        except Exception as exc:
            self._failed("on_allocate", exc)

    def on_release(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int]) -> None:
        try:
            if (type(group_id) is not int or type(block_ids) not in _PLAIN
                    or len(block_ids) > _MAX_TOKENS) \
                    and self._refuse("on_release", HI.check_blocks(group_id, block_ids)):
                return
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)(
                (LIFECYCLE, (RELEASE, group_id, seq_id, tuple(block_ids), ())))
            if self._observe_release is not None:
                self._observe_release(group_id, seq_id, block_ids)
        except Exception as exc:
            self._failed("on_release", exc)

    def on_request_done(self, latency_seconds: float) -> None:
        try:
            x = latency_seconds
            if (type(x) is not float or not 0.0 <= x <= HI.MAX_LATENCY_S) \
                    and self._refuse("on_request_done", HI.check_latency(x)):
                return
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)((REQUEST, x))
            self.requests_posted += 1
        except Exception as exc:
            self._failed("on_request_done", exc)

    def on_tier(self, group_id: int, block_id: int, state: TierState,
                seconds: float | None = None) -> None:
        try:
            value = state.value if isinstance(state, TierState) else state
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)(
                (TIER, (group_id, block_id, value, seconds)))
        except Exception as exc:
            self._failed("on_tier", exc)

    # ------------------------------------------------------------------ the sampled hit
    def _sampled(self, lookup: Lookup, hit: Hit) -> None:
        """Check the hit's shape, choose its blocks, copy them now, and queue the capture
        behind every event before it; a hit that cannot be taken still counts as a lookup."""
        q, h = lookup.query_tokens, lookup.hit_tokens
        if self._captures - self.captures_shipped >= self.config.queue_size:
            # captures waiting for the shipper are bounded as the Monitor's queue is
            self.dropped[DropReason.QUEUE_FULL.value] += 1
            self._post((LOOKUP, (q, h)))
            return
        why = HI.check_lookup(lookup) or check_hit_shape(hit, self.info.groups)
        if why is not None:
            self._refuse("on_lookup", why)
            return
        refs = tuple(self.sampler.choose(hit, self.info.block_size,
                                         self.config.blocks_per_sample, self.info.groups))
        blocks: list[BlockKV] = []
        if refs:
            try:
                blocks = [b for b in self._capture(hit, refs) if b.ref in refs]
            except Exception as exc:
                self._failed("capture", exc)
        size = sum(b.key.nbytes + b.value.nbytes for b in blocks)
        if not blocks or size > self.config.capture_max_bytes:
            if blocks:
                self.dropped[DropReason.CAPTURE_TOO_LARGE.value] += 1
            self._post((LOOKUP, (q, h)))
            return
        self._captures += 1
        self._post((CAPTURE, lookup, hit, blocks))
        self._wake.set()  # a sampled hit goes out now, not at the next tick

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
        if n >= WAKE_AT:
            self._wake.set()

    def _refuse(self, hook: str, why: HI.InputReject | None) -> bool:
        if why is None:
            return False
        self.rejected[(hook, why.value)] += 1
        return True

    def _failed(self, hook: str, exc: Exception) -> None:
        try:
            if not self.hook_errors[hook]:
                log.exception("kv-sidecar front hook %s failed (counted; engine unaffected)",
                              hook)
            self.hook_errors[hook] += 1
        except Exception:
            pass

    # ------------------------------------------------------------------ shipper thread
    def start(self) -> EngineFront:
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
                              _fields(b.key_fields), b.parent_block_id, b.kv_digest, b.seq_id,
                              b.prefix_digest, b.write_path] for _, b, tokens in run]
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
        self.shipped_events += len(events)
        return len(events)

    def _ship_one(self, event: tuple[Any, ...]) -> None:
        if event[0] == CAPTURE:
            self.captures_shipped += 1
            self._send_capture(*event[1:])
        elif event[0] == MARK:
            self.pipe.send_message("mark", n=event[1])
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
        self.marks_sent = mark
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



def _fields(key_fields: Any) -> dict[str, Any] | None:
    """A store's key fields as msgpack carries them (a dict; ``None`` when empty)."""
    if type(key_fields) is dict:
        return key_fields or None
    return dict(key_fields) or None
