"""Issue 21 breaks 3-5: the evidence directory as an attacker (or bad luck) leaves it.

The writer never writes through a planted link and refuses a directory others can write;
``evidence list`` lists every good record beside hostile neighbours (links out, /dev/zero,
FIFOs, sparse giants, bad field types, deep nesting) and says why each bad one is bad;
``evidence show`` refuses crafted safetensors with a message, never a traceback; ``--plot``
refuses what is too large to draw and bad tolerances or tensor names."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sidecar.cli.main import main
from sidecar.evidence.files import EvidenceDirRefused
from sidecar.evidence.record import EvidenceLog, tensor_key
from sidecar.evidence.safetensors_io import SafetensorsError, dumps, loads


def _record(seq: int, **fields: object) -> dict:
    return {"seq": seq, "time": 1_700_000_000.0, "engine": "toy", "checks": ["content"],
            "blocks": [{"group": 0, "index": 0, "block_id": 7, "condemned": True}],
            "errors": {"max_error": 0.5, "tolerance": 0.01}, **fields}


def _plant_record(directory: Path, seq: int, body: bytes) -> Path:
    path = directory / f"anomaly-{seq:08d}.json"
    path.write_bytes(body)
    return path


# ------------------------------------------------------------------ writer (break 3)
def test_a_planted_link_at_the_next_tmp_name_is_never_written_through(tmp_path) -> None:
    directory = tmp_path / "evidence"
    log = EvidenceLog(capacity=10, directory=directory)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (directory / "anomaly-00000001.json.tmp").symlink_to(victim)
    (directory / "anomaly-00000001.safetensors.tmp").symlink_to(victim)
    rec = log.add({"kind": "test"}, {"t": torch.ones(2)})
    assert victim.read_text() == "precious"
    assert log.write_errors == 0
    written = directory / "anomaly-00000001.json"
    assert not written.is_symlink() and json.loads(written.read_text())["seq"] == rec["seq"]
    assert (written.stat().st_mode & 0o777) == 0o600


def test_the_sidecar_creates_its_directory_0700_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0)
    try:
        EvidenceLog(capacity=1, directory=tmp_path / "a" / "evidence")
    finally:
        os.umask(old)
    assert ((tmp_path / "a" / "evidence").stat().st_mode & 0o777) == 0o700


def test_a_world_writable_directory_is_refused_with_a_clear_message(tmp_path, capsys) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(EvidenceDirRefused, match="world-writable"):
        EvidenceLog(capacity=1, directory=shared)
    assert list(shared.iterdir()) == []
    rc = main(["demo", "--requests", "2", "--quiet", "--port", "0", "--evidence-dir",
               str(shared)])
    err = capsys.readouterr().err
    assert rc == 2 and "world-writable" in err and "Traceback" not in err


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:  # cannot give a directory away: be another user instead
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(theirs).st_uid + 1)
    with pytest.raises(EvidenceDirRefused, match="not by this user"):
        EvidenceLog(capacity=1, directory=theirs)


# ------------------------------------------------------------------ reader (break 4)
def _hostile_directory(tmp_path: Path) -> tuple[Path, dict[int, str]]:
    """Record 1 good, 9 good too; every number between is hostile. Returns the directory and
    a word each hostile record's reason must contain."""
    d = tmp_path / "evidence"
    d.mkdir(mode=0o700)
    _plant_record(d, 1, json.dumps(_record(1)).encode())
    _plant_record(d, 9, json.dumps(_record(9)).encode())
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(_record(2, engine="SECRET-OUTSIDE")))
    (d / "anomaly-00000002.json").symlink_to(outside)
    (d / "anomaly-00000003.json").symlink_to("/dev/zero")
    os.mkfifo(d / "anomaly-00000004.json")
    with open(d / "anomaly-00000005.json", "wb") as f:
        f.truncate(10 * 2**30)  # sparse: costs nothing on disk, 10 GiB to a naive read
    _plant_record(d, 6, json.dumps(_record(6, time=float("nan"))).encode())
    _plant_record(d, 7, json.dumps(_record(7, engine=["a", "list"])).encode())
    _plant_record(d, 8, b"[" * 2000 + b"]" * 2000)
    _plant_record(d, 10, json.dumps(_record(10, blocks=[{"group": "zero"}])).encode())
    _plant_record(d, 11, json.dumps(_record(11, errors={"tolerance": "abc"})).encode())
    _plant_record(d, 12, b"\xff\xfe not utf-8")
    _plant_record(d, 13, json.dumps(_record(99)).encode())
    _plant_record(d, 14, json.dumps(_record(14, time=1e300)).encode())
    _plant_record(d, 15, json.dumps(_record(15, checks="content")).encode())
    _plant_record(d, 16, b'{"seq": 16, "x": ' + b"9" * 5000 + b"}")
    (d / "anomaly-00000017.json").mkdir()
    return d, {2: "symbolic link", 3: "symbolic link", 4: "FIFO", 5: "limit", 6: "time",
               7: "engine", 8: "deep", 10: "group", 11: "tolerance", 12: "not JSON",
               13: "file name", 14: "time", 15: "checks", 16: "not JSON", 17: "directory"}


