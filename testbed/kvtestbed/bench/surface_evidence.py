"""Evidence surfaces of ``kv-sidecar bench reliability``: the reader (``evidence list`` /
``show`` / ``--plot``) against a directory full of hostile files, and the writer against
planted names and unsafe directories. Every case is checked, not just survived:

* reader: a good record must list with exactly the fields written; a hostile one must be
  listed as unreadable with a reason (links, FIFOs, devices, giants never as good), and
  the two good sentinels of each batch must still list; a crafted safetensors file must
  load consistently (every tensor the size its header says) or be refused;
* writer: a planted link's target is never changed; each record is on disk and reads back,
  or counted in ``write_errors`` with the record kept in memory; an unsafe directory is
  refused with a message.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtestbed.bench.fuzz import mutate_bytes
from kvtestbed.bench.fuzz import mutate_obj as _mutate_obj
from kvtestbed.bench.surfaces import SurfaceResult
from sidecar.evidence.cli import EvidenceError, format_list, summary_line, write_plot
from sidecar.evidence.files import EvidenceDirRefused
from sidecar.evidence.read import read_record, scan_records
from sidecar.evidence.record import EvidenceLog, record_name, tensor_key, tensors_name
from sidecar.evidence.safetensors_io import DTYPES, SafetensorsError, dumps, loads

BATCH = 250
SCAN_DEADLINE_S = 60.0  # one batch scan; a blocking read (a FIFO) would pass it
SPECIAL = ("link_dev_zero", "link_outside", "fifo", "sparse_10g", "directory", "dangling",
           "empty", "not_utf8")


def mutate_obj(obj: Any, rng: random.Random) -> Any:
    """:func:`kvtestbed.bench.fuzz.mutate_obj`, retried when it builds an unhashable key."""
    for _ in range(10):
        try:
            return _mutate_obj(obj, rng)
        except TypeError:
            continue
    return obj


def _scratch() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else None
    return Path(tempfile.mkdtemp(prefix="kvsidecar-bench-", dir=base))


def _good(seq: int) -> dict[str, Any]:
    return {"seq": seq, "time": 1_700_000_000.0 + seq, "engine": "reference", "model": "m",
            "checks": ["recompute_mismatch"], "findings": [{"kind": "recompute_mismatch"}],
            "blocks": [{"group": 0, "index": 1, "block_id": seq % 97, "condemned": True}],
            "errors": {"max_error": 0.5, "tolerance": 0.01, "duration_s": 0.001}}


def _special(kind: str, path: Path, outside: Path) -> None:
    if kind == "link_dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "link_outside":
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "sparse_10g":
        with open(path, "wb") as f:
            f.truncate(10 * 2**30)
    elif kind == "directory":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(path.with_name("nowhere"))
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(b"\xff\xfe\x00 not utf-8 " + bytes(range(256)))


def evidence_reader(quick: bool, seed: int) -> SurfaceResult:
    n = 500 if quick else 12_000
    res = SurfaceResult("evidence_reader", "mutated records, links out and to /dev/zero, "
                        "FIFOs, 10 GiB sparse files, crafted safetensors, plot bounds -> "
                        "evidence list/show/--plot", min_cases=n)
    rng = random.Random(seed)
    root = _scratch()
    outside = root / "outside.json"
    outside.write_text(json.dumps(_good(1)))
    kinds: dict[str, int] = {}
    try:
        for start in range(0, n, BATCH):
            d = root / f"b{start}"
            d.mkdir(mode=0o700)
            expect: dict[int, str] = {}  # seq -> "good" | "bad" | "any"
            written: dict[int, dict[str, Any]] = {}
            for seq in (1, 2):  # sentinels: must list exactly, whatever is beside them
                written[seq] = _good(seq)
                (d / record_name(seq)).write_text(json.dumps(written[seq]))
            for i in range(min(BATCH, n - start)):
                seq = 10 + i
                path = d / record_name(seq)
                r = rng.random()
                if r < 0.1:
                    kind = SPECIAL[i % len(SPECIAL)]
                    _special(kind, path, outside)
                    expect[seq] = "bad"
                elif r < 0.25:
                    kind = "valid"
                    written[seq] = _good(seq)
                    path.write_text(json.dumps(written[seq]))
                    expect[seq] = "good"
                else:
                    kind = "mutated"
                    body = mutate_obj(_good(seq), rng)
                    try:
                        data = json.dumps(body, default=str).encode() if rng.random() < 0.7 \
                            else mutate_bytes(json.dumps(_good(seq)).encode(), rng)
                    except (TypeError, ValueError, RecursionError):
                        data = mutate_bytes(json.dumps(_good(seq)).encode(), rng)
                    path.write_bytes(data)
                    expect[seq] = "any"
                kinds[kind] = kinds.get(kind, 0) + 1
            _check_batch(res, d, expect, written)
            shutil.rmtree(d)
        _safetensors_cases(res, rng, n)
        _plot_cases(res, rng, root, 20 if quick else 200)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res.figures["kinds"] = kinds
    return res


def _check_batch(res: SurfaceResult, d: Path, expect: dict[int, str],
                 written: dict[int, dict[str, Any]]) -> None:
    res.cases += len(expect)
    started = time.monotonic()
    try:
        good, bad = scan_records(d)
        text = format_list(good, bad, d)  # what `evidence list` prints
        json.dumps([summary_line(r, d) for r in good] + [u.as_dict() for u in bad])
    except Exception:
        res.escaped += len(expect)
        return
    if time.monotonic() - started > SCAN_DEADLINE_S:
        res.hangs += 1
    listed = {r["seq"]: r for r in good}
    refused = {u.seq: u for u in bad}
    for seq in (1, 2):
        res.check(listed.get(seq) == written[seq], f"sentinel record {seq} lists as written")
    res.check(text.count("\n") + 1 == 1 + len(good) + len(bad), "one line per record")
    for seq, want in expect.items():
        if seq in listed and seq in refused:
            continue  # both: lost
        if seq in listed:
            ok = want != "bad" and (want != "good" or listed[seq] == written[seq])
        elif seq in refused:
            ok = want != "good" and bool(refused[seq].reason)
        else:
            ok = False  # silently skipped: lost
        res.answered += ok
        if not ok:
            res.figures.setdefault("lost_examples", []).append(seq)


def _valid_tensors(rng: random.Random) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(rng.randint(1, 4)):
        dtype = rng.choice(list(DTYPES))
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        out[f"t{i}"] = torch.zeros(shape, dtype=dtype)
    return out


def _safetensors_cases(res: SurfaceResult, rng: random.Random, n: int) -> None:
    """Crafted safetensors (mutated headers, mutated bytes) -> loads: consistent or
    refused with SafetensorsError."""
    loaded = refused = 0
    for _ in range(n):
        blob = dumps(_valid_tensors(rng), {"format": "x"})
        (hlen,) = struct.unpack_from("<Q", blob)
        header, body = json.loads(blob[8:8 + hlen]), blob[8 + hlen:]
        try:
            if rng.random() < 0.4:
                raise ValueError("mutate the bytes")
            text = json.dumps(mutate_obj(header, rng), default=str).encode()
            data = struct.pack("<Q", len(text)) + text + body
        except (TypeError, ValueError, RecursionError):
            data = mutate_bytes(blob, rng)
        res.cases += 1
        try:
            tensors, meta = loads(data)
        except SafetensorsError as exc:
            refused += 1
            res.answered += bool(str(exc))
            continue
        except Exception:
            res.escaped += 1
            continue
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        ok = size <= len(data) and all(isinstance(v, str) for v in meta.values())
        loaded += ok
        res.answered += ok
    res.figures["safetensors_loaded"] = loaded
    res.figures["safetensors_refused"] = refused


def _plot_cases(res: SurfaceResult, rng: random.Random, root: Path, n: int) -> None:
    """``--plot`` on shapes from tiny to 3,000 x 3,000, and hostile tolerances: a PNG with
    its hottest cell, or an EvidenceError."""
    tolerances: list[Any] = [0.01, 0.5, "abc", float("inf"), float("nan"), -1.0, True, None,
                             [1], 10**30]
    drawn = 0
    for i in range(n):
        big = rng.random() < 0.2
        layers, heads = (rng.randint(1000, 3000), rng.randint(1000, 3000)) if big else \
            (rng.randint(1, 4), rng.randint(1, 4))
        shape = (layers, heads, 1 if big else rng.randint(1, 4), 1 if big else 2)
        tensors = {tensor_key(0, 0, side, part): torch.rand(shape).to(torch.uint8 if big
                                                                    else torch.float32)
                   for side in ("cached", "recomputed") for part in ("key", "value")}
        if rng.random() < 0.1:
            tensors["g0.bX.recomputed.key"] = torch.zeros(1)
        rec = {"seq": i, "checks": ["recompute_mismatch"],
               "errors": {"tolerance": rng.choice(tolerances)}}
        res.cases += 1
        started = time.monotonic()
        try:
            out = write_plot(rec, tensors, str(root / "p.png"))
            ok = 0 <= out["layer"] < layers and 0 <= out["head"] < heads
            drawn += ok
        except EvidenceError as exc:
            ok = bool(str(exc))
        except Exception:
            res.escaped += 1
            continue
        if time.monotonic() - started > 30:
            res.hangs += 1
        res.answered += ok
    res.figures["plots_drawn"] = drawn


# ------------------------------------------------------------------ writer
def evidence_writer(quick: bool, seed: int) -> SurfaceResult:
    n = 500 if quick else 10_000
    res = SurfaceResult("evidence_writer", "planted links/FIFOs/directories at the next "
                        ".tmp names, hostile record contents, world-writable and foreign "
                        "directories -> EvidenceLog", min_cases=n)
    rng = random.Random(seed)
    root = _scratch()
    victim = root / "victim"
    victim.write_bytes(b"precious")
    try:
        log = EvidenceLog(capacity=50, directory=root / "ev", max_bytes=4 * 2**20)
        planted = errors = 0
        for _ in range(n):
            seq = log._seq + 1  # the next record's number: where an attacker plants
            tmp_json = log.directory / (record_name(seq) + ".tmp")  # type: ignore[operator]
            tmp_tensors = log.directory / (tensors_name(seq) + ".tmp")  # type: ignore[operator]
            r = rng.random()
            target = tmp_json if rng.random() < 0.5 else tmp_tensors
            if r < 0.3:
                target.symlink_to(victim)
                planted += 1
            elif r < 0.35:
                os.mkfifo(target)
                planted += 1
            elif r < 0.38:
                target.mkdir()
                planted += 1
            rec = {"kind": "fuzz", "detail": mutate_obj({"a": [1, 2], "b": "x"}, rng)}
            tensors = {"t": torch.ones(4)} if rng.random() < 0.5 else None
            before = log.write_errors
            res.cases += 1
            try:
                out = log.add(rec, tensors)
            except Exception:
                res.escaped += 1
                continue
            ok = victim.read_bytes() == b"precious"
            if log.write_errors > before:  # counted, and kept in memory
                errors += 1
                ok = ok and log.recent(1)[0]["seq"] == out["seq"]
            else:
                try:
                    ok = ok and read_record(log.directory / record_name(out["seq"]),  # type: ignore[operator]
                                            out["seq"])["seq"] == out["seq"]
                except Exception:
                    ok = False
            res.answered += ok
            for p in (tmp_json, tmp_tensors):
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()
        res.figures.update(planted=planted, write_errors=errors,
                           victim_intact=victim.read_bytes() == b"precious")
        res.check(res.figures["victim_intact"], "a planted link's target is unchanged")
        _directory_cases(res, root, 10 if quick else 100)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def _directory_cases(res: SurfaceResult, root: Path, n: int) -> None:
    """Unsafe directories are refused with a message; safe ones are used."""
    refused = 0
    for i in range(n):
        d = root / f"dir{i}"
        kind = ("world_writable", "foreign", "a_file", "fresh", "link_to_unsafe")[i % 5]
        if kind == "world_writable":
            d.mkdir()
            d.chmod(0o777)
        elif kind == "foreign":
            d.mkdir(mode=0o755)
            if os.geteuid() != 0:
                kind = "fresh"  # cannot give a directory away here: a safe case instead
                shutil.rmtree(d)
            else:
                os.chown(d, 65534, 65534)
        elif kind == "a_file":
            d.write_bytes(b"x")
        elif kind == "link_to_unsafe":
            unsafe = root / f"unsafe{i}"
            unsafe.mkdir()
            unsafe.chmod(0o777)
            d.symlink_to(unsafe)
        res.cases += 1
        try:
            EvidenceLog(capacity=1, directory=d)
            ok = kind == "fresh" and (d.stat().st_mode & 0o777) == 0o700
        except EvidenceDirRefused as exc:
            refused += 1
            ok = kind != "fresh" and bool(str(exc))
        except Exception:
            res.escaped += 1
            continue
        res.answered += ok
    res.figures["directories_refused"] = refused
