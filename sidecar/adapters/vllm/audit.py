"""The KV event auditor: an index of what vLLM says it has cached, and a check of every key.

For each ``BlockStored`` block the auditor recomputes the block hash from the event's token
ids, parent hash and extra keys with vLLM's recipe (:mod:`.hashing`) and the engine's
configured algorithm. A disagreement means the engine's key does not cover what it hashed
(a field left out, a different recipe) or two contents collide: either way a hit on that key
can return KV computed for something else. Matches, mismatches and blocks that cannot be
recomputed (parent never seen, LoRA path unknown, random seed) are counted separately, so
"0 mismatches" is never confused with "nothing checked".

The index, per (group, medium), counts how many times each hash is currently stored: a
store of a hash already indexed is a duplicate (vLLM computes the same prefix twice when two
requests sharing it are scheduled before either is cached: legitimate but wasteful, and a
sign of a lost removal when it keeps growing), a removal of a hash not indexed means an
event was lost or the engine removed something it never announced.

Counters go to :class:`sidecar.metrics.Metrics` under the ``KV_EVENT_*`` signals; nothing
here raises on bad input.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping

from sidecar import signals as S
from sidecar.adapters.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from sidecar.adapters.vllm.hashing import (
    ExternalHash,
    Unverifiable,
    event_extra_keys_to_hash_keys,
    hash_block,
    hash_function,
    matches,
    none_hash,
)
from sidecar.metrics import Metrics

log = logging.getLogger(__name__)

UNVERIFIABLE_REASONS = ("parent_unknown", "lora_path_unknown", "random_seed",
                        "unknown_extra_key")
_LOG_FIRST = 5  # mismatches logged in full; the rest are only counted


class EventAuditor:
    """Applies decoded event batches to the index and audits every stored block's hash.

    ``algo`` and ``hash_seed`` must be the engine's ``--prefix-caching-hash-algo`` and its
    ``PYTHONHASHSEED`` (``None`` when unset). ``max_hashes`` bounds the memory of full
    digests kept to chain int-published hashes (oldest dropped first).
    """

    def __init__(self, metrics: Metrics, algo: str = "sha256", hash_seed: str | None = None,
                 lora_paths: Mapping[str, str] | None = None,
                 max_hashes: int = 1_000_000) -> None:
        self.metrics = metrics
        self.algo = algo
        self._fn = hash_function(algo)
        self._none_hash = none_hash(algo, hash_seed)
        self._lora_paths = dict(lora_paths or {})
        self._max_hashes = max_hashes
        self._index: dict[tuple[int, str], dict[ExternalHash, int]] = {}
        self._full: OrderedDict[ExternalHash, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._mismatches_logged = 0
        self._init_series()

    def _init_series(self) -> None:
        m = self.metrics
        for t in ("stored", "removed", "cleared"):
            m.inc(S.KV_EVENTS, 0, type=t)
        for r in ("frames", "payload", "schema"):
            m.inc(S.KV_EVENT_DECODE_ERRORS, 0, reason=r)
        for r in UNVERIFIABLE_REASONS:
            m.inc(S.KV_EVENT_HASH_UNVERIFIABLE, 0, reason=r)
        for sig in (S.KV_EVENT_HASHES_VERIFIED, S.KV_EVENT_HASH_MISMATCHES,
                    S.KV_EVENT_DUPLICATE_STORES, S.KV_EVENT_UNKNOWN_REMOVALS):
            m.inc(sig, 0, group="0")
        for sig in (S.KV_EVENT_GAPS, S.KV_EVENT_BATCHES_LOST, S.KV_EVENT_BATCHES_REPLAYED):
            m.inc(sig, 0)

    # ------------------------------------------------------------------ applying batches
    def apply(self, batch: EventBatch) -> None:
        with self._lock:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self._stored(ev)
                elif isinstance(ev, BlockRemoved):
                    self._removed(ev)
                elif isinstance(ev, AllBlocksCleared):
                    self._cleared()
            self._publish_index()

    def reset(self) -> None:
        """Forget everything (the engine restarted: its cache is empty again)."""
        with self._lock:
            self._index.clear()
            self._full.clear()
            self._publish_index()

    def decode_error(self, reason: str) -> None:
        self.metrics.inc(S.KV_EVENT_DECODE_ERRORS, reason=reason)

    def _stored(self, ev: BlockStored) -> None:
        group = str(ev.group_idx)
        index = self._index.setdefault((ev.group_idx, ev.medium or "none"), {})
        self.metrics.inc(S.KV_EVENTS, len(ev.block_hashes), type="stored")
        parent = self._first_parent(ev)
        for i, published in enumerate(ev.block_hashes):
            parent = self._audit_block(ev, i, published, parent, group)
            count = index.get(published, 0)
            if count:
                self.metrics.inc(S.KV_EVENT_DUPLICATE_STORES, group=group)
            index[published] = count + 1

    def _first_parent(self, ev: BlockStored) -> bytes | Unverifiable:
        if ev.parent_block_hash is None:
            if self._none_hash is None:
                return Unverifiable("random_seed")
            return self._none_hash
        if isinstance(ev.parent_block_hash, bytes):
            return ev.parent_block_hash
        full = self._full.get(ev.parent_block_hash)
        return full if full is not None else Unverifiable("parent_unknown")

    def _audit_block(self, ev: BlockStored, i: int, published: ExternalHash,
                     parent: bytes | Unverifiable, group: str) -> bytes | Unverifiable:
        """Audit block ``i``; returns the full digest its child should chain on."""
        try:
            if isinstance(parent, Unverifiable):
                raise parent
            raw_keys = ev.extra_keys[i] if ev.extra_keys is not None else None
            keys = event_extra_keys_to_hash_keys(raw_keys, ev.lora_name, self._lora_paths)
            full = hash_block(self._fn, parent, ev.block_tokens(i), keys)
        except Unverifiable as why:
            self.metrics.inc(S.KV_EVENT_HASH_UNVERIFIABLE, reason=why.reason)
            return self._published_full(published, why)
        if matches(full, published):
            self.metrics.inc(S.KV_EVENT_HASHES_VERIFIED, group=group)
            self._remember(published, full)
            return full
        self.metrics.inc(S.KV_EVENT_HASH_MISMATCHES, group=group)
        if self._mismatches_logged < _LOG_FIRST:
            self._mismatches_logged += 1
            log.warning("vLLM block hash mismatch (group %s, block %d of a %d-block store): "
                        "engine published %r, recipe %s gives %r; the key does not cover "
                        "what it should, or two contents collide", group, i,
                        len(ev.block_hashes), published, self.algo, full.hex())
        # The child was chained on the engine's digest, not ours.
        return self._published_full(published, Unverifiable("parent_unknown"))

    @staticmethod
    def _published_full(published: ExternalHash, why: Unverifiable) -> bytes | Unverifiable:
        return published if isinstance(published, bytes) else Unverifiable(
            "parent_unknown" if why.reason != "random_seed" else "random_seed")

    def _remember(self, published: ExternalHash, full: bytes) -> None:
        if isinstance(published, bytes):
            return  # the event carries the full digest itself
        self._full[published] = full
        self._full.move_to_end(published)
        while len(self._full) > self._max_hashes:
            self._full.popitem(last=False)

    def _removed(self, ev: BlockRemoved) -> None:
        group = str(ev.group_idx)
        index = self._index.setdefault((ev.group_idx, ev.medium or "none"), {})
        self.metrics.inc(S.KV_EVENTS, len(ev.block_hashes), type="removed")
        for h in ev.block_hashes:
            count = index.get(h, 0)
            if count <= 0:
                self.metrics.inc(S.KV_EVENT_UNKNOWN_REMOVALS, group=group)
                continue
            if count == 1:
                del index[h]
                if not any(h in idx for idx in self._index.values()):
                    self._full.pop(h, None)
            else:
                index[h] = count - 1

    def _cleared(self) -> None:
        # vLLM's AllBlocksCleared names no medium: the whole prefix cache was reset. Counted
        # as the blocks it drops, like stores and removals.
        self.metrics.inc(S.KV_EVENTS, sum(sum(idx.values()) for idx in self._index.values()),
                         type="cleared")
        for idx in self._index.values():
            idx.clear()
        self._full.clear()

    def _publish_index(self) -> None:
        for (group, medium), idx in self._index.items():
            self.metrics.gauge(S.KV_INDEXED_BLOCKS, group=str(group),
                               medium=medium).set(sum(idx.values()))

    # ------------------------------------------------------------------ queries
    def indexed(self, group: int = 0, medium: str = "GPU") -> int:
        with self._lock:
            return sum(self._index.get((group, medium), {}).values())

    def is_indexed(self, published: ExternalHash, group: int = 0, medium: str = "GPU") -> bool:
        with self._lock:
            return self._index.get((group, medium), {}).get(published, 0) > 0

    def summary(self) -> dict[str, float]:
        m = self.metrics
        return {
            "events_stored": m.value(S.KV_EVENTS.name, type="stored"),
            "events_removed": m.value(S.KV_EVENTS.name, type="removed"),
            "hashes_verified": _sum(m, S.KV_EVENT_HASHES_VERIFIED.name, "group"),
            "hash_mismatches": _sum(m, S.KV_EVENT_HASH_MISMATCHES.name, "group"),
            "hash_unverifiable": _sum(m, S.KV_EVENT_HASH_UNVERIFIABLE.name, "reason"),
            "duplicate_stores": _sum(m, S.KV_EVENT_DUPLICATE_STORES.name, "group"),
            "unknown_removals": _sum(m, S.KV_EVENT_UNKNOWN_REMOVALS.name, "group"),
            "decode_errors": _sum(m, S.KV_EVENT_DECODE_ERRORS.name, "reason"),
            "gaps": m.value(S.KV_EVENT_GAPS.name),
            "batches_lost": m.value(S.KV_EVENT_BATCHES_LOST.name),
            "batches_replayed": m.value(S.KV_EVENT_BATCHES_REPLAYED.name),
        }


def _sum(m: Metrics, name: str, label: str) -> float:
    return float(sum(m.by_label(name, label).values()))
