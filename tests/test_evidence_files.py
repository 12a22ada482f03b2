"""Issue 13 item 3: evidence you can open. Each anomaly record names the check, group, blocks
and epochs, carries the error statistics, the lifecycle around the block and the cached and
recomputed KV (safetensors); record and tensors survive SIGKILL together or not at all;
``kv-sidecar evidence list|show --plot`` reads it back and draws where the block is wrong."""

from __future__ import annotations

import importlib.machinery
import itertools
import json
import os
import random
import sys

import pytest
import torch
from kvtestbed.bench.evidence_kill import kill_cycles

from sidecar.cli.main import main
from sidecar.core import extras
from sidecar.evidence.plot import LEVELS, cell_centre, colormap
from sidecar.evidence.record import EvidenceLog, tensor_key
from sidecar.evidence.safetensors_io import dumps, loads
from tests.conftest import make_toy
from tests.toy import BS, DIM, HEADS, LAYERS, reference_kv

PROMPT = list(range(1, 17))  # 4 full blocks of 4 tokens


def _corrupt_and_verify(tmp_path, position: tuple[int, int, int, int], part: int = 0,
                        index: int = 1, delta: float = 0.5):
    """Serve PROMPT, add ``delta`` at (layer, head, token, dim) of block ``index``'s K
    (``part`` 0) or V (1), verify the hit: one anomaly record."""
    engine, _, mon = make_toy(evidence_dir=tmp_path, blocks_per_sample=4)
    engine.serve(PROMPT)
    block = engine.index[tuple(PROMPT[: (index + 1) * BS])]
    engine.kv[block][part][position] += delta
    verdict = mon.verify(engine.serve(PROMPT + [3]))
    return engine, mon, block, verdict


