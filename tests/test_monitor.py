"""The Monitor's control flow: counting, sampling, the queue, adapter failures, time limits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sidecar import signals as S
from sidecar.core.protocol import Hit, Lookup
from tests.conftest import make_toy

PROMPT = list(range(1, 17))  # 4 full blocks of 4


def test_counts_lookups_hits_and_tokens(toy):
    engine, _, mon = toy
    engine.serve(PROMPT)          # miss: stores 4 blocks
    engine.serve(PROMPT + [99])   # hit: 16 of 17 tokens
    m = mon.metrics
    assert m.value(S.LOOKUPS.name) == 2
    assert m.value(S.HITS.name) == 1
    assert m.value(S.QUERY_TOKENS.name) == 16 + 17
    assert m.value(S.HIT_TOKENS.name) == 16
    s = mon.summary()
    assert s["hit_rate"] == 0.5 and s["token_hit_rate"] == pytest.approx(16 / 33)


def test_clean_hits_verify_without_anomalies(toy):
    engine, _, mon = toy
    mon.start()
    engine.serve(PROMPT)
    for t in range(10):
        engine.serve(PROMPT + [100 + t])
    assert mon.drain(10)
    s = mon.summary()
    assert s["verified"] == 20  # 10 hits x 2 blocks (the last one always included)
    assert s["anomalies"] == {}
    assert mon.metrics.value(S.LAST_VERIFICATION.name) > 0


def test_sampling_one_in_n_is_exact():
    engine, _, mon = make_toy(sample_every=5)
    engine.serve(PROMPT)
    for t in range(50):
        engine.serve(PROMPT + [t])
    assert mon.metrics.value(S.SAMPLED.name) == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_block_is_flagged_in_every_dtype(dtype):
    engine, _, mon = make_toy(dtype=dtype)
    engine.serve(PROMPT)
    last = engine.index[tuple(PROMPT)]
    engine.kv[last][0].zero_()
    engine.kv[last][1].zero_()
    hit = engine.serve(PROMPT + [7])
    verdict = mon.verify(hit)
    assert S.AnomalyKind.ZEROS in verdict.kinds()
    assert mon.summary()["anomalies"] == {"zeros": 1}


def test_corruption_below_content_checks_is_caught_by_recompute(toy):
    engine, _, mon = toy
    engine.serve(PROMPT)
    last = engine.index[tuple(PROMPT)]
    engine.kv[last][0][0, 0, 0, :] += 3.0   # one row changed, nothing zero or NaN
    verdict = mon.verify(engine.serve(PROMPT + [7]))
    assert verdict.kinds() == {S.AnomalyKind.RECOMPUTE_MISMATCH}


def test_queue_overflow_drops_and_counts_never_blocks():
    engine, adapter, mon = make_toy(queue_size=2)
    adapter.hang["read"] = threading.Event()  # the worker gets stuck on its first sample
    mon.start()
    engine.serve(PROMPT)
    for t in range(10):
        engine.serve(PROMPT + [t])  # returns immediately even though the worker is stuck
    dropped = mon.metrics.value(S.SAMPLES_DROPPED.name, reason="queue_full")
    assert dropped >= 10 - 2 - 1
    adapter.hang["read"].set()
    mon.drain(10)
    mon.stop()


def test_adapter_that_raises_is_counted_and_engine_keeps_serving(toy):
    engine, adapter, mon = toy
    adapter.fail["read"] = RuntimeError("engine exploded")
    mon.start()
    engine.serve(PROMPT)
    for t in range(5):
        engine.serve(PROMPT + [t])
    assert mon.drain(10)
    m = mon.metrics
    assert m.value(S.ADAPTER_ERRORS.name, op="read", reason="error") == 5
    assert m.value(S.SAMPLES_DROPPED.name, reason="adapter_error") == 5  # samples, not blocks
    assert m.value(S.LOOKUPS.name) == 6
    assert mon.summary()["verified"] == 0


def test_adapter_that_hangs_times_out_and_worker_moves_on():
    engine, adapter, mon = make_toy(adapter_timeout_s=0.2)
    adapter.hang["recompute"] = threading.Event()
    mon.start()
    engine.serve(PROMPT)
    engine.serve(PROMPT + [1])
    engine.serve(PROMPT + [2])
    assert mon.drain(10)
    assert mon.metrics.value(S.ADAPTER_ERRORS.name, op="recompute", reason="timeout") >= 1
    assert mon.metrics.value(S.SAMPLES_DROPPED.name, reason="adapter_timeout") >= 2
    adapter.hang["recompute"].set()
    mon.stop()


def test_hooks_never_raise_into_the_engine(toy):
    _, _, mon = toy
    bad = Hit(tokens=None, hit_tokens=8, blocks={0: "not-a-list"})  # type: ignore[arg-type]
    mon.on_lookup(Lookup(query_tokens=None, hit_tokens=8, hit=bad))  # type: ignore[arg-type]
    mon.on_store(None)  # type: ignore[arg-type]
    mon.on_free(0, None)  # type: ignore[arg-type]
    mon.on_request_done("slow")  # type: ignore[arg-type]
    # Caught at the door (sidecar/core/hook_input.py): counted as rejected input, not applied.
    for hook in ("on_lookup", "on_store", "on_free", "on_request_done"):
        assert mon.metrics.value(S.HOOK_INPUT_REJECTED.name, hook=hook, reason="type") == 1


def test_key_fields_differing_from_store_are_flagged(toy):
    engine, _, mon = toy
    engine.serve(PROMPT, {"adapter": "a"})
    # An engine whose key omits 'adapter' would serve this hit from adapter a's blocks.
    hit = engine.serve(PROMPT + [5], {"adapter": "b"})
    verdict = mon.verify(hit)
    assert S.AnomalyKind.KEY_FIELDS_MISMATCH in verdict.kinds()


def test_reused_block_generation_is_flagged(toy):
    engine, _, mon = toy
    engine.serve(PROMPT)
    last = engine.index[tuple(PROMPT)]
    engine.gen[last] += 1  # handed out again while still indexed
    verdict = mon.verify(engine.serve(PROMPT + [5]))
    assert S.AnomalyKind.STALE_GENERATION in verdict.kinds()


def test_block_reused_after_match_is_dropped_not_flagged(toy):
    engine, _, mon = toy
    engine.serve(PROMPT)
    hit = engine.serve(PROMPT + [5])
    for b in hit.blocks[0]:  # legitimately evicted and reallocated before the sidecar read
        engine.gen[b] += 1
    # the hit carries match-time generations; the store record agrees with them
    verdict = mon.verify(hit)
    assert verdict.findings == []
    assert verdict.dropped[S.DropReason.EVICTED_BEFORE_READ] == 1  # one sample dropped


def test_stop_counts_queued_samples_as_dropped():
    engine, adapter, mon = make_toy(adapter_timeout_s=0.5)
    adapter.hang["read"] = threading.Event()
    mon.start()
    engine.serve(PROMPT)
    for t in range(4):
        engine.serve(PROMPT + [t])
    deadline = time.monotonic() + 60  # bounds a hang only
    while mon.dispatcher.queued > 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # until the worker holds the first sample
    mon.stop(timeout_s=0.1)  # the worker is stuck in read(); 3 samples still queued
    assert mon.metrics.value(S.SAMPLES_DROPPED.name, reason="shutdown") == 3
    adapter.hang["read"].set()


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="sample_every"):
        make_toy(sample_every=0)


def test_unknown_allocator_fields_are_absent_not_zero():
    """An engine that cannot say how many blocks are cached, or count its allocations,
    gets no series for them: unknown is never exported as a measured 0."""
    from sidecar.core.protocol import AllocatorState
    from sidecar.export.metrics import Metrics

    m = Metrics("e", "m")
    m.allocator.update(AllocatorState(total_blocks=10, free_blocks=4, used_blocks=6))
    value = m.registry.get_sample_value
    base = {"engine": "e", "model": "m"}
    assert value("kvsidecar_blocks", {**base, "state": "used"}) == 6
    assert value("kvsidecar_blocks", {**base, "state": "cached"}) is None
    assert value("kvsidecar_allocations_total", base) is None
    assert value("kvsidecar_usage_ratio", base) == 0.6
    assert value("kvsidecar_fragmentation_ratio", base) is None  # no largest_free_run
    assert value("kvsidecar_internal_fragmentation_ratio", base) is None


def test_guarded_adapter_code_is_counted_never_raised():
    """An adapter's own translation code, guarded: its exceptions are counted under the
    name it chose and the call returns None, so nothing reaches the engine."""
    _, _, mon = make_toy()
    calls = []

    @mon.guarded("toy_translate")
    def translate(x: int) -> int:
        calls.append(x)
        if x < 0:
            raise ValueError("bad engine value")
        return 2 * x

    assert mon.metrics.value(S.HOOK_ERRORS.name, hook="toy_translate") == 0  # a zero series
    assert translate(3) == 6
    assert translate(-1) is None
    assert translate(-2) is None
    assert calls == [3, -1, -2]
    assert mon.metrics.value(S.HOOK_ERRORS.name, hook="toy_translate") == 2
    assert mon.metrics.value(S.HOOK_ERRORS.name, hook="on_store") == 0  # created at start


def test_an_adapter_registers_its_own_signals():
    """The core's signals are engine-agnostic; the vLLM adapter's appear only on a sidecar
    where a vLLM component attached them (here: the metrics bridge)."""
    from sidecar.adapters.vllm.metrics_bridge import VllmMetricsBridge
    from sidecar.export.metrics import Metrics

    m = Metrics("vllm", "m")
    assert S.KV_EVENTS.name not in m.instruments.families
    with pytest.raises(KeyError, match="not registered"):
        m.inc(S.ENGINE_SCRAPE_ERRORS)
    VllmMetricsBridge(m, lambda: "", block_size=16)
    m.inc(S.ENGINE_SCRAPE_ERRORS)
    assert m.value(S.ENGINE_SCRAPE_ERRORS.name) == 1
    assert {s.name for s in S.VLLM_SIGNALS} <= set(m.instruments.families)
