"""The reference engine's data-movement pieces and the faults that break them: int8 KV
storage (quantization-drift), the CPU offload tier (failed-load-as-hit), write layouts
(layout-mismatch), torn writes, and the ground truth the detection benchmark scores with."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.faults import FAULTS
from kvtestbed.engines.pool import BlockPool
from kvtestbed.engines.quant import KV_STORAGES, quantize
from kvtestbed.workload import ChatWorkload, drive

from sidecar.checks.fingerprint import kv_digest
from sidecar.checks.recompute import block_error
from sidecar.checks.tolerance import tolerance_for
from sidecar.core.protocol import BlockRef, Hit, Lookup, StoredBlock
from tests.reference_helpers import SMALL_POOL, SMALL_WORKLOAD


class TruthSink:
    """Records every hit with the ground truth's verdict at lookup, and which of its bad
    blocks no longer match the digest reported when they were stored."""

    def __init__(self) -> None:
        self.engine: ReferenceEngine | None = None
        self.hits: list[tuple[Hit, list[int]]] = []
        self.stores: dict[int, StoredBlock] = {}
        self.digest_changed: set[int] = set()  # block ids, seen at a hit

    def on_lookup(self, lookup: Lookup) -> None:
        engine = self.engine
        if lookup.hit is None or engine is None or engine.truth is None:
            return
        bad = engine.truth.bad_blocks(lookup.hit)
        self.hits.append((lookup.hit, bad))
        for i in bad:
            b = lookup.hit.blocks[0][i]
            stored = self.stores.get(b)
            if stored and stored.kv_digest != kv_digest(*engine.pool.read_block(b)):
                self.digest_changed.add(b)

    def on_store(self, block: StoredBlock) -> None:
        self.stores[block.block_id] = block

    def on_free(self, group_id: int, block_ids: object) -> None:
        pass

    def on_request_done(self, latency_seconds: float) -> None:
        pass


@cache
def run(fault: str = "none", params: tuple[tuple[str, object], ...] = (),
        **config: object) -> tuple[ReferenceEngine, TruthSink]:
    """The small workload with ground truth and digests (shared, read-only)."""
    sink = TruthSink()
    cfg = EngineConfig(**{"num_blocks": SMALL_POOL, "fault": fault, "track_truth": True,
                          "kv_digest": True, "fault_start_after": 0,
                          "fault_params": dict(params), **config})  # type: ignore[arg-type]
    engine = ReferenceEngine(cfg, sink=sink)  # type: ignore[arg-type]
    sink.engine = engine
    drive(engine, ChatWorkload(SMALL_WORKLOAD))
    return engine, sink


def errors(engine: ReferenceEngine, hit: Hit, indices: list[int]) -> list[float]:
    adapter = ReferenceAdapter(engine)
    refs = [BlockRef(0, i, hit.blocks[0][i]) for i in indices]
    return [block_error(c, r) for c, r in zip(adapter.read(hit, refs),
                                              adapter.recompute(hit, refs), strict=True)]


# ---------------------------------------------------------------------- int8 storage
def test_int8_pool_round_trips_within_row_rounding() -> None:
    pool = BlockPool(4, 16, 2, 2, 16, torch.bfloat16, kv_storage="int8")
    assert pool.key.dtype == torch.int8 and pool.key_scale.shape == (2, 4, 2, 16, 1)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 20, 16, generator=g).to(torch.bfloat16)
    values = torch.randn(2, 2, 20, 16, generator=g).to(torch.bfloat16)
    pool.write([3, 1], 0, keys, values)
    k, v = pool.gather([3, 1], 20)
    assert k.dtype == torch.bfloat16 and k.shape == keys.shape
    row_max = keys.float().abs().amax(-1, keepdim=True)
    assert bool(((k.float() - keys.float()).abs() <= row_max / 254 + 1e-2 * row_max).all())
    assert not torch.equal(k, keys)  # it really is quantised
    assert torch.equal(pool.read_block(1)[1][:, :, :4], v[:, :, 16:])
    copy = BlockPool(4, 16, 2, 2, 16, torch.bfloat16, kv_storage="int8")
    copy.import_block(0, pool.export_block(3))
    assert all(torch.equal(a, b) for a, b in zip(copy.export_block(0).tensors(),
                                                 pool.export_block(3).tensors(), strict=True))
    with pytest.raises(ValueError, match="kv_storage"):
        BlockPool(4, 16, 2, 2, 16, kv_storage="fp4")


def test_a_stale_scale_saturates_far_beyond_int8_rounding() -> None:
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    amax = x.abs().amax(-1, keepdim=True)

    def worst(factor: float) -> float:
        q, scale = quantize(x, factor)
        return float(((q.float() * scale - x).abs() / amax).max())

    assert worst(1.0) <= 1 / 254 + 1e-6  # clean: half a step of amax / 127
    assert worst(0.25) == pytest.approx(0.75, rel=1e-5)  # the row's largest value saturates


def test_clean_int8_engine_stays_within_its_tolerance() -> None:
    engine, sink = run(kv_storage="int8")
    info = ReferenceAdapter(engine).describe()
    assert info.kv_storage == "int8" and KV_STORAGES == ("int8",)
    tol = tolerance_for(info.dtype, info.kv_storage)
    hit, bad = sink.hits[-1]
    assert not bad and max(errors(engine, hit, list(range(len(hit.blocks[0]))))) < tol / 5


def test_quantization_drift_turns_on_int8_and_breaks_the_tolerance() -> None:
    engine, sink = run("quantization-drift")
    assert engine.config.kv_storage == "int8"  # the fault's need, applied by the engine
    tol = tolerance_for("float32", "int8")
    affected = [(h, bad) for h, bad in sink.hits if bad]
    assert engine.fault.injections and affected
    hit, bad = affected[0]
    assert min(errors(engine, hit, bad)) > 4 * tol
    explicit = ReferenceEngine(EngineConfig(fault="quantization-drift", kv_storage=None,
                                            cpu_offload_blocks=8))
    assert explicit.config.kv_storage == "int8" and explicit.config.cpu_offload_blocks == 8


# ---------------------------------------------------------------------- CPU offload tier
def test_tier_spills_evicted_blocks_and_loads_them_back_exactly() -> None:
    engine, sink = run(cpu_offload_blocks=256)
    tier = engine.tier
    assert tier is not None and tier.spills > 0 and tier.loads > 0
    assert all(not bad for _, bad in sink.hits)  # the truth agrees: nothing is wrong
    loaded_hits = [h for h, _ in sink.hits if len(h.blocks[0]) > 2]
    tol = tolerance_for("float32")
    assert max(e for h in loaded_hits[-5:]
               for e in errors(engine, h, list(range(len(h.blocks[0]))))) < tol


def test_failed_load_is_reported_as_a_hit_over_other_kv() -> None:
    engine, sink = run("failed-load-as-hit", fault_probability=1.0)
    assert engine.tier is not None and engine.tier.loads > 0
    failed = {i.block_id for i in engine.fault.injections}
    assert failed and any(bad for _, bad in sink.hits)
    # The load re-reports the block with the digest of the KV as first written; the
    # destination holds something else, so the fingerprint no longer matches.
    assert sink.digest_changed & failed


# ---------------------------------------------------------------------- write faults
def test_torn_write_keeps_the_previous_bytes_after_a_cut() -> None:
    engine, sink = run("torn-write", fault_probability=1.0)
    truth = engine.truth
    assert truth is not None and engine.fault.injections
    inj = engine.fault.injections[-1]
    b = inj.block_id
    assert b is not None
    real = torch.cat([engine.pool.key[:, b].reshape(-1), engine.pool.value[:, b].reshape(-1)])
    clean = torch.cat([truth.shadow.key[:, b].reshape(-1), truth.shadow.value[:, b].reshape(-1)])
    same = (real == clean).tolist()
    cut = same.index(False)
    assert all(same[:cut]) and cut >= len(same) // 4 - 1  # a head of the write landed
    assert cut <= 3 * len(same) // 4  # and a tail did not
    assert any(bad for _, bad in sink.hits)
    assert sink.digest_changed  # torn after the digest was taken: fingerprints see it


def test_layout_mismatch_keeps_shape_and_dtype_but_not_content() -> None:
    engine, sink = run("layout-mismatch", fault_probability=1.0)
    truth = engine.truth
    assert truth is not None
    details = {i.detail for i in engine.fault.injections}
    assert any("swapped" in d for d in details) and any("token-major" in d for d in details)
    last = {i.block_id: i.detail for i in engine.fault.injections}  # latest per block
    checked = 0
    for b, detail in last.items():
        key, value = engine.pool.key[:, b], engine.pool.value[:, b]
        clean_k, clean_v = truth.shadow.key[:, b], truth.shadow.value[:, b]
        if torch.equal(key, clean_k):
            continue  # rewritten by a later owner since
        checked += 1
        if "swapped" in detail:
            assert torch.equal(key, clean_v) and torch.equal(value, clean_k)
        else:
            assert torch.equal(key, clean_k.transpose(1, 2).contiguous().view(key.shape))
    assert checked >= 5
    hit, bad = next((h, bad) for h, bad in sink.hits if bad)
    kv = ReferenceAdapter(engine).read(hit, [BlockRef(0, bad[0], hit.blocks[0][bad[0]])])[0]
    assert kv.key.shape == (2, 2, 16, 16) and kv.key.dtype == torch.float32
    assert min(errors(engine, hit, bad)) > 100 * tolerance_for("float32")
    # Written wrong before the digest was taken: the fingerprint certifies the wrong bytes,
    # only recompute can tell.
    assert not sink.digest_changed


def test_bit_flip_works_on_int8_storage_too() -> None:
    engine, _ = run("bit-flip", fault_probability=1.0, kv_storage="int8")
    assert engine.fault.injections


# ---------------------------------------------------------------------- ground truth
@pytest.mark.parametrize(("fault", "params"), [("none", ()), ("zero-block", ()),
                                               ("hash-collision", (("buckets", 64),))])
def test_ground_truth_names_every_block_that_differs_from_recompute(
        fault: str, params: tuple[tuple[str, object], ...]) -> None:
    engine, sink = run(fault, params)
    tol = tolerance_for("float32")
    checked = 0
    for hit, bad in sink.hits[-12:]:
        errs = errors(engine, hit, list(range(len(hit.blocks[0]))))
        assert {i for i, e in enumerate(errs) if e > tol} <= set(bad)
        checked += len(errs)
    assert checked > 50
    if fault == "none":
        assert all(not bad for _, bad in sink.hits)


def test_every_new_fault_is_registered_with_its_needs() -> None:
    for name in ("torn-write", "failed-load-as-hit", "layout-mismatch", "quantization-drift"):
        assert FAULTS[name].corrupts_kv
    assert FAULTS["failed-load-as-hit"].engine_needs == {"cpu_offload_blocks": 512}
    assert FAULTS["quantization-drift"].engine_needs == {"kv_storage": "int8"}
