"""The reference engine's hybrid models (testbed/kvtestbed/engines/hybrid_*.py): per-group
pools and block tables, the hybrid intersection, null blocks out of the window, recurrent
state at block boundaries against a fresh HF prefill, and each hybrid fault injecting what
it claims (ground truth, and the adapter's read vs recompute)."""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import pytest
import torch
from kvtestbed.adapters.hybrid_adapter import HybridReferenceAdapter, make_adapter
from kvtestbed.engines.config import EngineConfig
from kvtestbed.engines.faults import FAULTS
from kvtestbed.engines.hybrid_engine import NULL_BLOCK, HybridEngine
from kvtestbed.engines.hybrid_faults import fault_applies
from kvtestbed.engines.hybrid_model import model_config
from kvtestbed.engines.sequence import Request
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from transformers import DynamicCache

from sidecar.adapters.hf_cache import cache_argument
from sidecar.checks.group_coverage import required_blocks
from sidecar.checks.recompute import block_error
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockRef, GroupKind, Hit, Lookup, StoredBlock
from tests.limits import DETECTION_TIMEOUT_S

BS = 16
HYBRID_FAULTS = sorted(n for n, cls in FAULTS.items() if cls.needs_groups)


class Recorder:
    """The engine's sink: keeps every hit, store and free (and, with a monitor, forwards)."""

    def __init__(self, monitor: Monitor | None = None) -> None:
        self.monitor = monitor
        self.hits: list[Hit] = []
        self.truth: list[tuple[list[Any], list[Any]]] = []
        self.stores: list[StoredBlock] = []
        self.engine: HybridEngine | None = None
        self.verify_affected = False
        self.flagged: list[set[tuple[int, int]]] = []  # per affected hit, when verified

    def on_lookup(self, lookup: Lookup) -> None:
        if self.monitor is not None:
            self.monitor.on_lookup(lookup)
        if lookup.hit is not None:
            self.hits.append(lookup.hit)
            truth = self.engine.truth if self.engine is not None else None
            self.truth.append(truth.classify(lookup.hit) if truth is not None else ([], []))
            if self.verify_affected and self.monitor is not None and self.truth[-1][0]:
                verdict = self.monitor.verify(lookup.hit)  # now, while the blocks are intact
                self.flagged.append({(f.group_id, f.block_index) for f in verdict.findings})

    def on_store(self, block: StoredBlock) -> None:
        self.stores.append(block)
        if self.monitor is not None:
            self.monitor.on_store(block)

    def on_free(self, group_id: int, block_ids: Any) -> None:
        if self.monitor is not None:
            self.monitor.on_free(group_id, block_ids)

    def on_request_done(self, latency_seconds: float) -> None:
        if self.monitor is not None:
            self.monitor.on_request_done(latency_seconds)


def engine_for(model: str, dtype: str = "float32", **kw: Any) -> HybridEngine:
    return HybridEngine(EngineConfig(model=model_config(model, dtype), model_kind=model,
                                     block_size=BS, **kw))


def run(model: str, fault: str = "none", requests: int = 40, dtype: str = "float32",
        **kw: Any) -> tuple[HybridEngine, Recorder]:
    engine = engine_for(model, dtype, fault=fault, track_truth=True, fault_start_after=4, **kw)
    # The sidecar attached as it is today: every block of every hit chosen, verified at
    # lookup for the hits the ground truth calls affected.
    monitor = Monitor(make_adapter(engine),  # type: ignore[arg-type]
                      SidecarConfig(sample_every=1 << 30, blocks_per_sample=1 << 20,
                                    recompute_tokens_per_s=0, adapter_timeout_s=DETECTION_TIMEOUT_S,
                                    allocator_check_min_interval_s=-1))
    rec = Recorder(monitor)
    rec.verify_affected = fault != "none"
    rec.engine = engine
    engine.sink = rec
    workload = ChatWorkload(WorkloadConfig(seed=0, conversations=requests, block_size=BS))
    drive(engine, workload, max_requests=requests)
    return engine, rec


