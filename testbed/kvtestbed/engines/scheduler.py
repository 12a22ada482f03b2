"""The request loop both reference engines share (the plain paged engine and the hybrid one):
a FIFO of waiting requests admitted up to ``max_running``, a decode step for every running
sequence per iteration, chained block hashing, and a sink whose errors never reach the
engine. Each engine supplies how a request is admitted, prefilled, decoded and finished."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

from kvtestbed.engines.config import EngineConfig
from kvtestbed.engines.faults import Fault
from kvtestbed.engines.pool import BlockHash, KeyFields, chain_hash
from kvtestbed.engines.sequence import KEY_FIELD_NAMES, Request, Result
from sidecar.core.protocol import EventSink


class BatchScheduler:
    """Base of the reference engines: the scheduler loop and its bookkeeping."""

    config: EngineConfig
    fault: Fault
    sink: EventSink | None
    sink_errors: Counter[str]
    stats: Counter[str]
    block_size: int
    _waiting: deque[tuple[int, Request, float]]
    _running: list[Any]
    _head_blocked: bool
    _next_index: int
    # The engine's own prefix-cache hit metric (tokens), as its /metrics would export it:
    # what the sidecar's hit-counter audit (sidecar.allocator.hit_counter) checks.
    hit_metric: int = 0

    # ------------------------------------------------------------------ what an engine adds
    def _admissible(self, request: Request) -> bool:
        """Whether the request could ever run (an empty pool would fit it)."""
        raise NotImplementedError

    def _admit(self, index: int, request: Request, submitted: float) -> Any:
        """The admitted sequence, or ``None`` when its blocks are not free now."""
        raise NotImplementedError

    def _prefill(self, seq: Any) -> None:
        raise NotImplementedError

    def _decode(self, seq: Any) -> None:
        raise NotImplementedError

    def _finish(self, seq: Any) -> Result:
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop
    def key_fields(self, request: Request) -> KeyFields:
        """The full key-field tuple the cache must distinguish for ``request``."""
        fields = {"model_revision": self.config.model.revision, **request.key_fields}
        return tuple((name, str(fields.get(name, ""))) for name in KEY_FIELD_NAMES)

    def submit(self, request: Request) -> int:
        """Queue a request; its index (submission order) identifies its :class:`Result`."""
        index = self._next_index
        self._next_index += 1
        self._waiting.append((index, request, time.perf_counter()))
        self.stats["submitted"] += 1
        return index

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def step(self) -> list[Result]:
        """One scheduler iteration: a decode step for every running sequence, then admit
        (and prefill) waiting requests up to ``max_running``. Returns finished requests."""
        done: list[Result] = []
        self._count_hits(self._next_index - 1, 0, new_batch=True)
        for seq in list(self._running):
            if len(seq.output) < seq.request.max_new_tokens:
                self._decode(seq)
            if len(seq.output) >= seq.request.max_new_tokens:
                done.append(self._finish(seq))
        while self._waiting and len(self._running) < self.config.max_running:
            if self._head_blocked:
                break
            index, request, submitted = self._waiting[0]
            if not self._admissible(request):
                self._waiting.popleft()
                done.append(self._reject(index, request, submitted))
                continue
            admitted = self._admit(index, request, submitted)
            if admitted is None:
                if self._running:
                    self._head_blocked = True  # wait for a release to make room
                    break
                self._waiting.popleft()
                done.append(self._reject(index, request, submitted))
                continue
            self._waiting.popleft()
            self._prefill(admitted)
            if len(admitted.output) >= request.max_new_tokens:
                done.append(self._finish(admitted))
        return done

    def run(self, requests: Iterable[Request]) -> list[Result]:
        """Serve ``requests`` (up to ``max_running`` at once); results in request order."""
        for r in requests:
            self.submit(r)
        results: list[Result] = []
        while not self.idle:
            results.extend(self.step())
        return sorted(results, key=lambda r: r.request_index)

    def serve(self, request: Request) -> Result:
        """Serve one request to completion on an idle engine."""
        if not self.idle:
            raise RuntimeError("serve() needs an idle engine; use submit()/step() or run()")
        return self.run([request])[0]

    # ------------------------------------------------------------------ hashing
    def block_hash(self, seq_id: int, parent: BlockHash | None, tokens: Sequence[int],
                   key_fields: KeyFields) -> BlockHash:
        custom = self.fault.block_hash(seq_id, parent, tokens, key_fields)
        return custom if custom is not None else chain_hash(parent, tokens, key_fields)

    def _chain(self, seq_id: int, tokens: Sequence[int], key_fields: KeyFields,
               num_blocks: int, hashes: list[BlockHash]) -> None:
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(self.block_hash(seq_id, parent, tokens[i * bs:(i + 1) * bs],
                                          key_fields))

    def _tier_chain(self, seq_id: int, tokens: Sequence[int], key_fields: KeyFields,
                    hashes: list[BlockHash]) -> list[BlockHash]:
        """The tier's keys for the blocks ``hashes`` name: the hashes themselves, unless a
        fault keys the tier on fewer fields (``Fault.tier_key_fields``)."""
        kept = self.fault.tier_key_fields(seq_id, key_fields)
        if kept is None or kept == key_fields:
            return hashes
        bs = self.block_size
        chain: list[BlockHash] = []
        for i in range(len(hashes)):
            chain.append(chain_hash(chain[i - 1] if i else None, tokens[i * bs:(i + 1) * bs],
                                    kept))
        return chain

    # ------------------------------------------------------------------ bookkeeping
    def _count_hits(self, request_index: int, tokens: int, new_batch: bool = False) -> None:
        """Count ``tokens`` hit tokens of request ``request_index`` in the engine's stats and
        publish its hit metric (``new_batch``: an iteration starts, nothing hit yet)."""
        if new_batch:
            self.stats["batch_hit_tokens"] = 0
        self.stats["hit_tokens"] += tokens
        self.stats["batch_hit_tokens"] += tokens
        self.hit_metric = self.fault.published_hit_tokens(
            request_index, self.stats["hit_tokens"], self.stats["batch_hit_tokens"])

    def _span(self, request: Request) -> tuple[int, int]:
        """Positions whose KV the request writes (the last output token is never fed
        back), and the blocks that takes."""
        tokens = len(request.tokens) + request.max_new_tokens - 1
        return tokens, -(-tokens // self.block_size)

    def _reject(self, index: int, request: Request, submitted: float) -> Result:
        self.stats["rejected"] += 1
        return Result(index, request, (), len(request.tokens), 0,
                      time.perf_counter() - submitted, rejected=True)

    def _emit(self, hook: str, *args: Any) -> None:
        """Call the sink; whatever it raises is counted and swallowed. Optional hooks
        (on_allocate, on_release) are skipped where the sink has none."""
        fn = getattr(self.sink, hook, None) if self.sink is not None else None
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:
            self.sink_errors[hook] += 1

    def hit_rate(self) -> float:
        """Token hit rate so far: hit tokens / prompt tokens looked up."""
        q = self.stats["query_tokens"]
        return self.stats["hit_tokens"] / q if q else 0.0

