"""Issue 21, found again from outside: ``evidence list`` said ``KV yes`` for a tensor file
that ``evidence show`` refuses (a FIFO, a link), ``show`` held the tensor file about three
times in memory, and ``--plot ""`` was silently no plot."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

from sidecar.cli.main import main
from sidecar.evidence.cli import load_record
from sidecar.evidence.record import EvidenceLog, tensor_key, tensors_name
from sidecar.evidence.safetensors_io import dumps, loads


def _write(directory: Path, shape: tuple[int, ...] = (2, 3)) -> Path:
    log = EvidenceLog(capacity=10, directory=directory, max_bytes=1 << 30,
                      max_tensor_bytes=1 << 30)
    log.add({"kind": "test", "checks": ["recompute_mismatch"]},
            {tensor_key(0, 0, side, part): torch.randn(shape)
             for side in ("cached", "recomputed") for part in ("key", "value")})
    return directory / tensors_name(1)


def _listed(directory: Path, capsys) -> str:
    assert main(["evidence", "list", "--dir", str(directory), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    return str(row["tensors"])


def _fifo(tensors: Path) -> None:
    tensors.unlink()
    os.mkfifo(tensors)


def _link_to_a_copy(tensors: Path) -> None:
    """The very bytes the record states, but through a link: show refuses links."""
    copy = tensors.parent.parent / "elsewhere.safetensors"
    shutil.copyfile(tensors, copy)
    tensors.unlink()
    tensors.symlink_to(copy)


def _truncated(tensors: Path) -> None:
    with open(tensors, "r+b") as f:
        f.truncate(10)


@pytest.mark.parametrize("plant, says", [(_fifo, "FIFO"), (_link_to_a_copy, "symbolic link"),
                                         (_truncated, "is 10 bytes")])
def test_list_and_show_apply_one_rule_to_the_tensor_file(tmp_path, capsys, plant,
                                                         says) -> None:
    d = tmp_path / "evidence"
    tensors = _write(d)
    assert _listed(d, capsys) == "yes"
    plant(tensors)
    state = _listed(d, capsys)
    assert state.startswith("unreadable: ") and says in state, state
    assert main(["evidence", "show", "1", "--dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert state.removeprefix("unreadable: ") in err, (state, err)  # the same words
    assert main(["evidence", "list", "--dir", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith(state)


def test_a_record_without_tensors_still_lists_no_and_skipped(tmp_path, capsys) -> None:
    d = tmp_path / "evidence"
    EvidenceLog(capacity=10, directory=d).add({"kind": "test"})
    assert _listed(d, capsys) == "no"
    shutil.rmtree(d)
    EvidenceLog(capacity=10, directory=d, max_tensor_bytes=1).add(
        {"kind": "test"}, {tensor_key(0, 0, "cached", "key"): torch.zeros(4)})
    assert _listed(d, capsys) == "skipped"


def test_show_holds_the_tensor_file_once(tmp_path) -> None:
    """On 0f3bc04 ``load_record`` peaked at ~2.3x the file (chunks joined, then a copy per
    tensor); the file is now read into one buffer and the tensors are views of it."""
    d = tmp_path / "evidence"
    size = _write(d, (4, 8, 16, 512)).stat().st_size  # 4 x 1 MiB

    tracemalloc.start()
    try:
        _, tensors = load_record(d, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tensors is not None and len(tensors) == 4
    assert peak < 1.25 * size, (peak, size)


def test_a_bytearray_is_viewed_and_bytes_are_copied() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bool),
               "c": torch.zeros(0, 2, dtype=torch.bfloat16)}
    raw = dumps(tensors)
    shared = bytearray(raw)
    viewed, _ = loads(shared)
    copied, _ = loads(raw)
    assert all(torch.equal(viewed[k], v) and torch.equal(copied[k], v)
               for k, v in tensors.items())
    shared[:] = bytes(len(shared))  # the views see the buffer change: no copy was made
    assert viewed["a"].eq(0).all() and not viewed["b"].any()
    assert torch.equal(copied["a"], tensors["a"])


@pytest.mark.parametrize("path, says", [("", "expected a file path"),
                                        ("a\x00b.png", "NUL character")])
def test_a_plot_path_that_cannot_be_one_is_refused_while_parsing(tmp_path, capsys, path,
                                                                 says) -> None:
    d = tmp_path / "evidence"
    _write(d)
    with pytest.raises(SystemExit) as exc:
        main(["evidence", "show", "1", "--dir", str(d), "--plot", path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --plot: " in err and says in err, err


def test_list_names_an_invariant_violations_kind_and_blocks_and_shows_no_minus_zero(
        tmp_path, capsys) -> None:
    """Outside check: ``evidence list`` left CHECKS, GROUPS and BLOCKS blank for invariant
    violation records (they name their blocks in ``violations``), and printed ``-0``."""
    d = tmp_path / "evidence"
    log = EvidenceLog(capacity=10, directory=d)
    log.add({"type": "invariant_violation", "violations": [
        {"kind": "free_while_held", "group": 0, "block_id": 36, "generation": 2},
        {"kind": "double_free", "group": 0, "block_id": None, "generation": 0}]})
    log.add({"kind": "test", "checks": ["recompute_mismatch"],
             "errors": {"max_error": -0.0, "tolerance": 0.0625}})
    assert main(["evidence", "list", "--dir", str(d), "--json"]) == 0
    first, _ = json.loads(capsys.readouterr().out)
    assert first["checks"] == ["double_free", "free_while_held"]
    assert first["groups"] == [0] and first["blocks"] == [36]
    assert main(["evidence", "list", "--dir", str(d)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "double_free,free_while_h" in table[1] and " 36 " in table[1]
    assert table[2].split()[-3:] == ["0", "0.0625", "no"]  # MAX ERR, TOL, KV