@cache
def clean(model: str) -> tuple[HybridEngine, Recorder]:
    return run(model)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# ---------------------------------------------------------------------- groups and hits
@pytest.mark.parametrize("model", ["hybrid", "recurrent"])
def test_clean_run_hits_every_group_with_null_blocks_only_outside_coverage(model: str) -> None:
    engine, rec = clean(model)
    info = HybridReferenceAdapter(engine).describe()
    assert [g.kind for g in info.groups] == [
        GroupKind.FULL_ATTENTION,
        GroupKind.SLIDING_WINDOW if model == "hybrid" else GroupKind.RECURRENT_STATE]
    other = info.groups[1]
    assert other.null_block_ids == frozenset({NULL_BLOCK})
    assert set(other.layers) | set(info.groups[0].layers) == set(range(4))
    assert len(rec.hits) > 20 and all(not c and not t for c, t in rec.truth)
    saw_null = False
    for hit in rec.hits:
        n = hit.hit_tokens // BS
        assert len(hit.blocks[0]) == len(hit.blocks[1]) == n
        assert NULL_BLOCK not in hit.blocks[0] or engine.pools[0].blocks[NULL_BLOCK].block_hash
        req = required_blocks(other, hit.hit_tokens, BS)
        for i, b in enumerate(hit.blocks[1]):
            assert (b != NULL_BLOCK) == (i in req), (i, req, hit.blocks[1])
        saw_null = saw_null or req.start > 0
    assert saw_null  # prompts longer than the window / than one boundary
    stats = engine.group_stats
    assert all(c["hits"] > 0 and c["blocks"] > 0 for c in stats.values())
    assert stats[other.label]["null_blocks"] > 0 and stats["full"]["null_blocks"] == 0


def test_hit_is_the_intersection_of_what_every_group_can_serve() -> None:
    engine = engine_for("hybrid")
    p = prompt(160)
    engine.serve(Request(p[:120], max_new_tokens=1))
    # Drop the sliding group's block 5 from its index: the full group still has blocks
    # 0..6, but a 7- or 6-block hit needs sliding block 5; a 5-block hit needs 3 and 4.
    rec = Recorder()
    engine.sink = rec
    full_before = len(engine.pools[0].lookup(_hashes(engine, p)))
    b5 = engine.pools[1].find(_hashes(engine, p)[5])
    assert b5 is not None and engine.pools[1].uncache(b5)
    engine.serve(Request(p, max_new_tokens=1))
    hit = rec.hits[-1]
    assert full_before == 7 and hit.hit_tokens == 5 * BS
    assert list(hit.blocks[1][:3]) == [NULL_BLOCK] * 3 and NULL_BLOCK not in hit.blocks[1][3:]


