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

Counters go to :class:`sidecar.export.metrics.Metrics` under the ``KV_EVENT_*`` signals; nothing
here raises on bad input.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping

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
    hash_function,
    matches,
    none_hash,
)
from sidecar.export.metrics import Metrics
from sidecar.signals import Signal

log = logging.getLogger(__name__)

UNVERIFIABLE_REASONS = ("parent_unknown", "lora_path_unknown", "random_seed",
                        "unknown_extra_key")
DECODE_ERROR_REASONS = ("frames", "payload", "schema", "handle")
# vLLM's media (GPU, CPU offload, LMCache-style storage tiers). A medium or group a peer
# names that the sidecar does not know is labelled "other": label values never come from
# the wire, so a hostile stream cannot mint series.
KNOWN_MEDIA = ("GPU", "CPU", "DISK", "STORAGE", "none")
OTHER = "other"
_LOG_FIRST = 5  # mismatches logged in full; the rest are only counted
# Short keys of the per-batch tally (hashing a Signal dataclass per block costs more).
_TALLIED: dict[str, Signal] = {
    "events": S.KV_EVENTS, "duplicate": S.KV_EVENT_DUPLICATE_STORES,
    "evictions": S.KV_EVENT_INDEX_EVICTIONS, "unverifiable": S.KV_EVENT_HASH_UNVERIFIABLE,
    "verified": S.KV_EVENT_HASHES_VERIFIED, "mismatch": S.KV_EVENT_HASH_MISMATCHES,
    "unknown_removal": S.KV_EVENT_UNKNOWN_REMOVALS,
}