def _limited() -> None:  # a reader that reads /dev/zero or 10 GiB dies here, not the host
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_list_survives_every_hostile_neighbour_and_says_why(tmp_path) -> None:
    d, why = _hostile_directory(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "evidence", "list", "--dir",
                           str(d), "--json"], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["id"]: r for r in json.loads(proc.stdout)}
    assert {i for i, r in rows.items() if "unreadable" not in r} == {1, 9}
    assert rows[1]["engine"] == "toy" and rows[9]["max_error"] == 0.5
    for seq, word in why.items():
        assert word in rows[seq]["unreadable"], (seq, rows[seq])
    assert "SECRET-OUTSIDE" not in proc.stdout
    text = subprocess.run([sys.executable, "-m", "sidecar.cli", "evidence", "list", "--dir",
                           str(d)], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited)
    assert text.returncode == 0 and "Traceback" not in text.stderr
    lines = text.stdout.splitlines()[1:]
    assert [int(line.split()[0]) for line in lines] == sorted([1, 9, *why])
    assert sum("unreadable" in line for line in lines) == len(why)


@pytest.mark.parametrize("seq", [2, 6, 7, 8, 11, 12])  # 3 (/dev/zero): the list test
def test_show_of_a_hostile_record_is_exit_2_with_the_reason(tmp_path, capsys, seq) -> None:
    d, why = _hostile_directory(tmp_path)
    assert main(["evidence", "show", str(seq), "--dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "not a readable record" in err and why[seq] in err


# ------------------------------------------------------------------ crafted safetensors
def _header_file(header: object, body: bytes = b"", raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _entry(dtype: object = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


CRAFTED = {
    "negative shape": _header_file({"t": _entry(shape=(-1, -2))}, bytes(8)),
    "2**63 shape": _header_file({"t": _entry(shape=(2**63, 0))}, bytes(8)),
    "2**63 offsets": _header_file({"t": _entry(offsets=(2**63, 2**63 + 8))}, bytes(8)),
    "huge zero-size": _header_file({"t": _entry(shape=(0, 2**40, 2**40), offsets=(0, 0))}),
    "bool shape": _header_file({"t": _entry(shape=[True, True])}, bytes(8)),
    "float shape": _header_file({"t": _entry(shape=[2.0])}, bytes(8)),
    "string shape": _header_file({"t": _entry(shape="2")}, bytes(8)),
    "unknown dtype": _header_file({"t": _entry(dtype="F128")}, bytes(8)),
    "dtype list": _header_file({"t": _entry(dtype=["F32"])}, bytes(8)),
    "nested header": _header_file({"t": {"t": _entry()}}, bytes(8)),
    "deep header": _header_file(None, bytes(8), raw=b"[" * 3000 + b"]" * 3000),
    "metadata list": _header_file({"__metadata__": ["a"], "t": _entry()}, bytes(8)),
    "metadata nested": _header_file({"__metadata__": {"a": {"b": 1}}, "t": _entry()},
                                    bytes(8)),
    "overlap": _header_file({"a": _entry(), "b": _entry(offsets=(4, 12))}, bytes(12)),
    "hole": _header_file({"a": _entry(offsets=(4, 12))}, bytes(12)),
    "three offsets": _header_file({"t": _entry(offsets=(0, 4, 8))}, bytes(8)),
    "header length past end": struct.pack("<Q", 2**63) + b"{}",
    "header not object": _header_file([1, 2]),
    "extra entry key": _header_file({"t": {**_entry(), "x": 1}}, bytes(8)),
    "nine dims": _header_file({"t": _entry(shape=(1,) * 9, offsets=(0, 4))}, bytes(4)),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_safetensors_are_refused_before_allocating(name) -> None:
    with pytest.raises(SafetensorsError):
        loads(CRAFTED[name])


def test_show_refuses_crafted_tensor_files_with_exit_2(tmp_path, capsys) -> None:
    import hashlib

    d = tmp_path / "evidence"
    d.mkdir(mode=0o700)
    for seq, name in enumerate(sorted(CRAFTED), start=1):
        blob = CRAFTED[name]
        (d / f"anomaly-{seq:08d}.safetensors").write_bytes(blob)
        _plant_record(d, seq, json.dumps(_record(seq, tensors={
            "file": f"anomaly-{seq:08d}.safetensors", "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest()})).encode())
        assert main(["evidence", "show", str(seq), "--dir", str(d)]) == 2, name
        err = capsys.readouterr().err
        assert f"anomaly-{seq:08d}.safetensors" in err and "Traceback" not in err, name


def test_the_writers_files_still_load() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.zeros(0, 4, dtype=torch.bfloat16), "c": torch.ones(3, dtype=torch.bool)}
    back, meta = loads(dumps(tensors, {"k": "v"}))
    assert meta == {"k": "v"} and all(torch.equal(back[k], v) for k, v in tensors.items())


# ------------------------------------------------------------------ --plot (break 5)
def _plot_record(tmp_path: Path, tensors: dict[str, torch.Tensor],
                 tolerance: object = 0.01) -> Path:
    d = tmp_path / "evidence"
    log = EvidenceLog(capacity=10, directory=d)
    log.add({"kind": "test", "checks": ["recompute_mismatch"],
             "errors": {"tolerance": tolerance, "max_error": 1.0}}, tensors)
    return d


def _pair(shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
          names: tuple[str, str] = ("cached", "recomputed")) -> dict[str, torch.Tensor]:
    out = {}
    for side in names:
        for part in ("key", "value"):
            out[tensor_key(0, 0, side, part)] = torch.zeros(shape, dtype=dtype)
    return out


def test_plot_of_2000_layers_by_2000_heads_is_refused_as_too_large(tmp_path, capsys) -> None:
    d = _plot_record(tmp_path, _pair((2000, 2000, 1, 1), torch.uint8))
    log = EvidenceLog(capacity=10, directory=d)
    assert log.files == [1]
    assert main(["evidence", "show", "1", "--dir", str(d), "--plot",
                 str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "too large to plot" in err and "2000 layers x 2000 heads" in err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("tolerance", ["abc", float("inf"), -1.0, True])
def test_plot_with_a_bad_tolerance_is_exit_2(tmp_path, capsys, tolerance) -> None:
    d = _plot_record(tmp_path, _pair((2, 2, 4, 8)), tolerance)
    assert main(["evidence", "show", "1", "--dir", str(d), "--plot",
                 str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "tolerance" in err and "Traceback" not in err


@pytest.mark.parametrize("bad", ["gX.b0.recomputed.key", "g0.bY.recomputed.key",
                                 "g0.b0.recomputed", "g0.b0.cached.key.extra",
                                 "g" + "9" * 5000 + ".b0.recomputed.key"])
def test_plot_with_a_malformed_tensor_name_is_exit_2(tmp_path, capsys, bad) -> None:
    tensors = _pair((2, 2, 4, 8))
    tensors[bad] = torch.zeros(2, 2, 4, 8)
    d = _plot_record(tmp_path, tensors)
    assert main(["evidence", "show", "1", "--dir", str(d), "--plot",
                 str(tmp_path / "p.png")]) == 2
    assert "is not named" in capsys.readouterr().err


def test_plot_of_a_normal_record_still_draws(tmp_path, capsys) -> None:
    tensors = _pair((2, 2, 4, 8))
    tensors[tensor_key(0, 0, "cached", "value")][1, 1, 2, 3] = 5.0
    tensors[tensor_key(0, 0, "recomputed", "value")] += 1.0
    d = _plot_record(tmp_path, tensors)
    assert main(["evidence", "show", "1", "--dir", str(d), "--json", "--plot",
                 str(tmp_path / "p.png")]) == 0
    plot = json.loads(capsys.readouterr().out)["plot"]
    assert (plot["layer"], plot["head"], plot["kv"], plot["token"]) == (1, 1, "V", 2)


def test_plot_with_a_huge_finite_tolerance_still_draws(tmp_path, capsys) -> None:
    """An outside check: tolerance 1e308 (finite, >= 0) overflowed the float32 clamp."""
    d = _plot_record(tmp_path, _pair((2, 2, 4, 8)), 1e308)
    assert main(["evidence", "show", "1", "--dir", str(d), "--json", "--plot",
                 str(tmp_path / "p.png")]) == 0
    assert json.loads(capsys.readouterr().out)["plot"]["scale_top"] > 0


@pytest.mark.parametrize("shape", [(0, 2, 16, 16), (2, 2, 4, 0)])
def test_plot_of_an_empty_shape_is_exit_2_and_writes_nothing(tmp_path, capsys, shape) -> None:
    d = _plot_record(tmp_path, _pair(shape))
    assert main(["evidence", "show", "1", "--dir", str(d), "--plot",
                 str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err  # an empty shape (or one no body fits): one line
    assert "shape" in err and "Traceback" not in err
    assert not (tmp_path / "p.png").exists()


def test_a_header_of_a_million_tensors_is_refused() -> None:
    header = {f"t{i}": _entry(shape=(0,), offsets=(0, 0)) for i in range(70_000)}
    with pytest.raises(SafetensorsError, match="tensors, over the limit"):
        loads(_header_file(header))


def test_a_link_to_the_directory_planted_by_another_user_is_refused(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a link to another user")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "evidence"
    link.symlink_to(mine)
    os.lchown(link, 65534, 65534)
    with pytest.raises(EvidenceDirRefused, match="symbolic link owned by uid 65534"):
        EvidenceLog(capacity=1, directory=link)
