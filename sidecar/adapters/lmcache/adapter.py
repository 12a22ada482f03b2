"""The LMCache adapter: an ``LMCacheEngine`` driven as vLLM's LMCache connector drives it
(``store`` / ``lookup`` / ``retrieve``), with every retrieve reported to the sidecar.

What each call adds to LMCache's own behaviour (its results are returned unchanged, its
exceptions propagate unchanged; the adapter's own bookkeeping never raises):

* ``store``: each full chunk LMCache is asked to store gets a bounded chunk id
  (:mod:`.chunks`) and a write-time fingerprint of its bytes (:mod:`.taps`), sent to the
  Monitor as a :class:`~sidecar.core.protocol.StoredBlock`;
* ``lookup``: LMCache's lookup token counts are mirrored (``lmcache_lookup_*``);
* ``retrieve``: one :class:`~sidecar.core.protocol.Lookup` per retrieve, with LMCache's own
  counts (requested tokens, tokens it reports loaded), so the sidecar's hit rate is
  LMCache's retrieve hit rate; per chunk, the tier that served it and whether it loaded.
  The hit is a :class:`ChunkHit` whose blocks are the chunks; when the Monitor samples it,
  the KV the engine was actually handed is captured before ``retrieve`` returns.

The Monitor's worker then verifies sampled chunks off the engine's path: the captured KV
against the fingerprint taken at store (any changed byte, on any tier), against the copy
the tier holds now (``changed_after_serving``: the engine was handed other bytes than the
tier holds, a load that did not land), and against an HF recompute under the dtype's
tolerance.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sidecar import signals as S
from sidecar.adapters.lmcache.chunks import ChunkIds
from sidecar.adapters.lmcache.layout import FlatServedKV, ServedKV, chunk_to_block
from sidecar.adapters.lmcache.taps import StorageTap, tier_of
from sidecar.checks.fingerprint import kv_digest
from sidecar.core.protocol import (
    AllocatorState,
    BlockKV,
    BlockRef,
    CacheGroup,
    EngineInfo,
    GroupKind,
    Hit,
    Lookup,
    StoredBlock,
)
from sidecar.signals import LMCacheTier, RetrieveOutcome

log = logging.getLogger(__name__)

GROUP = 0  # LMCache stores all layers of a chunk together: one cache group


class ChunkReference(Protocol):
    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...


class ChunkSink(Protocol):
    """What the adapter reports to: :class:`sidecar.adapters.lmcache.LMCacheMonitor`."""

    metrics: Any

    def on_lookup(self, lookup: Lookup) -> None: ...

    def on_store(self, block: StoredBlock) -> None: ...

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class ChunkHit(Hit):
    """A retrieve as a hit: ``blocks[0]`` are chunk ids, ``tiers[i]`` the tier chunk ``i``
    came from (:class:`~sidecar.signals.LMCacheTier`)."""

    tiers: tuple[str, ...] = ()


class _PrefixIds(Sequence[int]):
    """Chunk ids of a retrieve, resolved on first use: the served chunks' ids are known, the
    masked prefix's (the engine already held those tokens) are hashed only if the hit is
    sampled, never on the unsampled path."""

    def __init__(self, adapter: LMCacheAdapter, tokens: list[int], prefix_chunks: int,
                 served: list[int]) -> None:
        self._adapter = adapter
        self._tokens = tokens
        self._prefix_chunks = prefix_chunks
        self._served = served
        self._ids: list[int] | None = None if prefix_chunks else served

    def _resolve(self) -> list[int]:
        if self._ids is None:
            prefix = self._adapter.prefix_ids(self._tokens, self._prefix_chunks)
            self._ids = prefix + self._served
        return self._ids

    def __len__(self) -> int:
        return self._prefix_chunks + len(self._served)

    def __getitem__(self, i: Any) -> Any:
        return self._resolve()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._resolve())


def _token_list(tokens: Any) -> list[int]:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]


def _masked_prefix(mask: torch.Tensor | None, n: int) -> int:
    """Tokens at the head of the request that the mask leaves out (LMCache's masks are
    always ``F..FT..T``)."""
    return 0 if mask is None else n - int(mask.sum())


class LMCacheAdapter:
    """Wraps one ``LMCacheEngine`` (see the module docstring); also the sidecar
    :class:`~sidecar.core.protocol.Adapter` the Monitor's verifier calls back."""

    def __init__(self, engine: Any, reference: ChunkReference,
                 served: ServedKV | None = None, chunk_ids: int = 100_000,
                 model: str | None = None, fingerprint: bool = True) -> None:
        """``fingerprint``: digest every stored chunk on the engine's thread (one layout
        copy and BLAKE2b over its bytes: ~1.5 ms per MB stored, measured on this project's
        2-core CI box); without it the content checks, the tier comparison and the
        recompute still run, the exact byte check does not."""
        md = engine.metadata
        layers, _, _, heads, head_dim = md.kv_shape
        self.engine = engine
        self.chunk_size = int(engine.config.chunk_size)
        self.num_kv_heads, self.head_dim = int(heads), int(head_dim)
        self.info = EngineInfo(
            engine="lmcache", model=model or md.model_name, revision="",
            dtype=str(md.kv_dtype).removeprefix("torch."), block_size=self.chunk_size,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            groups=(CacheGroup(GROUP, GroupKind.FULL_ATTENTION, tuple(range(int(layers))),
                               name="lmcache"),))
        self.reference = reference
        self.served = served or FlatServedKV(self.num_kv_heads, self.head_dim)
        self.ids = ChunkIds(chunk_ids, on_recycle=self._recycled)
        self.tap = StorageTap(engine.storage_manager, self._digest if fingerprint else None)
        self._sink: ChunkSink | None = None
        self._serving = threading.local()
        self._failures_logged: set[str] = set()

    def attach(self, sink: ChunkSink) -> None:
        self._sink = sink

    def close(self) -> None:
        self.tap.close()

    # ------------------------------------------------------------------ engine surface
    def store(self, tokens: Any, mask: torch.Tensor | None = None, **kwargs: Any) -> None:
        """``LMCacheEngine.store``, then each stored full chunk reported with its digest."""
        self.tap.begin()
        try:
            self.engine.store(tokens, mask=mask, **kwargs)
        finally:
            puts = self.tap.end().puts
        try:
            self._stored(tokens, mask, puts)
        except Exception as exc:
            self._failed("lmcache_store", exc)

    def lookup(self, tokens: Any, **kwargs: Any) -> int:
        """``LMCacheEngine.lookup``; its token counts mirrored."""
        found = self.engine.lookup(tokens, **kwargs)
        try:
            if self._sink is not None:
                m = self._sink.metrics
                m.inc(S.LMCACHE_LOOKUP_TOKENS, len(tokens))
                m.inc(S.LMCACHE_LOOKUP_HIT_TOKENS, int(found))
        except Exception as exc:
            self._failed("lmcache_lookup", exc)
        return int(found)

    def retrieve(self, tokens: Any, mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        """``LMCacheEngine.retrieve``; the retrieve reported as one lookup and its chunks'
        outcomes by tier, the served KV captured if the Monitor samples it."""
        self.tap.begin()
        try:
            loaded = self.engine.retrieve(tokens, mask, **kwargs)
        finally:
            gets = self.tap.end().gets
        try:
            self._retrieved(tokens, mask, loaded, gets, kwargs)
        except Exception as exc:
            self._failed("lmcache_retrieve", exc)
        return loaded

    # ------------------------------------------------------------------ bookkeeping
    def _stored(self, tokens: Any, mask: torch.Tensor | None,
                puts: list[tuple[Any, str | None]]) -> None:
        if self._sink is None or not puts:
            return
        toks = _token_list(tokens)
        start = _masked_prefix(mask, len(toks))
        cs = self.chunk_size
        parent: int | None = None
        for key, digest in puts:
            end = start + cs
            if end > len(toks):  # an unfull last chunk: not a block the sidecar checks
                break
            cid = self.ids.id_for(key)
            self._sink.on_store(StoredBlock(GROUP, cid, 0, toks[start:end], start,
                                            parent_block_id=parent, kv_digest=digest))
            self._sink.metrics.inc(S.LMCACHE_STORED_CHUNKS)
            parent, start = cid, end

    def _retrieved(self, tokens: Any, mask: torch.Tensor | None, loaded: torch.Tensor,
                   gets: list[Any], kwargs: Mapping[str, Any]) -> None:
        sink = self._sink
        if sink is None:
            return
        toks = _token_list(tokens)
        n = len(toks)
        prefix = _masked_prefix(mask, n)
        loaded_tokens = int(loaded.sum())
        cs = self.chunk_size
        m = sink.metrics
        served: list[int] = []
        tiers: list[str] = [LMCacheTier.ENGINE.value] * (prefix // cs)
        start, contiguous = prefix, True
        for g in gets:
            end = min(start + cs, n)
            ok = bool(loaded[start:end].all()) if end > start else False
            tier = tier_of(g.backend)
            m.inc(S.LMCACHE_RETRIEVED_CHUNKS, tier=tier.value,
                  outcome=(RetrieveOutcome.LOADED if ok else RetrieveOutcome.FAILED).value)
            contiguous = contiguous and ok
            if contiguous and end - start == cs:
                served.append(self.ids.id_for(g.key))
                tiers.append(tier.value)
            start = end
        hit = None
        if loaded_tokens > 0:  # a hit, counted as LMCache counts it, sampled or not
            blocks: Sequence[int] = _PrefixIds(self, toks, prefix // cs, served) \
                if served else ()
            hit = ChunkHit(tokens=toks, hit_tokens=len(blocks) * cs, blocks={GROUP: blocks},
                           tiers=tuple(tiers))
        self._serving.kwargs = kwargs
        try:
            sink.on_lookup(Lookup(query_tokens=n - prefix, hit_tokens=loaded_tokens, hit=hit))
        finally:
            self._serving.kwargs = None

    def prefix_ids(self, tokens: list[int], chunks: int) -> list[int]:
        """Chunk ids of the first ``chunks`` chunks of ``tokens`` (LMCache's own keys)."""
        out: list[int] = []
        for _, _, key in self.engine.token_database.process_tokens(
                tokens=tokens[:chunks * self.chunk_size]):
            out.append(self.ids.id_for(key))
        return out[:chunks]

    def _digest(self, memory_obj: Any) -> str:
        k, v = chunk_to_block(memory_obj.tensor, self.num_kv_heads, self.head_dim)
        return kv_digest(k, v)

    def _recycled(self, chunk_id: int) -> None:
        if self._sink is not None:
            self._sink.on_free(GROUP, (chunk_id,))

    def _failed(self, where: str, exc: Exception) -> None:
        try:
            if self._sink is not None:
                self._sink.metrics.inc(S.HOOK_ERRORS, hook=where)
            if where not in self._failures_logged:
                self._failures_logged.add(where)
                log.exception("kv-sidecar %s bookkeeping failed (counted; LMCache "
                              "unaffected): %s", where, exc)
        except Exception:
            pass

    # ------------------------------------------------------------------ sidecar Adapter
    def describe(self) -> EngineInfo:
        return self.info

    def capture(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """The KV the engine was handed for ``refs``, read on the engine's thread inside
        ``retrieve`` (called by the Monitor for sampled hits only)."""
        kwargs = getattr(self._serving, "kwargs", None)
        if kwargs is None:
            return []
        out = []
        for ref in refs:
            lo, hi = ref.token_range(self.chunk_size)
            k, v = self.served(kwargs, lo, hi)
            out.append(BlockKV(ref, k, v))
        return out

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        """The chunk as a tier holds it now: the tier that served it first, then any other
        that has it. Chunks no tier holds any more are left out."""
        tiers = getattr(hit, "tiers", ())
        backends = self.engine.storage_manager.storage_backends
        out = []
        for ref in refs:
            key = self.ids.key_of(ref.block_id)
            if key is None:
                continue
            tier = tiers[ref.index] if ref.index < len(tiers) else None
            names = sorted(backends, key=lambda b: tier_of(b).value != tier)
            chunk = self._read_chunk(backends, names, key)
            if chunk is not None:
                k, v = chunk_to_block(chunk, self.num_kv_heads, self.head_dim)
                out.append(BlockKV(ref, k, v))
        return out

    @staticmethod
    def _read_chunk(backends: Mapping[str, Any], names: list[str], key: Any
                    ) -> torch.Tensor | None:
        for name in names:
            backend = backends[name]
            if not backend.contains(key):
                continue
            obj = backend.get_blocking(key)
            if obj is None:
                continue
            try:
                return obj.tensor.clone()
            finally:
                obj.ref_count_down()
        return None

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return self.reference.recompute(hit, refs)

    def allocator(self) -> AllocatorState | None:
        return None  # LMCache's tiers are not a block pool; its usage is its own gauge