class EventAuditor:
    """Applies decoded event batches to the index and audits every stored block's hash.

    ``algo`` and ``hash_seed`` must be the engine's ``--prefix-caching-hash-algo`` and its
    ``PYTHONHASHSEED`` (``None`` when unset). ``max_hashes`` bounds the memory of full
    digests kept to chain int-published hashes (oldest dropped first); ``max_indexed``
    bounds the index (a lost removal batch or a restarted engine must not grow it forever:
    the oldest entries go first, counted in ``kv_event_index_evictions_total``).
    ``groups`` are the cache groups the engine has (``describe()``); others are "other".
    """

    def __init__(self, metrics: Metrics, algo: str = "sha256", hash_seed: str | None = None,
                 lora_paths: Mapping[str, str] | None = None,
                 max_hashes: int = 1_000_000, max_indexed: int = 2_000_000,
                 groups: Iterable[int] | None = None,
                 media: Iterable[str] = KNOWN_MEDIA) -> None:
        self.metrics = metrics
        metrics.register(S.VLLM_SIGNALS)  # the vLLM adapter's own signals
        self.algo = algo
        self._fn = hash_function(algo)
        self._none_hash = none_hash(algo, hash_seed)
        self._lora_paths = dict(lora_paths or {})
        self._max_hashes = max_hashes
        self._max_indexed = max_indexed
        self._groups = frozenset(groups) if groups is not None else frozenset(range(8))
        self._media = frozenset(media)
        # Only known (group, medium) pairs are cached: the cache cannot grow from the wire.
        self._label_cache: dict[tuple[int, str | None], tuple[str, str]] = {
            (g, m): (str(g), m) for g in self._groups for m in self._media}
        for g in self._groups:
            self._label_cache[(g, None)] = (str(g), "none")
        # (group label, medium label) -> {published hash: times stored}; insertion-ordered,
        # so the oldest entries are evicted first when the index is full.
        self._index: dict[tuple[str, str], dict[ExternalHash, int]] = {}
        self._counts: dict[tuple[str, str], int] = {}  # running sum of each index's values
        self._size = 0  # entries over all indexes
        self._full: OrderedDict[ExternalHash, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._mismatches_logged = 0
        self._init_series()

    def _init_series(self) -> None:
        m = self.metrics
        for t in ("stored", "removed", "cleared"):
            m.inc(S.KV_EVENTS, 0, type=t)
        for r in DECODE_ERROR_REASONS:
            m.inc(S.KV_EVENT_DECODE_ERRORS, 0, reason=r)
        for r in UNVERIFIABLE_REASONS:
            m.inc(S.KV_EVENT_HASH_UNVERIFIABLE, 0, reason=r)
        for sig in (S.KV_EVENT_HASHES_VERIFIED, S.KV_EVENT_HASH_MISMATCHES,
                    S.KV_EVENT_DUPLICATE_STORES, S.KV_EVENT_UNKNOWN_REMOVALS):
            m.inc(sig, 0, group="0")
        for sig in (S.KV_EVENT_GAPS, S.KV_EVENT_BATCHES_LOST, S.KV_EVENT_BATCHES_REPLAYED,
                    S.KV_EVENT_INDEX_EVICTIONS):
            m.inc(sig, 0)

    def _labels(self, group_idx: int, medium: str | None) -> tuple[str, str]:
        known = self._label_cache.get((group_idx, medium))
        if known is not None:
            return known
        g = str(group_idx) if group_idx in self._groups else OTHER
        med = medium or "none"
        return g, (med if med in self._media else OTHER)

    # ------------------------------------------------------------------ applying batches
    def apply(self, batch: EventBatch) -> None:
        """Counters are summed over the batch and published once (the per-block cost is a
        hash and a dict update, nothing more)."""
        tally: Counter[tuple[str, str, str]] = Counter()
        with self._lock:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self._stored(ev, tally)
                elif isinstance(ev, BlockRemoved):
                    self._removed(ev, tally)
                elif isinstance(ev, AllBlocksCleared):
                    self._cleared(tally)
            self._publish(tally)

    def reset(self) -> None:
        """Forget everything (the engine restarted: its cache is empty again)."""
        with self._lock:
            for key in self._counts:
                self._counts[key] = 0
            self._index.clear()
            self._size = 0
            self._full.clear()
            self._publish(Counter())

    def decode_error(self, reason: str) -> None:
        self.metrics.inc(S.KV_EVENT_DECODE_ERRORS,
                         reason=reason if reason in DECODE_ERROR_REASONS else "schema")

    def _stored(self, ev: BlockStored, tally: Counter[tuple[str, str, str]]) -> None:
        key = self._labels(ev.group_idx, ev.medium)
        group = key[0]
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = {}
            self._counts.setdefault(key, 0)
        n = len(ev.block_hashes)
        tally[("events", "type", "stored")] += n
        parent = self._first_parent(ev)
        fresh = 0
        soft = ev.skipped_blocks > 0  # only the first stored block chains on a guess
        for i, published in enumerate(ev.block_hashes):
            parent = self._audit_block(ev, i, published, parent, group, tally, soft)
            soft = False
            count = index.get(published, 0)
            if count:
                tally[("duplicate", "group", group)] += 1
            else:
                fresh += 1
            index[published] = count + 1
        self._size += fresh
        self._counts[key] += n
        if self._size > self._max_indexed:
            self._evict(tally)

    def _evict(self, tally: Counter[tuple[str, str, str]]) -> None:
        """Drop the oldest entries (of the largest index) until the index fits again."""
        while self._size > self._max_indexed:
            key = max(self._index, key=lambda k: len(self._index[k]))
            index = self._index[key]
            h, count = next(iter(index.items()))
            del index[h]
            self._counts[key] -= count
            self._size -= 1
            self._full.pop(h, None)
            tally[("evictions", "", "")] += 1

    def _first_parent(self, ev: BlockStored) -> bytes | Unverifiable:
        if ev.parent_block_hash is None:
            if self._none_hash is None:
                return Unverifiable("random_seed")
            if ev.skipped_blocks:
                return self._skipped_chain(ev)
            return self._none_hash
        if isinstance(ev.parent_block_hash, bytes):
            return ev.parent_block_hash
        full = self._full.get(ev.parent_block_hash)
        return full if full is not None else Unverifiable("parent_unknown")

    def _skipped_chain(self, ev: BlockStored) -> bytes:
        """The digest a hybrid group's first stored block chains on: the chain over the
        skipped blocks' tokens. Their extra keys (a cache salt on block 0) are not in the
        event, so it is computed without any; where that is wrong the first stored block
        does not match and is counted unverifiable, not a mismatch (``soft``)."""
        assert self._none_hash is not None
        parent, bs = self._none_hash, ev.block_size
        for j in range(ev.skipped_blocks):
            parent = self._fn((parent, ev.token_ids[j * bs:(j + 1) * bs], None))
        return parent

    def _audit_block(self, ev: BlockStored, i: int, published: ExternalHash,
                     parent: bytes | Unverifiable, group: str,
                     tally: Counter[tuple[str, str, str]],
                     soft: bool = False) -> bytes | Unverifiable:
        """Audit block ``i``; returns the full digest its child should chain on. ``soft``:
        the parent is a guess (see :meth:`_skipped_chain`), so a mismatch is unverifiable."""
        try:
            if isinstance(parent, Unverifiable):
                raise parent
            raw_keys = ev.extra_keys[i] if ev.extra_keys is not None else None
            keys = event_extra_keys_to_hash_keys(raw_keys, ev.lora_name, self._lora_paths) \
                if raw_keys else None
            bs = ev.block_size
            # token ids are already checked ints (events.py): no per-token conversion here
            lo = (i + ev.skipped_blocks) * bs
            full = self._fn((parent, ev.token_ids[lo:lo + bs], keys))
        except Unverifiable as why:
            tally[("unverifiable", "reason", why.reason)] += 1
            return self._published_full(published, why)
        ok = int.from_bytes(full[-8:], "big") == published if type(published) is int \
            else matches(full, published)  # the int form inlined: the common case
        if ok:
            tally[("verified", "group", group)] += 1
            self._remember(published, full)
            return full
        if soft:
            tally[("unverifiable", "reason", "parent_unknown")] += 1
            return self._published_full(published, Unverifiable("parent_unknown"))
        tally[("mismatch", "group", group)] += 1
        if self._mismatches_logged < _LOG_FIRST:
            self._mismatches_logged += 1
            log.warning("vLLM block hash mismatch (group %s, block %d of a %d-block store): "
                        "engine published %.40r, recipe %s gives %r; the key does not cover "
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
        fulls = self._full
        if published in fulls:
            fulls.move_to_end(published)
        fulls[published] = full
        if len(fulls) > self._max_hashes:
            fulls.popitem(last=False)

    def _removed(self, ev: BlockRemoved, tally: Counter[tuple[str, str, str]]) -> None:
        key = self._labels(ev.group_idx, ev.medium)
        index = self._index.get(key, {})
        tally[("events", "type", "removed")] += len(ev.block_hashes)
        for h in ev.block_hashes:
            count = index.get(h, 0)
            if count <= 0:
                tally[("unknown_removal", "group", key[0])] += 1
                continue
            self._counts[key] -= 1
            if count == 1:
                del index[h]
                self._size -= 1
                if h in self._full and not any(h in idx for idx in self._index.values()):
                    del self._full[h]
            else:
                index[h] = count - 1

    def _cleared(self, tally: Counter[tuple[str, str, str]]) -> None:
        # vLLM's AllBlocksCleared names no medium: the whole prefix cache was reset. Counted
        # as the blocks it drops, like stores and removals.
        tally[("events", "type", "cleared")] += sum(self._counts.values())
        for idx in self._index.values():
            idx.clear()
        for key in self._counts:
            self._counts[key] = 0
        self._size = 0
        self._full.clear()

    def _publish(self, tally: Counter[tuple[str, str, str]]) -> None:
        m = self.metrics
        for (name, label, value), n in tally.items():
            sig = _TALLIED[name]
            if label:
                m.inc(sig, n, **{label: value})
            else:
                m.inc(sig, n)
        for (group, medium), n in self._counts.items():
            m.gauge(S.KV_INDEXED_BLOCKS, group=group, medium=medium).set(n)

    # ------------------------------------------------------------------ queries
    def indexed(self, group: int = 0, medium: str = "GPU") -> int:
        with self._lock:
            return self._counts.get(self._labels(group, medium), 0)

    def is_indexed(self, published: ExternalHash, group: int = 0, medium: str = "GPU") -> bool:
        with self._lock:
            return self._index.get(self._labels(group, medium), {}).get(published, 0) > 0

    @property
    def index_size(self) -> int:
        """Distinct (group, medium, hash) entries held: bounded by ``max_indexed``."""
        with self._lock:
            return self._size

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
            "index_evictions": m.value(S.KV_EVENT_INDEX_EVICTIONS.name),
        }


def _sum(m: Metrics, name: str, label: str) -> float:
    return float(sum(m.by_label(name, label).values()))


def bench_ingest(n: int = 20_000, per_batch: int = 100, block_size: int = 16,
                 repeats: int = 3) -> dict[str, float]:
    """KV-event ingestion speed (for ``kv-sidecar bench perf``): ``n`` one-block
    ``BlockStored`` events in batches of ``per_batch``, timed side by side as msgpack decode
    alone and as the sidecar's decode + audit (hash recomputed and checked, index updated).
    Best of ``repeats`` on CPU time of this thread's process, so a busy machine skews both
    the same way. Target: >= 200k events/s ingested on one core."""
    import time

    import msgpack

    from sidecar.adapters.vllm.events import decode_message, encode_batch
    from sidecar.adapters.vllm.hashing import external, hash_block

    fn, parent = hash_function("sha256"), none_hash("sha256", None)
    assert parent is not None
    events = []
    for i in range(n):
        tokens = list(range(i * block_size, (i + 1) * block_size))
        events.append({"type": "BlockStored",
                       "block_hashes": [external(hash_block(fn, parent, tokens, None), True)],
                       "parent_block_hash": None, "token_ids": tokens,
                       "block_size": block_size, "lora_id": None, "medium": "GPU",
                       "lora_name": None})
    msgs = [encode_batch(j, [0.0, events[k:k + per_batch]])
            for j, k in enumerate(range(0, n, per_batch))]
    best_raw = best_ingest = float("inf")
    verified = 0.0
    for _ in range(max(1, repeats)):
        t = time.process_time()
        for m in msgs:
            msgpack.unpackb(m[2], raw=False, strict_map_key=False)
        best_raw = min(best_raw, time.process_time() - t)
        auditor = EventAuditor(Metrics("bench", "ingest"))
        t = time.process_time()
        for m in msgs:
            auditor.apply(decode_message(m))
        best_ingest = min(best_ingest, time.process_time() - t)
        verified = auditor.summary()["hashes_verified"]
    raw_rate, rate = n / max(best_raw, 1e-9), n / max(best_ingest, 1e-9)
    return {"events": float(n), "hashes_verified": verified,
            "msgpack_events_per_s": raw_rate, "ingest_events_per_s": rate,
            "ingest_vs_msgpack": rate / raw_rate}
