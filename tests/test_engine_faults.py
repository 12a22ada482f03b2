"""Fault injection: every fault is deterministic under a seed, dormant before start_after,
and really changes what the engine decodes over (or, for allocator faults, its accounting)."""

from __future__ import annotations

from functools import cache

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request, Result
from kvtestbed.engines.faults import FAULTS, Fault, describe_faults, make_fault
from kvtestbed.engines.hybrid_faults import fault_applies

from sidecar.core.protocol import BlockRef, Lookup
from tests.reference_helpers import RecordingSink, clean_small, outputs_by_tag, run_small

# Knobs that make a fault act often enough on the small workload to be seen in a test.
OVERRIDES: dict[str, dict[str, object]] = {
    "hash-collision": {"fault_params": {"buckets": 64}},
    "bit-flip": {"fault_probability": 1.0},
    # An fp8 round trip is a few percent per element: every block, to flip a greedy token.
    "storage-downcast": {"fault_probability": 1.0},
}
# The plain engine's faults (hybrid ones: tests/test_engine_hybrid.py).
CORRUPTING = sorted(name for name, cls in FAULTS.items()
                    if cls.corrupts_kv and fault_applies(name, "reference"))


def clean_outputs() -> dict[str, tuple[int, ...]]:
    return outputs_by_tag(clean_small()[1])


def run_fault(name: str, seed: int = 0) -> tuple[ReferenceEngine, list[Result]]:
    """A fresh run of the small workload with ``name``."""
    return run_small(name, seed, **OVERRIDES.get(name, {}))


# One shared run per fault for the tests that only inspect it (the determinism test
# makes its own second run).
shared_run = cache(run_fault)


def test_registry_lists_every_fault_with_a_description() -> None:
    listed = dict(describe_faults())
    assert set(listed) == set(FAULTS)
    required = {"none", "zero-block", "nonfinite", "boundary-off-by-one", "stale-reuse",
                "key-missing-field", "hash-collision"}
    assert required <= set(listed)
    for name, text in listed.items():
        assert text and "\n" not in text and FAULTS[name].name == name
    assert isinstance(make_fault("none"), Fault)
    with pytest.raises(ValueError, match="unknown fault"):
        make_fault("no-such-fault")
    with pytest.raises(ValueError):
        make_fault("zero-block", probability=1.5)


@pytest.mark.parametrize("name", CORRUPTING)
def test_fault_is_deterministic_dormant_early_and_changes_decoded_outputs(name: str) -> None:
    engine, results = shared_run(name)
    injections = engine.fault.injections
    assert injections, f"{name} never acted"
    assert min(i.request_index for i in injections) >= engine.fault.start_after == 20
    outputs = outputs_by_tag(results)
    clean = clean_outputs()
    early = [r.request.tag for r in results if r.request_index < 20]
    assert all(outputs[t] == clean[t] for t in early), "a dormant fault changed outputs"
    changed = [t for t, out in outputs.items() if clean.get(t) != out]
    assert changed, f"{name} did not change anything the model decoded"
    again_engine, again = run_fault(name)
    assert again_engine.fault.injections == injections
    assert outputs_by_tag(again) == outputs


def test_probabilistic_fault_follows_its_seed() -> None:
    a = shared_run("zero-block")[0].fault.injections
    b = run_fault("zero-block", seed=1)[0].fault.injections
    assert a and b and a != b


def test_zero_block_leaves_zeros_that_the_adapter_reads() -> None:
    engine, _ = run_small("zero-block", fault_start_after=0, fault_probability=1.0)
    adapter = ReferenceAdapter(engine)
    view = engine.pool.view()
    zeroed = [b for b in view.cached if view.block_hashes[b] is not None]
    assert zeroed
    kv = adapter.read(None, [BlockRef(0, 0, zeroed[0])])[0]  # type: ignore[arg-type]
    assert not kv.key.any() and not kv.value.any()


def test_key_missing_field_serves_another_adapters_kv() -> None:
    sink = RecordingSink()
    engine = ReferenceEngine(EngineConfig(fault="key-missing-field", fault_start_after=0),
                             sink=sink)
    adapter = ReferenceAdapter(engine)
    prompt = list(range(40))
    engine.serve(Request(prompt, {"adapter": ""}, max_new_tokens=2))
    result = engine.serve(Request(prompt + [1], {"adapter": "legal-v1"}, max_new_tokens=2))
    assert result.hit_tokens == 32  # a clean key would have missed
    hit = [e for e in sink.of("lookup") if isinstance(e, Lookup) and e.hit][-1].hit
    assert hit is not None
    ref = [BlockRef(0, 1, hit.blocks[0][1])]
    cached, recomputed = adapter.read(hit, ref)[0], adapter.recompute(hit, ref)[0]
    assert (cached.key - recomputed.key).abs().max() > 0.1


def test_boundary_off_by_one_frees_an_indexed_block() -> None:
    engine, _ = shared_run("boundary-off-by-one")
    problems = " ".join(engine.pool.view().violations(engine.live_sequences))
    assert "reused while indexed" in problems or "free but still indexed" in problems


def test_premature_free_breaks_reference_accounting() -> None:
    engine, _ = shared_run("premature-free")
    problems = engine.pool.view().violations(engine.live_sequences)
    assert any("holders" in p for p in problems)


def test_leak_exhausts_the_pool() -> None:
    engine, results = run_fault("leak")
    clean_engine, _ = clean_small()
    view = engine.pool.view()
    assert any("finished sequences" in p for p in view.violations(engine.live_sequences))
    assert view.allocation_failures > 0 and any(r.rejected for r in results)
    assert clean_engine.pool.allocation_failures == 0
    # The clean engine ends with every block free or evictable; the leaky one cannot.
    assert len(view.free) + len(view.cached) < view.num_blocks


def test_fragmentation_fails_allocations_while_blocks_are_free() -> None:
    engine, _ = run_small("fragmentation")
    state = ReferenceAdapter(engine).allocator()
    assert state.allocation_failures > 0
    assert engine.pool.contiguous and state.largest_free_run < state.free_blocks
