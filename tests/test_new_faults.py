"""Fault classes of 2026 reports added to the reference engines (issue 23 item 5): each
injects what it claims, the sidecar flags it with the right kind, and clean stays quiet.
The hybrid ones also run in tests/test_engine_hybrid.py's per-fault checks."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.bench.harness import Scenario, run_scenario
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request, Result
from kvtestbed.engines.faults import FAULTS, make_fault
from kvtestbed.engines.hybrid_faults import fault_applies

from sidecar.allocator import HitCounterAudit
from sidecar.signals import InvariantKind


def test_recurrent_double_apply_shifts_the_conv_window_at_an_exact_multiple_only() -> None:
    fault = make_fault("recurrent-double-apply", start_after=0)
    assert FAULTS["recurrent-double-apply"].corrupts_kv
    assert fault_applies("recurrent-double-apply", "recurrent")
    assert not fault_applies("recurrent-double-apply", "hybrid")
    engine = SimpleNamespace(block_size=4, table=lambda seq, g: [10, 11, 12])
    state = torch.arange(24.0).view(2, 3, 4)  # (layers, channels, conv window)
    exact = SimpleNamespace(seq_id=1, prompt_len=8)
    out = fault.state_to_store(engine, exact, 1, state, None)  # boundary at token 8
    assert torch.equal(out[..., :3], state[..., 1:]) and torch.equal(out[..., 3], state[..., 3])
    assert [i.block_id for i in fault.injections] == [11]
    assert fault.state_to_store(engine, exact, 0, state, None) is state  # not the prompt end
    ragged = SimpleNamespace(seq_id=2, prompt_len=9)
    assert fault.state_to_store(engine, ragged, 1, state, None) is state
    assert len(fault.injections) == 1


# ---------------------------------------------------------------------- recurrent-splice-skip
class _StatePool:
    """A recurrent group's index: boundary hash -> block (what ``pool.find`` answers)."""

    def __init__(self, found: dict[bytes, int]) -> None:
        self.found = found

    def find(self, block_hash: bytes) -> int | None:
        return self.found.get(block_hash)


def test_recurrent_splice_skip_serves_a_shorter_prefix_state_at_the_hit_boundary() -> None:
    fault = make_fault("recurrent-splice-skip", start_after=0, probability=1.0)
    assert FAULTS["recurrent-splice-skip"].corrupts_kv
    assert fault_applies("recurrent-splice-skip", "recurrent")
    assert not fault_applies("recurrent-splice-skip", "hybrid")
    assert not fault_applies("recurrent-splice-skip", "reference")
    swaps: list[tuple[int, int, int]] = []
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    engine = SimpleNamespace(pools={1: _StatePool({b"h0": 7, b"h1": 8, b"h3": 9})},
                             null_block=lambda g: 0,
                             swap=lambda seq, g, i, b: swaps.append((g, i, b)))
    seq = SimpleNamespace(seq_id=3, block_hashes=hashes)
    fault.on_hybrid_hit(engine, seq, 4)
    # The hit's last boundary (#3) now maps to the state of boundary #0 or #1 (both
    # indexed), never to its own or to the missing #2.
    assert len(swaps) == 1 and swaps[0][:2] == (1, 3) and swaps[0][2] in (7, 8)
    assert "transitions skipped" in fault.injections[0].detail
    fault.on_hybrid_hit(engine, seq, 1)  # one block: no shorter prefix to splice in
    assert len(swaps) == 1
    dormant = make_fault("recurrent-splice-skip", start_after=10, probability=1.0)
    dormant.on_hybrid_hit(engine, seq, 4)
    assert len(swaps) == 1 and not dormant.injections


# ---------------------------------------------------------------------- namespace at the tier
def _tier_engine(fault: str) -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(num_blocks=8, cpu_offload_blocks=64, fault=fault,
                                        fault_start_after=0))


def _spill_then_ask(engine: ReferenceEngine, prompt: list[int]) -> Result:
    """``prompt`` served under an adapter, pushed out to the tier by other prompts, then
    asked for again with no adapter (another namespace)."""
    engine.serve(Request(prompt, {"adapter": "support-v2"}, max_new_tokens=1))
    for i in range(3):
        engine.serve(Request([(i * 97 + j) % 250 + 1 for j in range(49)], max_new_tokens=1))
    return engine.serve(Request(prompt, {}, max_new_tokens=1))


