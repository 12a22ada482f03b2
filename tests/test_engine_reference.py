"""The reference engine and its adapter: cache correctness, events, adapter contract."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.calibrate import ErrorRecorder
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import (
    ChatWorkload,
    WorkloadConfig,
    drive,
    token_hit_rate,
)

from sidecar.checks.tolerance import tolerance_for
from sidecar.core.protocol import Adapter, AdapterError, BlockRef, GroupKind, Hit, StoredBlock
from tests.reference_helpers import RecordingSink, clean_small, greedy_without_cache


def test_prefix_reuse_decodes_exactly_like_no_cache_fp32() -> None:
    engine, results = clean_small()
    reused = [r for r in results if r.hit_tokens > 0]
    assert len(reused) >= 20
    # Hits of every shape: system prompt only, previous turns, decode-written blocks.
    sample = reused[:: max(1, len(reused) // 10)]
    for r in sample:
        expected = greedy_without_cache(engine.model, r.request.tokens,
                                        r.request.key_fields["adapter"],
                                        r.request.max_new_tokens)
        assert r.output_tokens == expected, r.request.tag


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cached_blocks_match_recompute_within_tolerance(dtype: str) -> None:
    engine = ReferenceEngine(EngineConfig(model=ModelConfig(dtype=dtype), num_blocks=64))
    recorder = ErrorRecorder(ReferenceAdapter(engine))
    engine.sink = recorder
    drive(engine, ChatWorkload(WorkloadConfig(conversations=12, max_turns=4)))
    assert len(recorder.errors) >= 150
    assert max(recorder.errors) <= tolerance_for(dtype)
    assert not recorder.content_kinds and recorder.stale_generations == 0
    assert engine.pool.key.dtype == getattr(torch, dtype)


def test_events_describe_the_cache_exactly() -> None:
    sink = RecordingSink()
    engine = ReferenceEngine(EngineConfig(num_blocks=64), sink=sink)
    drive(engine, ChatWorkload(WorkloadConfig(conversations=12, max_turns=4)))
    bs = engine.block_size
    stored: dict[int, StoredBlock] = {}
    hits = 0
    for kind, event in sink.events:
        if kind == "store":
            assert isinstance(event, StoredBlock)
            assert len(event.tokens) == bs and event.prefix_tokens % bs == 0
            if event.prefix_tokens:
                parent = stored[event.parent_block_id]  # type: ignore[index]
                assert parent.prefix_tokens == event.prefix_tokens - bs
            else:
                assert event.parent_block_id is None
            assert event.key_fields["model_revision"] == "r1"
            stored[event.block_id] = event
        elif kind == "free":
            for b in event[1]:  # type: ignore[index]
                assert stored.pop(b).block_id == b  # only stored blocks are reported freed
        elif kind == "lookup" and event.hit is not None:  # type: ignore[attr-defined]
            hit: Hit = event.hit  # type: ignore[attr-defined]
            hits += 1
            assert hit.hit_tokens < len(hit.tokens)  # never the last prompt token
            for i, (b, gen) in enumerate(zip(hit.blocks[0], hit.generations[0], strict=True)):
                record = stored[b]  # a hit only ever names a live stored block...
                assert record.generation == gen  # ...that was not reused since
                assert record.prefix_tokens == i * bs
                assert tuple(record.tokens) == tuple(hit.tokens[i * bs:(i + 1) * bs])
                assert dict(record.key_fields) == dict(hit.key_fields)
    assert hits >= 20 and engine.pool.evictions > 0
    assert len(sink.of("done")) == engine.stats["finished"]
    assert engine.pool.view().violations(engine.live_sequences) == []


class ExplodingSink:
    def on_lookup(self, lookup: object) -> None:
        raise RuntimeError("sink bug")

    on_store = on_free = on_request_done = on_lookup


def test_sink_exceptions_never_reach_the_engine() -> None:
    _, clean_results = clean_small()
    engine = ReferenceEngine(EngineConfig(num_blocks=64), sink=ExplodingSink())  # type: ignore[arg-type]
    results = drive(engine, ChatWorkload(WorkloadConfig(conversations=20, max_turns=5)))
    assert [r.output_tokens for r in results] == [r.output_tokens for r in clean_results]
    assert engine.sink_errors["on_lookup"] == len(results)
    assert engine.sink_errors["on_store"] > 0 and engine.sink_errors["on_request_done"] > 0


def test_allocation_failure_waits_for_a_release_then_rejects_the_impossible() -> None:
    engine = ReferenceEngine(EngineConfig(num_blocks=4, block_size=16, max_running=2))
    # 40 prompt tokens + 7 fed-back outputs = 47 KV slots = 3 blocks each; the pool has 4.
    fits = [Request([base + i for i in range(40)], max_new_tokens=8) for base in (1, 101)]
    too_big = Request(list(range(70)), max_new_tokens=8)  # 5 blocks > pool: never fits
    results = engine.run([*fits, too_big])
    assert [r.rejected for r in results] == [False, False, True]
    assert engine.pool.allocation_failures == 1  # the second one, once, while the first ran
    assert engine.stats["rejected"] == 1 and engine.pool.evictions == 1
    again = engine.run([fits[1]])[0]  # the waiter's blocks were cached when it finished
    assert again.hit_tokens == 32


def test_default_workload_hit_rate_and_determinism() -> None:
    engine = ReferenceEngine()
    results = drive(engine, ChatWorkload())
    assert token_hit_rate(results) >= 0.7
    assert abs(engine.hit_rate() - token_hit_rate(results)) < 1e-12
    assert not any(r.rejected for r in results)
    wl = WorkloadConfig()
    assert sum((r.prompt_tokens + wl.max_new_tokens - 1) % 16 == 0 for r in results) >= 20
    assert sum(r.prompt_tokens % 16 == 0 for r in results) >= 5
    adapters = {r.request.key_fields["adapter"] for r in results}
    assert adapters == {"", "support-v2", "legal-v1"}
    again = ChatWorkload()
    first = again.next_request()
    assert first is not None and first.tokens == results[0].request.tokens[: len(first.tokens)]


def test_adapter_describe_read_recompute_allocator() -> None:
    sink = RecordingSink()
    engine = ReferenceEngine(EngineConfig(num_blocks=64), sink=sink)
    adapter = ReferenceAdapter(engine)
    assert isinstance(adapter, Adapter)
    info = adapter.describe()
    assert (info.engine, info.dtype, info.block_size, info.num_kv_heads, info.head_dim) == (
        "reference", "float32", 16, 2, 16)
    assert info.key_fields == ("model_revision", "adapter", "cache_salt")
    assert [g.kind for g in info.groups] == [GroupKind.FULL_ATTENTION]
    assert info.groups[0].layers == (0, 1)
    prompt = list(range(100, 150))
    engine.serve(Request(prompt, {"adapter": "legal-v1"}, 4))
    hit = engine.run([Request(prompt + [7], {"adapter": "legal-v1"}, 4)])[0]
    assert hit.hit_tokens == 48
    lookup = sink.of("lookup")[-1]
    refs = [BlockRef(0, i, b) for i, b in enumerate(lookup.hit.blocks[0])]
    cached = adapter.read(lookup.hit, refs)
    ref_kv = adapter.recompute(lookup.hit, refs)
    for c, r in zip(cached, ref_kv, strict=True):
        assert c.key.shape == (2, 2, 16, 16) == r.key.shape
        assert c.generation == engine.pool.blocks[c.ref.block_id].generation
        assert torch.allclose(c.key, r.key, atol=1e-5) and torch.allclose(c.value, r.value,
                                                                           atol=1e-5)
    # Recompute follows the hit's own key fields: another adapter is other KV.
    other = Hit(lookup.hit.tokens, lookup.hit.hit_tokens, lookup.hit.blocks,
                key_fields={**lookup.hit.key_fields, "adapter": ""})
    assert not torch.allclose(adapter.recompute(other, refs[:1])[0].key, ref_kv[0].key)
    with pytest.raises(AdapterError):
        adapter.recompute(Hit(prompt, 48, {0: [0]}, key_fields={"model_revision": "r2"}),
                          refs[:1])
    with pytest.raises(AdapterError):
        adapter.read(lookup.hit, [BlockRef(1, 0, 0)])
    state = adapter.allocator()
    assert state.total_blocks == 64 and state.used_blocks == 0
    assert state.free_blocks + state.cached_blocks == 64
    assert state.allocations == 2 and state.allocation_failures == 0
    assert state.largest_free_run == state.free_blocks  # paged: every free block is usable


def test_adapter_is_safe_while_the_engine_runs_in_another_thread() -> None:
    sink = RecordingSink()
    engine = ReferenceEngine(EngineConfig(num_blocks=32), sink=sink)
    adapter = ReferenceAdapter(engine)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            drive(engine, ChatWorkload(WorkloadConfig(conversations=10, max_turns=4)))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=serve)
    worker.start()
    checked = 0
    while worker.is_alive() or checked == 0:
        lookups = [e for e in sink.of("lookup") if e.hit is not None]
        state = adapter.allocator()
        assert state.free_blocks + state.cached_blocks + state.used_blocks == 32
        assert state.allocated_slots >= state.filled_slots
        if lookups:
            hit = lookups[-1].hit
            refs = [BlockRef(0, len(hit.blocks[0]) - 1, hit.blocks[0][-1])]
            kv = adapter.read(hit, refs)[0]
            assert kv.key.shape == adapter.recompute(hit, refs)[0].key.shape
            checked += 1
        if not worker.is_alive() and not lookups:
            break
        time.sleep(0.002)  # let the engine thread have the GIL
    worker.join()
    assert not errors and checked > 0