def _show(tmp_path, capsys, *extra: str) -> dict:
    assert main(["evidence", "show", "1", "--dir", str(tmp_path), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_record_names_check_blocks_epochs_errors_lifecycle_and_kv(tmp_path, capsys) -> None:
    _, mon, block, verdict = _corrupt_and_verify(tmp_path, (1, 0, 2, 5))
    assert [f.kind.value for f in verdict.findings] == ["recompute_mismatch"]
    out = _show(tmp_path, capsys)
    rec = out["record"]
    assert rec["checks"] == ["recompute_mismatch"]
    condemned = [b for b in rec["blocks"] if b["condemned"]]
    assert condemned == [{"group": 0, "index": 1, "block_id": block,
                          "epoch": mon.verifier.epoch_of(0, block), "generation": 1,
                          "condemned": True}]
    assert condemned[0]["epoch"] is not None
    assert rec["errors"]["tolerance"] == pytest.approx(mon.verifier.tolerance)
    assert rec["errors"]["max_error"] > rec["errors"]["tolerance"]
    assert len(rec["errors"]["per_block"]) == 4
    assert [e["op"] for e in rec["lifecycle"][f"0:{block}"]] == ["store", "hit"]
    assert rec["lifecycle_left_out"] == {}  # the whole path is there
    assert "tokens" not in rec and rec["tokens_digest"]
    # the tensor file is real safetensors: the reference implementation reads it
    st = pytest.importorskip("safetensors.torch")
    tensors = st.load_file(str(tmp_path / rec["tensors"]["file"]))
    ref_k, ref_v = reference_kv(PROMPT, 1, torch.float32)
    assert torch.equal(tensors[tensor_key(0, 1, "recomputed", "key")], ref_k)
    assert torch.equal(tensors[tensor_key(0, 1, "recomputed", "value")], ref_v)
    cached = tensors[tensor_key(0, 1, "cached", "key")]
    assert (cached != ref_k).nonzero().tolist() == [[1, 0, 2, 5]]
    assert out["tensors"][tensor_key(0, 1, "cached", "key")] == {
        "dtype": "float32", "shape": [LAYERS, HEADS, BS, DIM]}
    assert main(["evidence", "list", "--dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert len(listing) == 2 and "recompute_mismatch" in listing[1] and listing[1].endswith("yes")


def _levels(png_path, plot: dict) -> dict[tuple[int, int, int, int], int]:
    """Each cell's colour level, read back from the PNG with matplotlib's own reader: the
    nearest colour of the plot's scale at the cell's centre pixel."""
    image = pytest.importorskip("matplotlib.image").imread(str(png_path))[:, :, :3]
    lay = plot["layout"]
    assert image.shape[:2] == (lay["height"], lay["width"])
    scale = torch.tensor(colormap()(list(range(LEVELS)))[:, :3], dtype=torch.float32)
    cells = {}
    for key in itertools.product(range(lay["layers"]), range(lay["heads"]), (0, 1),
                                 range(lay["tokens"])):
        x, y = cell_centre(lay, *key)
        rgb = torch.tensor(image[y, x], dtype=torch.float32)
        distance, level = ((scale - rgb) ** 2).sum(dim=1).min(dim=0)
        assert float(distance) < 1e-3, f"cell {key} at ({x}, {y}) is not a scale colour"
        cells[key] = int(level)
    return cells


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plot_hottest_cell_is_the_corrupted_position(tmp_path, capsys, seed) -> None:
    pytest.importorskip("matplotlib")
    rng = random.Random(seed)
    layer, head, token, dim = (rng.randrange(n) for n in (LAYERS, HEADS, BS, DIM))
    part = rng.randrange(2)
    _corrupt_and_verify(tmp_path, (layer, head, token, dim), part=part,
                        delta=rng.uniform(0.3, 3.0))
    png = tmp_path / "out.png"
    plot = _show(tmp_path, capsys, "--plot", str(png))["plot"]
    cells = _levels(png, plot)
    hottest = max(cells, key=lambda c: cells[c])
    assert hottest == (layer, head, part, token)
    # the hot cell is over the tolerance (the upper half of the scale), every other under it
    assert sorted(cells.values())[-2] < LEVELS // 2 <= cells[hottest]
    assert (plot["layer"], plot["head"], plot["kv"], plot["token"]) == \
        (layer, head, "KV"[part], token)
    assert (plot["block"], plot["position"]) == (1, BS + token)


def test_plot_names_its_axes_tolerance_block_and_kind(tmp_path, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda fig, *a, **k: (drawn.append(fig), real_savefig(fig, *a, **k)))
    _corrupt_and_verify(tmp_path, (1, 0, 2, 5))
    plot = _show(tmp_path, capsys, "--plot", str(tmp_path / "out.png"))["plot"]
    [fig] = drawn
    grid, bar = fig.axes[0], fig.axes[-1]
    assert "layer" in grid.get_ylabel() and "token" in grid.get_xlabel()
    [heads] = grid.child_axes  # the secondary x axis on top: one label per KV head
    assert "head 0" in [t.get_text() for t in heads.get_xticklabels()]
    title = fig._suptitle.get_text()
    assert "recompute_mismatch" in title and "block #1" in title
    assert f"tolerance {plot['tolerance']:.3g}" in [t.get_text() for t in bar.get_yticklabels()]


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch) -> None:
    _corrupt_and_verify(tmp_path, (1, 0, 2, 5))
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("matplotlib") else
                        importlib.machinery.PathFinder.find_spec(name))
    code = main(["evidence", "show", "1", "--dir", str(tmp_path), "--plot",
                 str(tmp_path / "out.png")])
    assert code == 2
    err = capsys.readouterr().err
    assert "kv-sidecar[plot]" in err and "Traceback" not in err


def test_sigkill_at_20_random_moments_leaves_no_partial_record(tmp_path) -> None:
    res = kill_cycles(20, capacity=30, seed=7)
    assert (res.cases, res.survived, res.lost, res.escaped) == (20, 20, 0, 0), res.tried


def _tensors(n: int) -> dict[str, torch.Tensor]:
    return {tensor_key(0, 0, side, part): torch.full((2, 2, 4, n), 1.0)
            for side in ("cached", "recomputed") for part in ("key", "value")}


def test_bounds_count_bytes_tensors_and_orphans(tmp_path) -> None:
    log = EvidenceLog(capacity=10, directory=tmp_path, max_bytes=40_000,
                      max_tensor_bytes=5_000)
    for i in range(30):
        log.add({"kind": "t", "i": i}, _tensors(64))  # 8 KiB of tensors: over the cap
        log.add({"kind": "t", "i": i}, _tensors(16))  # 2 KiB: kept
    names = os.listdir(tmp_path)
    assert sum((tmp_path / n).stat().st_size for n in names) <= 40_000
    records = sorted(n for n in names if n.endswith(".json"))
    assert len(records) <= 10 and records[-1] == "anomaly-00000060.json"
    skipped = json.loads((tmp_path / "anomaly-00000059.json").read_text())["tensors"]
    assert "skipped" in skipped and not (tmp_path / "anomaly-00000059.safetensors").exists()
    assert (tmp_path / "anomaly-00000060.safetensors").exists()
    # leftovers of kills: tensors without a record, a record .tmp with / without its tensors
    (tmp_path / "anomaly-00000001.safetensors").write_bytes(b"orphan")
    blob = dumps(_tensors(2))
    good = {"seq": 61, "tensors": {"file": "anomaly-00000061.safetensors",
                                   "bytes": len(blob), "sha256": __import__(
                                       "hashlib").sha256(blob).hexdigest()}}
    (tmp_path / "anomaly-00000061.safetensors.tmp").write_bytes(blob)
    (tmp_path / "anomaly-00000061.json.tmp").write_text(json.dumps(good))
    (tmp_path / "anomaly-00000062.json.tmp").write_text(json.dumps(
        {**good, "seq": 62, "tensors": {**good["tensors"], "file": "x"}}))
    (tmp_path / "anomaly-00000062.safetensors.tmp").write_bytes(blob[:-3])  # cut short
    log2 = EvidenceLog(capacity=10, directory=tmp_path, max_bytes=40_000)
    assert log2.recovered == 1 and log2.discarded == 2
    names = set(os.listdir(tmp_path))
    assert "anomaly-00000061.json" in names and "anomaly-00000061.safetensors" in names
    assert not any(n.endswith(".tmp") for n in names)
    assert not any(n.startswith(("anomaly-00000062", "anomaly-00000001.")) for n in names)
    assert loads((tmp_path / "anomaly-00000061.safetensors").read_bytes())[0].keys() == \
        _tensors(2).keys()


def test_safetensors_round_trip_every_dtype() -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {f"t{i}": torch.randn(3, 5).to(dtype) for i, dtype in enumerate(
        (torch.float32, torch.float16, torch.bfloat16, torch.float64))}
    tensors["ids"] = torch.arange(7)
    blob = dumps(tensors, {"a": "b"})
    for name, t in st.load(blob).items():
        assert torch.equal(t, tensors[name])
    back, meta = loads(st.save(tensors, {"a": "b"}))
    assert meta == {"a": "b"} and all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError):
        loads(blob[:-1])


def test_cli_errors_are_exit_2(tmp_path, capsys) -> None:
    assert main(["evidence", "list", "--dir", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["evidence", "list", "--dir", str(tmp_path)]) == 0
    assert "no evidence records" in capsys.readouterr().out
    assert main(["evidence", "show", "7", "--dir", str(tmp_path)]) == 2
    assert "no evidence record 7" in capsys.readouterr().err
    assert main(["evidence", "show", "x1", "--dir", str(tmp_path)]) == 2
    # zeroed block: condemned by the content check before the recompute -> nothing to plot
    engine, _, mon = make_toy(evidence_dir=tmp_path, blocks_per_sample=4)
    engine.serve(PROMPT)
    block = engine.index[tuple(PROMPT[:8])]
    engine.kv[block][0].zero_()
    engine.kv[block][1].zero_()
    mon.verify(engine.serve(PROMPT + [3]))
    assert main(["evidence", "show", "1", "--dir", str(tmp_path), "--plot",
                 str(tmp_path / "p.png")]) == 2
    assert "before the recompute" in capsys.readouterr().err
    tensors = tmp_path / "anomaly-00000001.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1  # the size the record states, another SHA-256
    tensors.write_bytes(bytes(data))
    assert main(["evidence", "show", "1", "--dir", str(tmp_path)]) == 2
    assert "SHA-256" in capsys.readouterr().err
    tensors.write_bytes(b"tampered")
    assert main(["evidence", "show", "1", "--dir", str(tmp_path)]) == 2
    assert "is 8 bytes, the record states" in capsys.readouterr().err


def test_reference_engine_fault_evidence_plots_its_worst_cell(tmp_path, capsys) -> None:
    """The real path: the demo's reference engine (a random-init Llama) with a storage
    fault, evidence on disk, `evidence show --plot` on it; the hottest cell the plot names is
    the largest normalised difference computed here from the safetensors, independently."""
    assert main(["demo", "--fault", "storage-downcast", "--requests", "60", "--quiet",
                 "--port", "0", "--json", "--evidence-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    out = _show(tmp_path, capsys, "--plot", str(tmp_path / "p.png"))
    rec, plot = out["record"], out["plot"]
    assert rec["engine"] == "reference" and "recompute_mismatch" in rec["checks"]
    st = pytest.importorskip("safetensors.torch")
    tensors = st.load_file(str(tmp_path / rec["tensors"]["file"]))
    best = (-1.0, None)
    for name in tensors:
        g, b, side, part = name.split(".")
        if side != "cached":
            continue
        ref = tensors[f"{g}.{b}.recomputed.{part}"]
        rms = float(ref.norm()) / ref.numel() ** 0.5
        diff = (tensors[name] - ref).abs().amax(dim=3) / rms  # layers x heads x tokens
        v, flat = diff.max(), int(diff.argmax())
        if float(v) > best[0]:
            layer, rest = divmod(flat, diff.shape[1] * diff.shape[2])
            head, token = divmod(rest, diff.shape[2])
            best = (float(v), (int(b[1:]), layer, head, part[0].upper(), token))
    assert (plot["block"], plot["layer"], plot["head"], plot["kv"], plot["token"]) == best[1]
    assert plot["value"] == pytest.approx(best[0], rel=1e-5) and plot["value"] > plot["tolerance"]