def _hashes(engine: HybridEngine, tokens: list[int]) -> list[Any]:
    out: list[Any] = []
    engine._chain(0, tokens, engine.key_fields(Request(tokens)), (len(tokens) - 1) // BS, out)
    return out


# ---------------------------------------------------------------------- against HF
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_recurrent_state_at_each_boundary_equals_a_fresh_hf_prefill(dtype: str,
                                                                    tol: float) -> None:
    engine = engine_for("recurrent", dtype)
    rec = Recorder()
    engine.sink = rec
    p = prompt(90, seed=3)
    engine.serve(Request(p[:70], max_new_tokens=4))
    engine.serve(Request(p, max_new_tokens=4))  # a hit: prefill starts from a stored state
    assert rec.hits and rec.hits[-1].hit_tokens == 64
    hf = engine.model.model
    conv_layers = engine.groups[1].layers
    stored = [s for s in rec.stores if s.group_id == 1]
    assert len(stored) >= 5
    for s in stored:
        end = s.prefix_tokens + BS
        tokens = (p[:70] if s.seq_id == 0 else p)[:end]
        with torch.inference_mode():
            cache_ = DynamicCache(config=hf.config)
            hf(input_ids=torch.tensor([tokens]), use_cache=True, **{cache_argument(hf): cache_})
        want = torch.stack([cache_.layers[i].conv_states[0][0] for i in conv_layers])
        got = engine.pools[1].key[:, s.block_id, :, :, 0]
        assert got.shape == want.shape == (2, 64, 3)
        err = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert err <= tol * max(scale, 1.0), (s.prefix_tokens, err)


def test_hybrid_blocks_equal_hf_kv_in_window_and_adapter_reads_null_as_is() -> None:
    engine = engine_for("hybrid")
    rec = Recorder()
    engine.sink = rec
    p = prompt(130, seed=5)
    engine.serve(Request(p[:100], max_new_tokens=2))
    engine.serve(Request(p, max_new_tokens=2))
    hit = rec.hits[-1]
    with torch.inference_mode():
        out = engine.model.model(input_ids=torch.tensor([p[:hit.hit_tokens]]), use_cache=True,
                                 **{cache_argument(engine.model.model): DynamicCache()})
    kv = out.past_key_values
    adapter = HybridReferenceAdapter(engine)
    for g, group in enumerate(engine.groups):
        for i, b in enumerate(hit.blocks[g]):
            block = adapter.read(hit, [BlockRef(g, i, int(b))])[0]
            if g and b == NULL_BLOCK:  # read as is, no error: zeros
                assert not block.key.any() and not block.value.any()
                continue
            want = torch.stack([kv.layers[layer].keys[0, :, i * BS:(i + 1) * BS]
                                for layer in group.layers])
            assert (block.key - want).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------- sidecar attached
class EveryBlockSampler:
    """Every hit, every full block of every group, null ones included (a careless sampler,
    or another engine's probe choosing blocks itself)."""

    def should_sample(self, hit: Hit) -> bool:
        return True

    def choose(self, hit: Hit, block_size: int, max_blocks: int,
               groups: Any = ()) -> list[BlockRef]:
        n = hit.hit_tokens // block_size
        return [BlockRef(g, i, int(ids[i])) for g, ids in sorted(hit.blocks.items())
                for i in range(min(n, len(ids)))]

    def feedback(self, hit: Hit, anomalous: bool) -> None:
        return None


def test_correct_hybrid_cache_with_evicted_window_positions_is_not_flagged() -> None:
    engine = engine_for("hybrid", track_truth=True)
    # The production block choice (every block the groups must cover: blocks_per_sample
    # large), not a test sampler: out-of-window positions are never asked about.
    monitor = Monitor(make_adapter(engine),  # type: ignore[arg-type]
                      SidecarConfig(sample_every=1, recompute_tokens_per_s=0,
                                    blocks_per_sample=10_000, adapter_timeout_s=DETECTION_TIMEOUT_S,
                                    allocator_check_min_interval_s=-1))
    verdicts = []
    rec = Recorder(monitor)
    rec.engine = engine
    engine.sink = rec
    workload = ChatWorkload(WorkloadConfig(seed=1, conversations=30, block_size=BS))
    drive(engine, workload, max_requests=30)
    for hit in rec.hits:
        verdicts.append(monitor.verify(hit))
    verified = [(r.group_id, r.index) for v in verdicts for r in v.verified]
    assert {g for g, _ in verified} == {0, 1} and len(verified) > 200
    assert not [f for v in verdicts for f in v.findings]
    assert any(NULL_BLOCK in hit.blocks[1] for hit in rec.hits)
    assert not [r for v in verdicts for r in v.verified
                if r.group_id == 1 and r.block_id == NULL_BLOCK]
    # A sampler that does ask about every position (null ones included) gets the same
    # answer: the verifier never reads a null block as KV.
    asked = Monitor(make_adapter(engine), SidecarConfig(  # type: ignore[arg-type]
        sample_every=1, recompute_tokens_per_s=0, allocator_check_min_interval_s=-1,
        adapter_timeout_s=DETECTION_TIMEOUT_S), sampler=EveryBlockSampler())
    assert not [f for hit in rec.hits[-10:] for f in asked.verify(hit).findings]


# ---------------------------------------------------------------------- faults
def _cases() -> list[tuple[str, str]]:
    return [(f, m) for f in HYBRID_FAULTS for m in ("hybrid", "recurrent")
            if fault_applies(f, m)]


def test_hybrid_faults_apply_only_where_their_groups_are() -> None:
    assert set(HYBRID_FAULTS) == {"window-mismatch", "missing-group-state",
                                  "stale-recurrent-state", "null-block-read",
                                  "evicted-between-match-and-read", "group-layout-mismatch",
                                  "recurrent-double-apply", "recurrent-splice-skip"}
    assert not any(fault_applies(f, "reference") for f in HYBRID_FAULTS)
    assert not fault_applies("window-mismatch", "recurrent")
    assert not fault_applies("stale-recurrent-state", "hybrid")
    assert not fault_applies("zero-block", "hybrid")
    with pytest.raises(ValueError, match="does not apply"):
        engine_for("recurrent", fault="window-mismatch")
    with pytest.raises(ValueError, match="model dtype"):
        engine_for("hybrid", kv_storage="int8")


@pytest.mark.parametrize("fault,model", _cases())
def test_hybrid_fault_injects_what_it_claims(fault: str, model: str) -> None:
    engine, rec = run(model, fault, requests=30, fault_probability=1.0)
    assert engine.fault.injections, f"{fault} never acted on {model}"
    affected = [(h, c, t) for h, (c, t) in zip(rec.hits, rec.truth, strict=True) if c]
    assert affected
    # Ground truth says group 1 (and only group 1) was served wrong state...
    assert all(g == 1 for _, c, _ in affected for g, _ in c)
    adapter = HybridReferenceAdapter(engine)
    clean_runs = clean(model)[1]
    assert all(not c for c, _ in clean_runs.truth)
    # ...and the adapter sees it: what group 1 holds for the hit is far from a fresh
    # recompute (or is the null block), while group 0 matches. Checked on the last hit of
    # each affected kind still intact in the pool (later requests may reuse blocks).
    hit, corrupt, tainted = affected[-1]
    refs = [BlockRef(g, i, int(hit.blocks[g][i])) for g, i in corrupt]
    # Full-group blocks the truth calls right (not computed over a wrong state earlier:
    # right bytes, wrong past, "tainted").
    refs0 = [BlockRef(0, i, int(b)) for i, b in enumerate(hit.blocks[0]) if (0, i) not in tainted]
    with engine.lock:
        got = adapter.read(hit, refs + refs0)
    want = adapter.recompute(hit, refs + refs0)
    errors = [block_error(a, b) for a, b in zip(got, want, strict=True)]
    n = len(refs)
    assert max(errors[n:], default=0.0) < 1e-4  # the full group is right
    assert min(errors[:n]) > 1e-2 or any(r.block_id == NULL_BLOCK for r in refs)
    _fault_specific(fault, engine, rec, hit, corrupt)
    # The verifier flags a wrong group-1 block of every affected hit (the kind each fault
    # is named with is asserted over the detection benchmark's rows).
    assert len(rec.flagged) == len(affected)
    for flagged, (_, bad, _) in zip(rec.flagged, affected, strict=True):
        assert flagged & set(bad), (bad, flagged)


def _fault_specific(fault: str, engine: HybridEngine, rec: Recorder, hit: Hit,
                    corrupt: list[tuple[int, int]]) -> None:
    details = " ".join(i.detail for i in engine.fault.injections)
    if fault == "null-block-read":
        assert any(hit.blocks[1][i] == NULL_BLOCK for _, i in corrupt)
    elif fault == "window-mismatch":
        assert "hold blocks" in details
        stored = {(s.group_id, s.block_id): s.prefix_tokens for s in rec.stores}
        i = corrupt[0][1]
        assert stored.get((1, int(hit.blocks[1][i]))) == (i - 1) * BS  # the block before
    elif fault == "missing-group-state":
        assert "fresh block" in details
    elif fault == "evicted-between-match-and-read":
        assert "evicted and rewritten" in details
    elif fault == "stale-recurrent-state":
        assert "state of boundary" in details
    elif fault == "group-layout-mismatch":
        assert "transposed" in details
    elif fault == "recurrent-double-apply":
        assert "applied twice" in details
    elif fault == "recurrent-splice-skip":
        assert "transitions skipped" in details


def test_bench_detection_runs_hybrid_faults_on_the_models_that_have_their_groups(
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from sidecar.cli.main import main
    assert main(["bench", "detection", "--json", "--quiet", "--model", "reference", "hybrid",
                 "--faults", "null-block-read", "--dtype", "float32", "--requests", "30",
                 "--sample-every", "1", "--clean-samples", "0", "--policy-seeds", "0",
                 "--jobs", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["faults"]
    assert [(r["model"], r["fault"]) for r in rows] == [("hybrid", "null-block-read")]
    r = rows[0]
    assert r["injections"] and r["bad_verified"] > 0 and r["detected"] == r["bad_verified"]
    # Named from the block table alone: the null block is never read as KV (no "zeros").
    assert set(r["kinds"]) == {"null_block_read"}
    assert report["settings"]["models"] == ["reference", "hybrid"]


# ---------------------------------------------------------------------- demo and CLI
@pytest.mark.parametrize("model", ["hybrid", "recurrent"])
def test_demo_json_shows_hits_in_every_group_and_no_anomaly(model: str) -> None:
    from kvtestbed.demo import DemoOptions, run_demo
    s = run_demo(DemoOptions(model=model, requests=40, port=0, progress=False))
    assert s["model_kind"] == model and len(s["groups"]) == 2
    assert s["model"] == ("tiny-gemma2" if model == "hybrid" else "tiny-lfm2")
    assert all(g["hits"] > 0 and g["blocks"] > 0 for g in s["groups"].values())
    assert s["verified"] > 0 and s["max_recompute_error"] < 1e-4
    assert s["anomalies"] == {}


def test_cli_refuses_a_fault_the_model_cannot_have(capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar.cli.main import main
    assert main(["demo", "--model", "recurrent", "--fault", "window-mismatch",
                 "--quiet", "--port", "0"]) == 2
    assert "does not apply" in capsys.readouterr().err
    assert main(["demo", "--model", "reference", "--fault", "null-block-read",
                 "--quiet", "--port", "0"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--model", "mamba"])
    assert exc.value.code == 2


@pytest.mark.parametrize("model,fault", [("hybrid", "window-mismatch"),
                                         ("recurrent", "missing-group-state")])
def test_every_group_keeps_the_allocator_invariants(model: str, fault: str) -> None:
    """Per-group snapshots (null block reserved) pass the sidecar's invariant checks after
    every request, also while a block-table fault rewrites tables (it moves references)."""
    from sidecar.allocator.invariants import check_snapshot
    engine = engine_for(model, fault=fault, fault_start_after=2, fault_probability=1.0)
    adapter = HybridReferenceAdapter(engine)
    violations: list[Any] = []
    snapshots = 0

    def check(_: Any) -> None:
        nonlocal snapshots
        for snap in adapter.block_tables():
            snapshots += 1
            violations.extend(check_snapshot(snap))

    workload = ChatWorkload(WorkloadConfig(seed=2, conversations=24, block_size=BS))
    drive(engine, workload, max_requests=24, on_result=check)
    assert engine.fault.injections and snapshots == 48 and violations == []
    snap = adapter.block_tables()[1]
    assert snap.reserved == (NULL_BLOCK,) and all(NULL_BLOCK not in t
                                                  for t in snap.sequences.values())
