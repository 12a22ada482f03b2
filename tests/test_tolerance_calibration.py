"""Calibrated, exported recompute tolerance: overrides, calibration per reference kind and
dtype, the error histogram and the tolerance/floor/drift gauges, the CLI flags, and the
storage-downcast fault caught in bfloat16 under the calibrated tolerance."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kvtestbed.bench.harness import Scenario, run_many
from kvtestbed.engines.faults import FAULTS
from prometheus_client import generate_latest

from sidecar import signals as S
from sidecar.checks.calibration import Calibration, CalibrationConfig
from sidecar.checks.tolerance import (
    MEASURED_MINIMUMS,
    MIN_ULPS,
    min_tolerance,
    parse_override,
    tolerance_for,
)
from sidecar.cli.main import main
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, Hit
from sidecar.signals import AnomalyKind
from tests.limits import DETECTION_TIMEOUT_S
from tests.toy import BS, ToyAdapter, ToyEngine, reference_kv


# ---------------------------------------------------------------------- tolerance table
def test_overrides_parse_and_bad_ones_are_clear_errors() -> None:
    assert parse_override("bfloat16=0.05") == ("bfloat16", 0.05)
    assert parse_override("engine:float32=1e-5") == ("engine:float32", 1e-5)
    for bad, msg in [("bfloat16", "expected"), ("bfloat16=x", "not a number"),
                     ("float8=0.1", "no recompute tolerance"), ("hf:float32=0.1", "unknown "
                     "reference kind"), ("float32=0", "> 0"), ("float32=inf", "> 0")]:
        with pytest.raises(ValueError, match=msg):
            parse_override(bad)


def test_min_tolerance_is_a_few_ulps_of_the_dtype() -> None:
    assert min_tolerance("bfloat16") == MIN_ULPS * 2.0 ** -7
    # float32's measured floor (1.65e-6 reference engine, 1.5e-6 vLLM: the table in
    # sidecar/checks/tolerance.py)
    # is over 8 epsilons: its minimum sits over that floor with a margin, under corruption.
    assert min_tolerance("torch.float32") == MEASURED_MINIMUMS["float32"]
    assert 4 * 1.65e-6 < min_tolerance("float32") > MIN_ULPS * 2.0 ** -23
    assert min_tolerance("float32") < 5e-2 / 100
    # Over the honest long-context re-rounding measured in bfloat16 (~0.03), under what an
    # fp8 round trip of bfloat16 KV costs (~0.2).
    assert 0.03 < min_tolerance("bfloat16") < 0.2 / 2
    assert min_tolerance("float16") < tolerance_for("float16")


# ---------------------------------------------------------------------- calibration
def test_fixed_without_calibration_and_override_used_as_is() -> None:
    cal = Calibration("bfloat16", None, CalibrationConfig(samples=0))
    for _ in range(100):
        cal.observe("independent", 0.001, True)
    assert cal.tolerance("independent") == tolerance_for("bfloat16")
    cfg = CalibrationConfig(samples=4, overrides={"engine:bfloat16": 0.03})
    cal = Calibration("bfloat16", None, cfg)
    for _ in range(10):
        cal.observe("engine", 0.0, True)
    assert cal.tolerance("engine") == 0.03  # an override is not calibrated away
    (state,) = cal.states()
    assert state.mode == "fixed" and state.floor is None


def test_calibration_learns_per_reference_clamped_between_ulps_and_ceiling() -> None:
    cal = Calibration("bfloat16", None, CalibrationConfig(samples=8, multiple=4.0))
    errs = [0.004, 0.016, 0.008, 0.012, 0.0, 0.02, 0.004, 0.008]
    for i, e in enumerate(errs):
        assert cal.tolerance("independent") == 0.25  # the hard one while calibrating
        cal.observe("independent", e, True)
        cal.observe("engine", 0.0, True)
        cal.observe("independent", 0.2, False)  # a flagged block never enters the floor
        assert cal.states()[0].seen == i + 1 or i == 7
    assert cal.tolerance("independent") == pytest.approx(4 * 0.02)
    assert cal.tolerance("engine") == min_tolerance("bfloat16")  # exact-0 floor: a few ulps
    ceiling = Calibration("bfloat16", None, CalibrationConfig(samples=2, multiple=10.0))
    ceiling.observe("independent", 0.2, True)
    ceiling.observe("independent", 0.1, True)
    assert ceiling.tolerance("independent") == 0.25  # never looser than the hard tolerance


def test_drift_is_recent_quantile_over_floor_and_reaches_multiple_at_tolerance() -> None:
    cal = Calibration("float32", None, CalibrationConfig(samples=4, multiple=4.0, window=32))
    for e in (1e-5, 2e-5, 1e-5, 2e-5):
        cal.observe("independent", e, True)
    assert cal.states()[0].drift is None  # no recent errors yet: unknown, not 0
    for _ in range(32):
        cal.observe("independent", 1e-5, True)
    assert cal.states()[0].drift == pytest.approx(0.5)
    for _ in range(32):
        cal.observe("independent", 6e-5, True)  # 3x the floor: drifted, still under 8e-5
    st = cal.states()[0]
    assert st.drift == pytest.approx(3.0) and st.tolerance > 6e-5
    exact = Calibration("bfloat16", None, CalibrationConfig(samples=1, multiple=4.0))
    exact.observe("engine", 0.0, True)
    for _ in range(20):
        exact.observe("engine", exact.tolerance("engine"), True)
    assert exact.states()[0].drift == pytest.approx(4.0)


def test_bad_calibration_config_is_a_clear_error() -> None:
    for kwargs, msg in [({"calibration_samples": -1}, "calibration_samples"),
                        ({"calibration_multiple": 0.5}, "calibration_multiple"),
                        ({"tolerances": {"float8": 0.1}}, "no recompute tolerance")]:
        with pytest.raises(ValueError, match=msg):
            Monitor(ToyAdapter(ToyEngine(None)), SidecarConfig(**kwargs))


# ---------------------------------------------------------------------- through the Monitor
class NoisyAdapter(ToyAdapter):
    """The toy adapter with a recompute that is off by relative noise of ``noise``: a
    reference with a noise floor, of the kind it declares."""

    def __init__(self, engine: ToyEngine, noise: float, kind: str = "independent") -> None:
        super().__init__(engine)
        self.noise = noise
        self.reference_kind = kind
        self._gen = torch.Generator().manual_seed(7)

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        out = []
        for r in refs:
            k, v = reference_kv(hit.tokens, r.index, self.engine.dtype)
            k = k * (1 + self.noise * torch.randn(k.shape, generator=self._gen))
            out.append(BlockKV(r, k, v))
        return out


def _monitor(adapter: ToyAdapter, **cfg: object) -> Monitor:
    mon = Monitor(adapter, SidecarConfig(sample_every=1, blocks_per_sample=4,
                                         adapter_timeout_s=DETECTION_TIMEOUT_S, **cfg))
    adapter.engine.sink = mon
    return mon


def _verify_all(mon: Monitor, engine: ToyEngine, n: int, start: int = 0) -> list:
    verdicts = []
    for i in range(start, start + n):
        prefix = [i + 1] * (3 * BS)
        engine.serve(prefix + [0])
        hit = Hit(prefix + [0], 3 * BS, {0: [engine.index[tuple(prefix[:(j + 1) * BS])]
                                          for j in range(3)]},
                  {0: [engine.gen[engine.index[tuple(prefix[:(j + 1) * BS])]]
                       for j in range(3)]}, {})
        verdicts.append(mon.verify(hit))
    return verdicts


def test_error_histogram_and_calibration_gauges_on_metrics() -> None:
    engine = ToyEngine(None)
    mon = _monitor(NoisyAdapter(engine, 1e-5), calibration_samples=30)
    labels = {"reference": "independent", "dtype": "float32", "write_path": "all"}
    assert mon.metrics.value(S.RECOMPUTE_TOLERANCE.name, **labels) == 1e-3
    verdicts = _verify_all(mon, engine, 40)
    assert all(len(v.errors) == 3 and not v.findings for v in verdicts)
    text = generate_latest(mon.metrics.registry).decode()
    assert 'kvsidecar_recompute_error_bucket{dtype="float32",engine="toy",group="0",' \
           'le="1e-07",model="toy-model"}' in text
    count = mon.metrics.value(S.RECOMPUTE_ERROR.name + "_count", group="0", dtype="float32")
    assert count == 120
    floor = mon.metrics.value(S.RECOMPUTE_NOISE_FLOOR.name, **labels)
    assert 1e-6 < floor < 1e-4
    assert mon.metrics.value(S.RECOMPUTE_TOLERANCE.name, **labels) == pytest.approx(4 * floor)
    assert 0 < mon.metrics.value(S.RECOMPUTE_ERROR_DRIFT.name, **labels) <= 1.0
    assert min(S.ERROR_BUCKETS) == 1e-7 and max(S.ERROR_BUCKETS) == 10.0


def test_calibrated_tolerance_catches_what_the_hard_one_misses_and_drift_shows_it() -> None:
    engine = ToyEngine(None)
    adapter = NoisyAdapter(engine, 2e-6)
    mon = _monitor(adapter, calibration_samples=30, calibration_multiple=8.0)
    _verify_all(mon, engine, 30)
    tol = mon.verifier.tolerance
    assert tol < tolerance_for("float32") / 5  # calibrated far under the hard 1e-3
    # The noise triples (a kernel change, a lossy transfer): no block fails...
    adapter.noise = 6e-6
    quiet = _verify_all(mon, engine, 30, start=100)
    assert not any(v.findings for v in quiet)
    labels = {"reference": "independent", "dtype": "float32", "write_path": "all"}
    drift = mon.metrics.value(S.RECOMPUTE_ERROR_DRIFT.name, **labels)
    assert drift > S.THRESHOLDS.recompute_error_drift  # ...but the distribution moved
    # 40x the floor's noise in one block: under the hard 1e-3, over the calibrated one.
    adapter.noise = 8e-5
    (v,) = _verify_all(mon, engine, 1, start=200)
    assert {f.kind for f in v.findings} == {AnomalyKind.RECOMPUTE_MISMATCH}
    assert all(e < tolerance_for("float32") for _, e in v.errors)
    fixed = _monitor(NoisyAdapter(ToyEngine(None), 8e-5))
    assert not any(v.findings for v in _verify_all(fixed, fixed.adapter.engine, 5))


def test_reference_kinds_calibrate_apart() -> None:
    engine = ToyEngine(None)
    adapter = NoisyAdapter(engine, 1e-5)
    mon = _monitor(adapter, calibration_samples=9)
    _verify_all(mon, engine, 3)
    adapter.noise, adapter.reference_kind = 0.0, "engine"
    _verify_all(mon, engine, 3, start=10)
    states = {s.reference: s for s in mon.verifier.calibration.states()}
    assert states["engine"].floor == 0.0
    assert states["engine"].tolerance == min_tolerance("float32")
    assert states["independent"].tolerance > 10 * states["engine"].tolerance


# ---------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv", [["demo", "--tolerance", "float32"],
                                  ["demo", "--tolerance", "hf:float32=1"],
                                  ["demo", "--calibrate", "-3"],
                                  ["demo", "--calibration-multiple", "0.5"]])
def test_bad_tolerance_flags_exit_2_with_a_message(argv: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------- storage downcast
def test_storage_downcast_is_registered_and_corrupts_kv() -> None:
    assert FAULTS["storage-downcast"].corrupts_kv


def test_storage_downcast_caught_in_bfloat16_only_under_the_calibrated_tolerance() -> None:
    base = {"fault": "storage-downcast", "dtype": "bfloat16", "requests": 100,
            "num_blocks": 64, "sample_every": 2}
    calibrated, fixed = run_many([Scenario(**base, calibration_samples=64),
                                  Scenario(**base)])
    assert calibrated.injections and calibrated.bad_verified > 0
    assert calibrated.recall == 1.0 and calibrated.false_alarm_blocks == 0
    assert calibrated.kinds.keys() == {"recompute_mismatch"}
    assert calibrated.calibrated_floor is not None
    assert calibrated.tolerance < 0.25 / 2
    assert fixed.recall is not None and fixed.recall < 0.5  # what the fixed 0.25 misses


def test_tolerance_flags_reach_the_sidecar_config_of_demo_and_vllm_serve() -> None:
    from kvtestbed.demo import DemoOptions, build

    from sidecar.adapters.vllm.cli import parser as vllm_parser
    from sidecar.checks.tolerance import config_fields
    from sidecar.cli.main import build_parser

    args = build_parser().parse_args(["demo", "--tolerance", "bfloat16=0.1", "--tolerance",
                                      "engine:float32=1e-5", "--calibrate", "32",
                                      "--calibration-multiple", "3"])
    fields = config_fields(args)
    assert fields == {"tolerances": {"bfloat16": 0.1, "engine:float32": 1e-5},
                      "calibration_samples": 32, "calibration_multiple": 3.0,
                      "calibration_profile": None}
    _, mon = build(DemoOptions(dtype="bfloat16", sidecar=fields))
    assert mon.verifier.tolerance == 0.1  # the override, not the table's 0.25
    serve = vllm_parser().parse_args(["serve", "--model", "m", "--dtype", "bfloat16",
                                      "--block-size", "16", "--calibrate", "64"])
    assert config_fields(serve)["calibration_samples"] == 64


def test_a_non_finite_recompute_is_flagged_and_keeps_the_histogram_sum_finite() -> None:
    class NaNReference(ToyAdapter):
        def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
            out = super().recompute(hit, refs)
            for b in out:
                b.key[0, 0, 0, 0] = float("nan")
            return out

    engine = ToyEngine(None)
    mon = _monitor(NaNReference(engine), calibration_samples=4)
    (v,) = _verify_all(mon, engine, 1)
    assert {f.kind for f in v.findings} == {AnomalyKind.RECOMPUTE_MISMATCH}
    assert all(e == float("inf") for _, e in v.errors)
    total = mon.metrics.value(S.RECOMPUTE_ERROR.name + "_sum", group="0", dtype="float32")
    assert total == 3 * S.ERROR_CAP
    assert mon.verifier.calibration.states()[0].mode == "calibrating"  # never learnt from