def test_namespace_missing_at_tier_loads_another_namespace_block_from_the_tier() -> None:
    fault = make_fault("namespace-missing-at-tier", start_after=0)
    assert FAULTS["namespace-missing-at-tier"].corrupts_kv
    assert FAULTS["namespace-missing-at-tier"].engine_needs == {"cpu_offload_blocks": 512}
    fields = (("model_revision", "r1"), ("adapter", "a"), ("cache_salt", "t"))
    assert fault.tier_key_fields(0, fields) == (("model_revision", "r1"), ("adapter", ""),
                                                ("cache_salt", ""))
    assert make_fault("namespace-missing-at-tier", start_after=5).tier_key_fields(
        4, fields) is None  # dormant: the tier keys on every field
    prompt = [(7 * j) % 240 + 3 for j in range(49)]  # three full blocks and one token
    clean = _spill_then_ask(_tier_engine("none"), prompt)
    assert clean.hit_tokens == 0  # the tier keeps the namespace: no other namespace's block
    engine = _tier_engine("namespace-missing-at-tier")
    broken = _spill_then_ask(engine, prompt)
    assert broken.hit_tokens == 48 and engine.tier is not None and engine.tier.loads >= 3
    assert engine.fault.injections and all(
        "support-v2" in i.detail for i in engine.fault.injections)


def test_namespace_missing_at_tier_is_caught_by_the_key_check_in_fp32_and_bf16() -> None:
    for dtype in ("float32", "bfloat16"):
        r = run_scenario(Scenario(fault="namespace-missing-at-tier", dtype=dtype,
                                  requests=160, num_blocks=64, calibration_samples=64))
        assert r.bad_verified > 0 and r.recall == 1.0 and r.false_alarm_blocks == 0, dtype
        assert "key_fields_mismatch" in r.kinds


# ---------------------------------------------------------------------- gauge-not-a-rate
def test_hit_counter_audit_passes_a_lagging_counter_and_flags_a_gauge() -> None:
    audit = HitCounterAudit()
    assert audit.observe(None, 100) == []  # no engine counter: nothing to check
    # A counter that lags by what is in flight (engine read first, then the sidecar's).
    for engine, sidecar in [(0, 0), (48, 64), (112, 112), (112, 160), (176, 176)]:
        assert audit.observe(engine, sidecar) == [], (engine, sidecar)
    went_down = audit.observe(32, 192)
    assert [v.kind for v in went_down] == [InvariantKind.HIT_COUNTER_MISMATCH]
    assert "went down from 176 to 32" in went_down[0].detail
    stuck = HitCounterAudit()
    found = [stuck.observe(0, n) for n in range(0, 1000, 100)]
    assert any(f and "grew by 0 tokens" in f[0].detail for f in found)
    assert stuck.mismatches >= 1


def test_gauge_not_a_rate_overwrites_the_hit_metric_per_batch_and_clean_counts() -> None:
    clean = ReferenceEngine(EngineConfig(num_blocks=32))
    faulty = ReferenceEngine(EngineConfig(num_blocks=32, fault="gauge-not-a-rate",
                                          fault_start_after=0))
    prompt = [(5 * j) % 250 + 1 for j in range(40)]
    for engine in (clean, faulty):
        for _ in range(3):
            engine.serve(Request(prompt, max_new_tokens=2))
    assert clean.hit_metric == clean.stats["hit_tokens"] == 64  # two hits of 32 tokens
    assert faulty.stats["hit_tokens"] == 64 and faulty.hit_metric == 0  # a new batch
    assert ReferenceAdapter(faulty).allocator().hit_tokens == 0
    assert not FAULTS["gauge-not-a-rate"].corrupts_kv


def test_gauge_not_a_rate_is_flagged_as_a_hit_counter_mismatch_and_clean_stays_quiet() -> None:
    r = run_scenario(Scenario(fault="gauge-not-a-rate", requests=60))
    assert r.injections and r.affected == 0 and r.false_alarm_blocks == 0
    assert set(r.kinds) == {InvariantKind.HIT_COUNTER_MISMATCH.value}
    assert r.requests_to_allocator_detection is not None
    assert r.requests_to_allocator_detection <= 5
    quiet = run_scenario(Scenario(fault="none", requests=60))
    assert not quiet.allocator_alarms and not quiet.kinds
