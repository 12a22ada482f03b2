"""The sampled hit on the engine's thread: which blocks, their records and epochs as of
this match, a capture of what the request is served, the lifecycle's hit event, and the
hand-over to the dispatcher (:mod:`sidecar.core.dispatch`).

Kept out of :mod:`sidecar.core.monitor` (one job per module) as a mixin the Monitor inherits,
like :mod:`sidecar.core.journal_hooks`: this is the costliest thing the engine's thread does
for the sidecar (issue 20 counts its instructions), so it reads the Monitor's attributes
directly. What it reads of the hit is only what it picks: every id is checked by the verifier
(:mod:`sidecar.core.hit_input`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar import signals as S
from sidecar.allocator import LifecycleOp
from sidecar.checks.verifier import Sample
from sidecar.config.settings import SidecarConfig
from sidecar.core.cache_view import CacheView
from sidecar.core.dispatch import Dispatcher
from sidecar.core.hit_input import BadHit
from sidecar.core.journal import CacheEventJournal
from sidecar.core.journal_hooks import AS_IS_LIFECYCLE_EVENT
from sidecar.core.protocol import BlockKV, BlockRef, BlockWrite, EngineInfo, Hit, SequenceId
from sidecar.core.sampling import Sampler
from sidecar.core.time_limits import adapter_error
from sidecar.export.metrics import Metrics
from sidecar.signals import DropReason, InputReject

_HIT, _now = LifecycleOp.HIT.value, time.time  # read once; the op as a plain string


class SampledHits:
    """The Monitor's sampled-hit path (see the module docstring)."""

    info: EngineInfo
    config: SidecarConfig
    sampler: Sampler
    cache: CacheView
    journal: CacheEventJournal
    dispatcher: Dispatcher
    metrics: Metrics
    _capture: Callable[[Hit, Sequence[BlockRef]], Sequence[BlockKV]] | None
    _c_sampled: Any

    def _reject(self, hook: str, why: InputReject | None) -> bool:
        raise NotImplementedError  # the Monitor's

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        raise NotImplementedError  # the Monitor's

    def _sample(self, hit: Hit) -> Sample | None:
        """The blocks to check, their store records and epochs as they are now (match
        time), and, where the adapter can, a capture of the KV the request is served."""
        refs = tuple(self.sampler.choose(hit, self.info.block_size,
                                         self.config.blocks_per_sample, self.info.groups))
        if not refs:
            # No block to read. A hit that claims a full block and lists none for it still
            # goes to the verifier, whose coverage check names what is missing
            # (missing_group_state), as it does for a list that stops short; only a hit
            # shorter than a block has nothing to check.
            if hit.hit_tokens < self.info.block_size:
                return None
            return self._take(hit, (), None)
        return self._take(hit, refs, self._capture_now(hit, refs))

    def _take(self, hit: Hit, refs: tuple[BlockRef, ...],
              captured: dict[BlockRef, BlockKV] | None,
              writes: Mapping[BlockRef, BlockWrite] | None = None) -> Sample:
        """A sample as of this match: every store/free so far applied, then the refs'
        store records and epochs snapshotted next to the capture."""
        records, epochs = self.cache.snapshot(refs)
        return Sample(hit, refs, records, time.time(), epochs, captured, writes or {})

    def _capture_now(self, hit: Hit, refs: tuple[BlockRef, ...]
                     ) -> dict[BlockRef, BlockKV] | None:
        """The served bytes of ``refs``, copied on the engine's thread before the hook
        returns (bounded in bytes); ``None`` when the adapter cannot or the copy failed."""
        if self._capture is None:
            return None
        out: dict[BlockRef, BlockKV] = {}
        size = 0
        try:
            for b in self._capture(hit, refs):
                if b.ref in refs:
                    size += b.key.nbytes + b.value.nbytes
                    out[b.ref] = b
        # Raised, or garbage returned: the verifier reads instead. A SystemExit & co too:
        # never into the engine.
        except BaseException as exc:
            self._hook_failed("capture", adapter_error("capture", exc))
            return None
        if size > self.config.capture_max_bytes:
            self.metrics.inc(S.SAMPLES_DROPPED, reason=DropReason.CAPTURE_TOO_LARGE.value)
            return None
        return out

    def _enqueue(self, hit: Hit, seq_id: SequenceId | None = None,
                 hit_tokens: int | None = None) -> None:
        try:
            events = self._hit_events(hit, seq_id, hit_tokens)
            sample = self._sample(hit)
        except BadHit as bad:  # a list that cannot be read, or a picked id that is none
            self._reject("on_lookup", bad.reason)
            return
        append = self.journal.append
        for ev in events:
            append(ev)
        if sample is None:
            return
        self._c_sampled.value += 1
        self.dispatcher.submit(sample)

    def _log_hit(self, hit: Hit, seq_id: SequenceId | None, hit_tokens: int | None) -> None:
        for ev in self._hit_events(hit, seq_id, hit_tokens):
            self.journal.append(ev)

    @staticmethod
    def _hit_events(hit: Hit, seq_id: SequenceId | None, hit_tokens: int | None
                    ) -> list[tuple[Any, ...]]:
        """The lifecycle's hit event per group (sampled hits only): the ids copied as they
        are and applied as they are (the verifier checks them; the lifecycle's readers skip
        an event whose ids are not ids: :mod:`sidecar.allocator.lifecycle`). A list that
        cannot be copied is :class:`BadHit`."""
        try:  # lifecycle_event(..., as_is=True), inline: one call less per group
            gens, at = hit.generations, _now()
            return [(AS_IS_LIFECYCLE_EVENT, _HIT, group_id, seq_id, tuple(blocks),
                     tuple(gens.get(group_id, ())), hit_tokens, at)
                    for group_id, blocks in hit.blocks.items()]
        except Exception:  # past the shape check, an iterator that raises
            raise BadHit(InputReject.TYPE) from None
