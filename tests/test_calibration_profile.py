"""Calibration on by default and kept across restarts: the profile file (hostile input
refused with the field named), a tolerance that starts at the profile's and learns only
downward, the warning when learning starts with no profile, the shipped reference-engine
profile, and `kv-sidecar calibrate`."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
from kvtestbed.calibrate_cli import measure
from kvtestbed.demo import SHIPPED_PROFILE, DemoOptions, sidecar_config

from sidecar.checks.calibration import Calibration, CalibrationConfig
from sidecar.checks.calibration_profile import (
    MAX_PROFILE_BYTES,
    PROFILE_FORMAT,
    Profile,
    ProfileEntry,
    ProfileError,
    load_profile,
    parse_profile,
    save_profile,
)
from sidecar.checks.tolerance import min_tolerance, tolerance_for
from sidecar.cli.main import main
from sidecar.config.settings import SidecarConfig
from tests.reference_helpers import downcasting_run

ENTRY = {"model": "tiny-llama", "dtype": "bfloat16", "reference": "independent",
         "floor": 0.0124, "tolerance": 0.0625, "blocks": 933, "multiple": 4.0,
         "write_path": "all", "kv_storage": None, "engine": "reference"}


def _doc(**changes: object) -> bytes:
    entry = {**ENTRY, **changes}
    return json.dumps({"format": PROFILE_FORMAT, "entries": [entry]}).encode()


# ---------------------------------------------------------------------- the file
def test_profile_round_trips_atomically(tmp_path: Path) -> None:
    prof = parse_profile(_doc())
    path = tmp_path / "sub" / "p.json"
    save_profile(path, prof)
    again = load_profile(path)
    assert again.entries == prof.entries
    assert again.find("tiny-llama", "torch.bfloat16", None, "independent") == prof.entries[0]
    assert again.find("tiny-llama", "float32", None, "independent") is None
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]  # no temp file left
    newer = Profile((ProfileEntry(**{**ENTRY, "floor": 0.01}),
                     ProfileEntry(**{**ENTRY, "dtype": "float32", "tolerance": 1e-5})))
    merged = prof.merged(newer)
    assert {(e.dtype, e.floor) for e in merged.entries} == {("bfloat16", 0.01),
                                                            ("float32", 0.0124)}


@pytest.mark.parametrize("data, msg", [
    (b"\xff\xfe", "not JSON"),
    (b"{", "not JSON"),
    (b"[]", "format"),
    (json.dumps({"format": "other/1", "entries": []}).encode(), "format"),
    (json.dumps({"format": PROFILE_FORMAT, "entries": {}}).encode(), "must be a list"),
    (json.dumps({"format": PROFILE_FORMAT, "entries": [], "x": 1}).encode(), "unknown keys"),
    (json.dumps({"format": PROFILE_FORMAT, "entries": [1]}).encode(), "expected an object"),
    (_doc().replace(b"0.0124", b"NaN"), "not JSON"),
    (_doc().replace(b"0.0625", b"Infinity"), "not JSON"),
    (_doc().replace(b"0.0625", b"1e999"), "tolerance must be a finite"),
    (_doc(floor=-1.0), "floor must be"),
    (_doc(tolerance=0), "tolerance must be"),
    (_doc(multiple=0.5), "multiple must be"),
    (_doc(blocks=0), "blocks must be"),
    (_doc(blocks=True), "wrong type"),
    (_doc(floor="0.1"), "wrong type"),
    (_doc(dtype="float8"), "unknown dtype"),
    (_doc(reference="hf"), "unknown reference kind"),
    (_doc(write_path="sideways"), "unknown write path"),
    (_doc(kv_storage="int4"), "unknown KV storage"),
    (_doc(model=""), "characters"),
    (_doc(model="m" * 300), "characters"),
    (_doc(colour="red"), "unknown fields"),
    (json.dumps({"format": PROFILE_FORMAT, "entries": [{"model": "m"}]}).encode(), "missing"),
    (json.dumps({"format": PROFILE_FORMAT, "entries": [ENTRY, ENTRY]}).encode(), "repeats"),
    # an outside check: each of these loaded, and a repeated key emptied the profile
    (_doc(tolerance=2.0), "between the floor"),
    (_doc(floor=0.008, tolerance=0.001), "between the floor"),
    (_doc(multiple=1e300), "multiple must be at most"),
    (_doc(blocks=10**40), "blocks must be in"),
    (_doc(kernels="cpu:avx512\n+amx"), "control or format character"),
    (_doc(model="tiny\x1b[31m"), "control or format character"),
    (_doc(kernels="cpu:avx512+amx\u202e"), "format character"),
    (_doc()[:-1] + b', "entries": []}', "given twice"),
    (json.dumps({"format": PROFILE_FORMAT, "entries": [
        ENTRY, {k: v for k, v in ENTRY.items() if k != "write_path"}]}).encode(),
     r"repeats entry 0.*does not give .*write_path"),
    (b" " * (MAX_PROFILE_BYTES + 1), "limit"),
    (b"[" * 100_000, "not JSON"),
])
def test_hostile_profiles_are_refused_with_the_problem_named(data: bytes, msg: str) -> None:
    with pytest.raises(ProfileError, match=msg):
        parse_profile(data, "p.json")


def test_a_bad_profile_stops_the_sidecar_at_start_with_the_file_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no such file"):
        SidecarConfig(calibration_profile=str(tmp_path / "missing.json")).validate()
    bad = tmp_path / "bad.json"
    bad.write_bytes(_doc(floor=float("inf")).replace(b"Infinity", b"1e999"))
    with pytest.raises(ProfileError, match=r"bad.json.*floor"):
        SidecarConfig(calibration_profile=str(bad)).validate()


def test_demo_with_a_bad_profile_exits_2(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["demo", "--requests", "1", "--port", "0", "--quiet",
                 "--calibration-profile", str(bad)]) == 2
    assert "bad.json" in capsys.readouterr().err


# ---------------------------------------------------------------------- learning
def _cal(entry: dict | None, samples: int = 8) -> Calibration:
    prof = None if entry is None else Profile((ProfileEntry(**entry),), "p.json")
    return Calibration("bfloat16", None, CalibrationConfig(samples=samples, profile=prof),
                       model="tiny-llama")


def test_calibration_is_on_by_default() -> None:
    assert SidecarConfig().calibration_samples == 64
    assert CalibrationConfig().samples == 64


def test_profile_sets_the_tolerance_and_learning_only_tightens_it() -> None:
    broken = _cal({**ENTRY, "tolerance": 0.08})
    assert broken.tolerance("independent") == 0.08
    assert broken.states()[0].mode == "profile"
    for _ in range(8):  # a broken engine's 0.07 passes under 0.08 and is learnt as floor
        broken.observe("independent", 0.07, True)
    st = broken.states()[0]
    assert st.mode == "calibrated" and st.floor == 0.07
    assert broken.tolerance("independent") == 0.08  # 4 x 0.07 would loosen: not allowed
    clean = _cal({**ENTRY, "tolerance": 0.2})
    for _ in range(8):
        clean.observe("independent", 0.01, True)
    assert clean.tolerance("independent") == pytest.approx(0.0625)  # tightened, min-clamped
    # A profile never loosens past the hard table, nor goes under the minimum.
    assert _cal({**ENTRY, "tolerance": 3.0}).tolerance("independent") == 0.25
    assert _cal({**ENTRY, "tolerance": 1e-9}).tolerance("independent") == \
        min_tolerance("bfloat16")
    fixed = _cal({**ENTRY, "tolerance": 0.08}, samples=0)
    for _ in range(40):
        fixed.observe("independent", 0.04, True)
    st = fixed.states()[0]
    assert st.tolerance == 0.08 and st.mode == "profile"
    # drift against the profile's floor (never under minimum / multiple, as a learnt one)
    assert st.drift == pytest.approx(0.04 / (min_tolerance("bfloat16") / 4))
    # Other keys of the profile do not apply.
    assert _cal({**ENTRY, "model": "other"}).tolerance("independent") == 0.25
    assert _cal(ENTRY).tolerance("engine") == 0.25


def test_learning_without_a_profile_warns_once_per_reference(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.checks.calibration"):
        cal = _cal(None)
        cal.tolerance("independent")
        cal.tolerance("independent")
        cal.tolerance("engine")
        _cal(ENTRY).tolerance("independent")  # a profile entry: no warning
        Calibration("bfloat16", None, CalibrationConfig(samples=0)).tolerance("engine")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("no calibration profile" in w and "kv-sidecar calibrate"
                                    in w for w in warned)


# ---------------------------------------------------------------------- restart


def test_restart_with_a_saved_profile_beside_a_broken_engine_keeps_catching() -> None:
    flagged, tol = downcasting_run(str(SHIPPED_PROFILE))
    entry = load_profile(SHIPPED_PROFILE).find("tiny-llama", "bfloat16", None, "engine")
    assert entry is not None and tol <= entry.tolerance < 0.096  # under fp8's smallest error
    assert flagged > 0
    blind, tol_blind = downcasting_run(None)  # what an in-memory calibration learns
    assert tol_blind > entry.tolerance and blind < flagged


# ---------------------------------------------------------------------- shipped profile
def test_shipped_profile_covers_every_demo_model_and_dtype() -> None:
    """Measured twice: without AMX (the entries that do not name their kernels, written
    before ``kernels`` existed) and with it (``cpu:avx512+amx``); each measurement covers
    every model, dtype and write path."""
    prof = load_profile(SHIPPED_PROFILE)
    names = {"reference": "tiny-llama", "hybrid": "tiny-gemma2", "recurrent": "tiny-lfm2"}
    by_slot = {e.slot: e for e in prof.entries}
    assert {e.kernels for e in prof.entries} == {"", "cpu:avx512+amx"}
    for kernels in ("", "cpu:avx512+amx"):
        for dtype in ("float32", "bfloat16", "float16"):
            for model in names.values():
                for path, least in (("all", 500), ("prefill", 500), ("decode", 200)):
                    entry = by_slot.get((model, dtype, None, "engine", path, kernels))
                    assert entry is not None, (model, dtype, path, kernels)
                    assert entry.blocks >= least
                    assert entry.tolerance == pytest.approx(min(tolerance_for(dtype), max(
                        min_tolerance(dtype), entry.multiple * entry.floor)))
    # Without AMX the engine's own prefill is bit-exact on prefill-written blocks in bf16;
    # with AMX, on the recurrent model only (tiny-llama's differ by 0.008, tiny-gemma2's 0.026).
    for model in names.values():
        assert by_slot[(model, "bfloat16", None, "engine", "prefill", "")].floor == 0.0
    amx = {m: by_slot[(m, "bfloat16", None, "engine", "prefill", "cpu:avx512+amx")].floor
           for m in names.values()}
    assert amx["tiny-lfm2"] == 0.0 and 0.0 < amx["tiny-llama"] < 0.01
    assert sidecar_config(DemoOptions()).calibration_profile == str(SHIPPED_PROFILE)
    assert sidecar_config(DemoOptions(sidecar={"calibration_profile": ""})) \
        .calibration_profile is None


def test_calibrate_measures_a_clean_engine_and_refuses_too_few_blocks(tmp_path: Path) -> None:
    entries = {e.write_path: e for e in measure("reference", "float32", 12, 0, 4.0, 8)}
    assert "all" in entries and "prefill" in entries  # the engine reports its write paths
    assert entries["all"].blocks >= sum(e.blocks for p, e in entries.items() if p != "all")
    entry = entries["all"]
    assert entry.model == "tiny-llama" and entry.reference == "engine"
    assert entry.blocks >= 8 and 0 < entry.floor < 1e-4
    assert entry.tolerance == min_tolerance("float32")
    with pytest.raises(ValueError, match="clean blocks"):
        measure("reference", "float32", 2, 0, 4.0, 10_000)


def test_special_files_are_refused_before_a_byte_is_read(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """An outside check: ``--calibration-profile /dev/zero`` was read up to the 1 MiB cap
    and a FIFO blocked the start for ever; the profile is now read by the config file's
    reader (sidecar/config/toml_file.py read_small_file), which refuses them at once."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, says in [("/dev/zero", "/dev/zero is not a regular file"),
                       (str(fifo), "fifo is not a regular file"),
                       (str(tmp_path), "is a directory, not a file")]:
        got: list[str] = []

        def load(p: str = path, out: list[str] = got) -> None:
            try:
                load_profile(p)
            except ProfileError as exc:
                out.append(str(exc))

        t = threading.Thread(target=load, daemon=True)  # a FIFO's open blocked for ever
        t.start()
        t.join(60)
        assert got and says in got[0], (path, got)
    assert main(["demo", "--requests", "1", "--port", "0", "--quiet",
                 "--calibration-profile", "/dev/zero"]) == 2
    assert "calibration profile /dev/zero is not a regular file" in capsys.readouterr().err
