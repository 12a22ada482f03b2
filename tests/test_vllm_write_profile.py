"""``kv-sidecar vllm serve --write-profile FILE``: a trusted vLLM's noise floor written as a
calibration profile when the sidecar stops (the live run is tests/vllm/test_examples.py).
Here, without vLLM: the flags that would make the measurement lie are refused at start, a
file that is not a profile is never overwritten, and at exit a run that flagged anything or
verified too few blocks writes nothing, while a clean one writes the entries the profile
loader reads back (merged into the file's other entries)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.adapters.vllm.cli import _write_profile
from sidecar.checks.calibration import FloorState
from sidecar.checks.calibration_profile import (
    Profile,
    ProfileEntry,
    ProfileError,
    load_profile,
    save_profile,
)
from sidecar.checks.calibration_write import profile_to_extend
from sidecar.cli.main import main


def _serve(tmp_path: Path, *flags: str) -> int:
    return main(["vllm", "serve", "--model", str(tmp_path / "no-model"), "--dtype",
                 "bfloat16", "--block-size", "16", *flags])


@pytest.mark.parametrize("flags, says", [
    (["--calibration-profile", "p.json"], "drop --calibration-profile and --tolerance"),
    (["--tolerance", "bfloat16=0.1"], "drop --calibration-profile and --tolerance"),
    (["--reference", "none"], "needs a reference to measure"),
])
def test_flags_that_would_bias_the_measurement_are_refused(tmp_path, capsys, flags,
                                                          says) -> None:
    assert _serve(tmp_path, "--write-profile", str(tmp_path / "out.json"), *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "out.json").exists()


def test_a_file_that_is_not_a_profile_is_not_overwritten(tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    out.write_text("my notes, not a profile\n")
    assert _serve(tmp_path, "--write-profile", str(out)) == 2
    err = capsys.readouterr().err
    assert "--profile-replace" in err and str(out) in err
    assert out.read_text() == "my notes, not a profile\n"


@pytest.mark.parametrize("flag, value", [("--profile-multiple", "nan"),
                                         ("--profile-multiple", "0.5"),
                                         ("--profile-min-blocks", "0")])
def test_bad_profile_numbers_are_usage_errors(tmp_path, capsys, flag, value) -> None:
    """Out of range: argparse's usage error; not a finite number: the config layer's one
    line (every number, from a flag, env or TOML, goes through the same table)."""
    try:
        rc = _serve(tmp_path, "--write-profile", str(tmp_path / "o.json"), flag, value)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def _state(path: str, blocks: int, worst: float) -> FloorState:
    return FloorState("engine", "bfloat16", 0.25, 0.25, "fixed", 0, None, None,
                      clean_blocks=blocks, clean_max=worst, write_path=path)


def _sidecar(states: list[FloorState]) -> Any:
    info = SimpleNamespace(model="tiny-llama", kv_storage=None, engine="vllm")
    verifier = SimpleNamespace(reference_kind="engine",
                               calibration=SimpleNamespace(states=lambda: states))
    return SimpleNamespace(monitor=SimpleNamespace(info=info, verifier=verifier))


def _args(out: Path, min_blocks: int = 64) -> argparse.Namespace:
    return argparse.Namespace(write_profile=str(out), dtype="bfloat16", profile_multiple=3.0,
                              profile_min_blocks=min_blocks)


def test_a_clean_run_writes_its_floors_merged_into_the_file(tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    other = ProfileEntry(model="other-model", dtype="float32", reference="independent",
                         floor=1e-6,
                         tolerance=1e-5, blocks=100)
    save_profile(out, Profile((other,)))
    states = [_state("all", 300, 0.05), _state("prefill", 200, 0.0),
              _state("decode", 40, 0.02)]  # decode: under --profile-min-blocks, no entry
    rc = _write_profile(_args(out), _sidecar(states), {"anomalies": {}},
                        profile_to_extend(out, False, "--profile-replace"))
    assert rc == 0
    got = {(e.model, e.write_path): e for e in load_profile(out).entries}
    assert set(got) == {("other-model", "all"), ("tiny-llama", "all"),
                        ("tiny-llama", "prefill")}
    assert got[("tiny-llama", "prefill")].floor == 0.0
    assert got[("tiny-llama", "prefill")].tolerance == 0.0625  # the bf16 minimum, not 0
    assert got[("tiny-llama", "all")].tolerance == pytest.approx(0.15)  # 3 x the floor
    assert got[("tiny-llama", "all")].blocks == 300
    assert "wrote" in capsys.readouterr().err


@pytest.mark.parametrize("summary, states, says", [
    ({"anomalies": {"recompute_mismatch": 2}}, [("all", 300, 0.0)], "flagged 2 anomalies"),
    ({"anomalies": {}}, [("all", 10, 0.0)], "only 10 clean blocks"),
    ({"anomalies": {}}, [], "only 0 clean blocks"),
])
def test_an_untrustworthy_or_short_run_writes_nothing(tmp_path, capsys, summary, states,
                                                      says) -> None:
    out = tmp_path / "out.json"
    rc = _write_profile(_args(out), _sidecar([_state(*s) for s in states]), summary,
                        Profile(()))
    assert rc == 1 and not out.exists()
    err = capsys.readouterr().err
    assert "no profile written" in err and says in err, err


def test_the_written_file_is_a_profile_the_sidecar_loads(tmp_path) -> None:
    out = tmp_path / "out.json"
    assert _write_profile(_args(out, 1), _sidecar([_state("all", 5, 0.01)]),
                          {"anomalies": {}}, Profile(())) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "kv-sidecar-calibration/1" and len(doc["entries"]) == 1
    entry = load_profile(out).find("tiny-llama", "bfloat16", None, "engine", "all")
    assert entry is not None and entry.blocks == 5


def test_serve_without_traffic_stops_and_says_why_nothing_was_written(tmp_path, capsys) -> None:
    """The whole path, vLLM absent: the sidecar starts with --write-profile (its config
    built with the fixed table), runs, stops at --duration, and writes nothing: it verified
    no block."""
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "model")
    out = tmp_path / "out.json"
    rc = main(["vllm", "serve", "--model", str(model), "--dtype", "float32", "--block-size",
               "16", "--probe", f"ipc://{tmp_path}/p.sock", "--engine-url",
               "http://127.0.0.1:9", "--port", "0", "--duration", "0.5", "--write-profile",
               str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and not out.exists()
    assert "no profile written" in err and "only 0 clean blocks" in err, err[-2000:]


def test_the_engine_reference_without_its_engine_is_one_line_and_exit_2(tmp_path,
                                                                        capsys) -> None:
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "model")
    capsys.readouterr()
    rc = main(["vllm", "serve", "--model", str(model), "--dtype", "float32", "--block-size",
               "16", "--probe", f"ipc://{tmp_path}/p.sock", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--engine-url" in err[0], err


@pytest.mark.parametrize("replace", [False, True])
def test_a_path_no_profile_can_be_written_to_is_refused_at_start(tmp_path, replace) -> None:
    """Found from outside: --profile-replace skipped every check, and a missing directory
    surfaced only at exit, after the trusted run. Both are refused before the run."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "x.json")
    for path, says in ((tmp_path / "dir", "not a regular file"),
                       (fifo, "not a regular file"),
                       (Path("/dev/null"), "not a regular file"),
                       (tmp_path / "nodir" / "x.json", "does not exist"),
                       (tmp_path / "dangling", "link that leads nowhere")):
        with pytest.raises(ProfileError, match=says):
            profile_to_extend(path, replace, "--profile-replace")
    assert profile_to_extend(tmp_path / "new.json", replace, "--x") == Profile(())
