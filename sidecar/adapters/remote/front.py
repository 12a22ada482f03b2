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

The outbox and the shipper live in :mod:`.outbox`. The sidecar process (:mod:`.child`)
runs the real Monitor: journal apply,
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
from dataclasses import replace
from typing import Any

from sidecar.adapters.remote.outbox import (
    ALLOCATE,
    CAPTURE,
    FREE,
    LIFECYCLE,
    LOOKUP,
    RELEASE,
    REQUEST,
    STORE,
    TIER,
    WAKE_AT,
    Outbox,
)
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.wire import MAX_ITEMS
from sidecar.config.settings import SidecarConfig
from sidecar.core import attach
from sidecar.core import hook_input as HI
from sidecar.core.hit_input import sanitized_hit
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
from sidecar.core.time_limits import Guard, adapter_error
from sidecar.signals import DropReason

log = logging.getLogger(__name__)

_PLAIN, _MAX_TOKENS, _MAX_BLOCK = HI.PLAIN_SEQS, HI.MAX_TOKENS, HI.MAX_BLOCK_TOKENS
_monotonic = time.monotonic


class EngineFront(Outbox):
    """Implements :class:`sidecar.core.protocol.EventSink` (and the optional lifecycle and
    tier sinks) for an engine whose sidecar runs in another process (module docstring).
    ``hits_allowed`` is always true: protective actions need the Monitor in-process."""

    hits_allowed = True

    def __init__(self, adapter: Adapter, info: EngineInfo, config: SidecarConfig,
                 endpoint: str, pipe_hwm: int = 256, src: str | None = None) -> None:
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
        self.pipe = Pipe(endpoint, pipe_hwm, src=src)  # src: the secret the sidecar knows
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
        self.ship_errors = 0
        self._next_census = 0.0
        self.requests_posted = 0
        m = config.allocator_check_min_interval_s  # NaN or < 0: no census on release
        self._nudge_every = m if m == m and m >= 0 else 0.0
        self._nudge_at: float | None = 0.0 if m == m and m >= 0 else None

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
            # the tokens and key fields copied now: the engine may reuse or change them once
            # the hook returns (a mapping changed after the call gave false key-field
            # anomalies in the in-process journal: outside check)
            kf = block.key_fields
            fields = None
            if kf:  # store_index.key_fields_snapshot, inline (the call: +420 instructions)
                try:
                    fields = kf.copy() if type(kf) is dict else dict(kf)
                except Exception:  # a mapping that cannot be read: refused, not raised
                    self._refuse("on_store", HI.InputReject.TYPE)
                    return
            box = self._outbox  # _post, inline (a method call less per event)
            (box.append if len(box) < WAKE_AT else self._post)(
                (STORE, block, tuple(block.tokens), fields))
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
            # A release is where premature and double frees happen: a census soon, as the
            # Monitor's nudged poll (at most one per allocator_check_min_interval_s).
            if self._nudge_at is not None and _monotonic() >= self._nudge_at:
                self._nudge_at = _monotonic() + self._nudge_every
                self.request_census()
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
        # Off the engine's thread in-process (the verifier's), here: there is no later
        # read. Sampled hits only; the same reasons are counted and the lookup still is.
        copy, why = sanitized_hit(hit, self.info.groups)
        why = HI.check_lookup(lookup) or why
        if why is not None or copy is None:
            self._refuse("on_lookup", why or HI.InputReject.TYPE)
            self._post((LOOKUP, (q, h)))
            return
        blocks: list[BlockKV] = []
        unlisted = False  # full blocks claimed, none listed: the sidecar judges its coverage
        try:
            refs = tuple(self.sampler.choose(copy, self.info.block_size,
                                             self.config.blocks_per_sample, self.info.groups))
            unlisted = not refs and copy.hit_tokens >= self.info.block_size
            # the tokens the checks read (the hit's and the chosen blocks'), copied now
            end = max([r.token_range(self.info.block_size)[1] for r in refs], default=0)
            copy = replace(copy, tokens=copy.tokens[:max(end, copy.hit_tokens)])
            if refs and max(len(copy.tokens), *map(len, copy.blocks.values())) > MAX_ITEMS:
                # past what one capture message holds (the wire's cap): dropped, counted
                self.dropped[DropReason.CAPTURE_TOO_LARGE.value] += 1
                refs = ()
            if refs:
                blocks = [b for b in self._capture(copy, refs) if b.ref in refs]
            size = sum(b.key.nbytes + b.value.nbytes for b in blocks)
        # The adapter could not copy them: no later read either. A SystemExit & co too:
        # never into the engine.
        except BaseException as exc:
            self._failed("capture", adapter_error("capture", exc))
            self.dropped[DropReason.ADAPTER_ERROR.value] += 1
            blocks, size, unlisted = [], 0, False
        if (not blocks and not unlisted) or size > self.config.capture_max_bytes:
            if blocks:
                self.dropped[DropReason.CAPTURE_TOO_LARGE.value] += 1
            self._post((LOOKUP, (q, h)))
            return
        self._captures += 1
        self._post((CAPTURE, lookup, copy, blocks))
        self._wake.set()  # a sampled hit goes out now, not at the next tick

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
