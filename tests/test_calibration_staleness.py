"""A saved calibration profile and the engine it is applied to (issue 23): an entry measured
for one model or dtype is never applied to another (the sidecar warns and learns instead),
a sidecar restarted from a profile that `kv-sidecar calibrate` wrote keeps that profile's
tolerance beside an engine that is already broken (the fp8 storage downcast in bfloat16 is
still caught), and starting with no profile warns at start, naming what it learns for.
tests/test_calibration_profile.py has the file format, the learning rules and the shipped
profile; these are the sidecar's start-up paths with real engines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from kvtestbed.adapters.hybrid_adapter import make_adapter
from kvtestbed.engines.engine import EngineConfig
from kvtestbed.engines.hybrid_engine import build_engine
from kvtestbed.engines.hybrid_model import model_config

from sidecar.checks.calibration_profile import Profile, ProfileEntry, load_profile, save_profile
from sidecar.checks.tolerance import tolerance_for
from sidecar.cli.main import main
from sidecar.config.settings import SidecarConfig
from sidecar.core.monitor import Monitor
from tests.reference_helpers import downcasting_run

WARNED = "no calibration profile"
LOG = "sidecar.checks.calibration"


def _profile(tmp_path: Path, **entry: object) -> str:
    """A profile with one bfloat16 tiny-llama entry (``entry`` changes it)."""
    fields: dict = {"model": "tiny-llama", "dtype": "bfloat16", "reference": "engine",
                    "floor": 0.02, "tolerance": 0.08, "blocks": 900, "engine": "reference",
                    **entry}
    path = tmp_path / "profile.json"
    save_profile(path, Profile((ProfileEntry(**fields),)))
    return str(path)


def _monitor(dtype: str, profile: str | None, model: str = "reference",
             fault: str = "none") -> tuple[Monitor, object]:
    engine = build_engine(EngineConfig(model=model_config(model, dtype, 0), num_blocks=64,
                                       model_kind=model, fault=fault, fault_start_after=0,
                                       fault_probability=0.3 if fault != "none" else None,
                                       kv_digest=model == "reference"))
    cfg = SidecarConfig(sample_every=1, dispatch="inline", calibration_samples=16,
                        calibration_profile=profile, allocator_every_s=0.0)
    return Monitor(make_adapter(engine), cfg), engine


def _state(monitor: Monitor) -> tuple[str, float]:
    (state,) = monitor.verifier.calibration.states()
    return state.mode, state.tolerance


# ---------------------------------------------------------------------- the wrong entry
@pytest.mark.parametrize("dtype, model", [("float32", "reference"), ("float16", "reference"),
                                          ("bfloat16", "hybrid")])
def test_a_profile_entry_is_not_applied_to_another_dtype_or_model(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, dtype: str, model: str) -> None:
    path = _profile(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOG):
        monitor, _ = _monitor(dtype, path, model)
    mode, tol = _state(monitor)
    assert mode == "calibrating" and tol == tolerance_for(dtype)  # the table, not 0.08
    (msg,) = [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]
    assert dtype in msg and "profile.json has no entry" in msg


def test_the_matching_entry_is_applied_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG):
        monitor, _ = _monitor("bfloat16", _profile(tmp_path))
    assert _state(monitor) == ("profile", 0.08)
    assert not [r for r in caplog.records if WARNED in r.getMessage()]


# ---------------------------------------------------------------------- restart, broken engine


def test_restart_from_a_calibrated_profile_beside_a_broken_engine_keeps_its_tolerance(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trusted.json"
    assert main(["calibrate", "--out", str(out), "--model", "reference", "--dtype",
                 "bfloat16", "--requests", "60"]) == 0
    capsys.readouterr()
    entry = load_profile(out).find("tiny-llama", "bfloat16", None, "engine")
    assert entry is not None
    # Two restarts from the same file: each starts at the profile's tolerance, learns the
    # broken engine's fp8 error as its floor, and still never loosens past the profile.
    for _ in range(2):
        flagged, tol = downcasting_run(str(out))
        assert tol <= entry.tolerance and flagged > 0
    blind, tol_blind = downcasting_run(None)  # in-memory learning from the broken engine
    assert tol_blind > entry.tolerance and blind < flagged


def test_a_profile_of_another_dtype_does_not_cover_a_restart(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture,
                                                             ) -> None:
    """A float32-only profile beside a broken bfloat16 engine: no entry applies, the
    sidecar says so, and learns as if it had none."""
    path = _profile(tmp_path, dtype="float32", floor=1e-6, tolerance=1e-5)
    with caplog.at_level(logging.WARNING, logger=LOG):
        _, tol = downcasting_run(path)
    _, tol_none = downcasting_run(None)
    assert tol == tol_none > 0.08
    assert any("has no entry" in r.getMessage() and "bfloat16" in r.getMessage()
               for r in caplog.records)


# ---------------------------------------------------------------------- no profile
@pytest.mark.parametrize("model, name", [("reference", "tiny-llama"),
                                         ("recurrent", "tiny-lfm2")])
def test_starting_without_a_profile_warns_at_start_naming_model_and_dtype(
        caplog: pytest.LogCaptureFixture, model: str, name: str) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG):
        monitor, _ = _monitor("bfloat16", None, model)
    (msg,) = [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]
    assert repr(name) in msg and "bfloat16" in msg and "kv-sidecar calibrate" in msg
    assert _state(monitor)[0] == "calibrating"
