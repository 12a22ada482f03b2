"""``kv-sidecar evidence list|show ID [--plot out.png]``: read the evidence directory back.

Read-only: a directory a running sidecar is writing into is listed as it stands, complete
records only (``.tmp`` files are the writer's, settled by the writer's next start, never
here). Exit codes: 0 success, 2 bad input (no directory, unknown record, a tensor file that
is not what its record says, nothing to plot).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.config.key_table import text_problem
from sidecar.core.extras import MissingExtra, require
from sidecar.evidence.read import (
    RecordUnreadable,
    TensorsUnreadable,
    Unreadable,
    read_record,
    read_tensors,
    scan_records,
    tensors_state,
)
from sidecar.evidence.record import record_name, tensors_name

if TYPE_CHECKING:  # annotations; torch itself is imported where a file is read
    import torch

ENV_DIR = "KVSIDECAR_EVIDENCE_DIR"


class EvidenceError(Exception):
    """Bad input for ``kv-sidecar evidence``: printed without a traceback, exit code 2."""


def add_parser(sub: Any) -> None:
    e = sub.add_parser("evidence", help="list and open the anomaly evidence records",
                       description="Read the evidence directory (--evidence-dir of the "
                                   "sidecar): list the records, show one with its tensors, "
                                   "and plot where the block is wrong.")
    esub = e.add_subparsers(dest="evidence_command", metavar="ACTION", required=True)
    for name, help_text in (("list", "one line per record, oldest first"),
                            ("show", "one record in full, optionally as a heatmap")):
        a = esub.add_parser(name, help=help_text, description=help_text)
        a.add_argument("--dir", default=os.environ.get(ENV_DIR), metavar="DIR",
                       help=f"the evidence directory (default: ${ENV_DIR})")
        a.add_argument("--json", action="store_true", help="print JSON")
        if name == "show":
            a.add_argument("id", metavar="ID", help="record number (as `evidence list` shows)")
            a.add_argument("--plot", type=plot_path, default=None, metavar="OUT.PNG",
                           help="write |cached - recomputed| per layer x head x token as a "
                                "PNG heatmap, with the tolerance marked")


def plot_path(text: str) -> str:
    """``--plot``'s type: a path to write, refused while parsing when it cannot be one (an
    empty path was no plot at all, silently)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path to write the PNG to, got an "
                                         "empty string")
    problem = text_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def run_evidence(args: argparse.Namespace) -> int:
    directory = _directory(args.dir)
    if args.evidence_command == "list":
        records, unreadable = scan_records(directory)
        if args.json:
            rows = [summary_line(r, directory) for r in records] + [u.as_dict() for u in
                                                                    unreadable]
            print(json.dumps(sorted(rows, key=lambda r: r["id"]), indent=1))
        else:
            print(format_list(records, unreadable, directory))
        return 0
    seq = _parse_id(args.id)
    rec, tensors = load_record(directory, seq)
    out: dict[str, Any] = {"record": rec, "tensors": {
        k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for k, t in (tensors or {}).items()}}
    if args.plot is not None:
        out["plot"] = write_plot(rec, tensors, args.plot)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print(json.dumps(rec, indent=1, default=str))
        for name, spec in out["tensors"].items():
            print(f"tensor {name}: {spec['dtype']} {spec['shape']}")
        if "plot" in out:
            p = out["plot"]
            print(f"plot written to {p['path']}: hottest cell layer {p['layer']} head "
                  f"{p['head']} {p['kv']} token {p['token']} of block #{p['block']} "
                  f"(hit position {p['position']}), "
                  f"{p['value']:.3g} x rms vs tolerance {p['tolerance']}")
    return 0


# ------------------------------------------------------------------ reading
def list_records(directory: Path) -> list[dict[str, Any]]:
    """Every readable record in ``directory``, oldest first (see :func:`scan_records` for
    the unreadable ones and their reasons)."""
    return scan_records(directory)[0]


def load_record(directory: Path, seq: int) -> tuple[dict[str, Any],
                                                    dict[str, torch.Tensor] | None]:
    """One record and its tensors (``None`` when it has none), checked against the size and
    SHA-256 the record states."""
    path = directory / record_name(seq)
    try:
        rec = read_record(path, seq)
    except FileNotFoundError:
        have = [r["seq"] for r in list_records(directory)]
        span = f"records {have[0]}..{have[-1]}" if have else "no records"
        raise EvidenceError(f"no evidence record {seq} in {directory} ({span})") from None
    except RecordUnreadable as exc:
        raise EvidenceError(f"{path}: not a readable record: {exc}") from None
    try:
        data = read_tensors(directory, rec)
    except TensorsUnreadable as exc:
        raise EvidenceError(f"record {seq}: {exc}") from None
    if data is None:
        return rec, None
    from sidecar.evidence.safetensors_io import SafetensorsError, loads  # torch: only here

    try:
        tensors, _ = loads(data)  # views of data: the file is in memory once
    except SafetensorsError as exc:
        raise EvidenceError(f"{tensors_name(seq)}: {exc}") from None
    return rec, tensors


def summary_line(rec: dict[str, Any], directory: Path) -> dict[str, Any]:
    """One record as ``evidence list`` shows it; its tensors by the rule ``show`` reads
    them by (:func:`sidecar.evidence.read.tensors_state`)."""
    errors = rec.get("errors") or {}
    blocks = [b for b in rec.get("blocks") or [] if isinstance(b, dict)]
    # An invariant violation's record names its blocks in its violations (an outside check
    # found its CHECKS, GROUPS and BLOCKS columns blank).
    found = [f for f in rec.get("findings") or rec.get("violations") or []
             if isinstance(f, dict)]
    named = [b for b in blocks if b.get("condemned", True)] or \
        [f for f in found if f.get("block_id") is not None]
    return {
        "id": rec["seq"],
        "time": rec.get("time"),
        "engine": rec.get("engine", rec.get("kind", "")),
        "checks": rec.get("checks") or sorted({f.get("kind") or "?" for f in found}),
        "groups": sorted({b.get("group") for b in named} - {None}, key=str),
        "blocks": [b.get("block_id") for b in named],
        "max_error": errors.get("max_error"),
        "tolerance": errors.get("tolerance"),
        "tensors": tensors_state(directory, rec),
    }


def format_list(records: list[dict[str, Any]], unreadable: list[Unreadable],
                directory: Path) -> str:
    """The table of records; unreadable ones as a line each with the reason, in order."""
    if not records and not unreadable:
        return "no evidence records"
    lines = [f"{'ID':>6}  {'TIME (UTC)':<19}  {'ENGINE':<10}  {'CHECKS':<24}  "
             f"{'GROUPS':<7}  {'BLOCKS':<14}  {'MAX ERR':>9}  {'TOL':>9}  KV"]
    rows = [(u.seq, f"{u.seq:>6}  unreadable: {u.name}: {u.reason}") for u in unreadable]
    for rec in records:
        s = summary_line(rec, directory)
        when = (dt.datetime.fromtimestamp(s["time"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
                if isinstance(s["time"], (int, float)) else "?")
        rows.append((s["id"], f"{s['id']:>6}  {when:<19}  {str(s['engine'])[:10]:<10}  "
                     f"{','.join(s['checks'])[:24]:<24}  "
                     f"{','.join(map(str, s['groups']))[:7]:<7}  "
                     f"{','.join(map(str, s['blocks']))[:14]:<14}  "
                     f"{_num(s['max_error']):>9}  {_num(s['tolerance']):>9}  {s['tensors']}"))
    return "\n".join(lines + [text for _, text in sorted(rows, key=lambda r: r[0])])


def write_plot(rec: dict[str, Any], tensors: dict[str, torch.Tensor] | None,
               out: str) -> dict[str, Any]:
    """Render the record's heatmap to ``out``; returns where the hottest cell is."""
    try:
        require("plot")
    except MissingExtra as exc:
        raise EvidenceError(str(exc)) from None
    from sidecar.evidence.plot import NothingToPlot, heat_from_tensors, render

    if not tensors:
        why = (rec.get("tensors") or {}).get("skipped", "it has no tensor file")
        raise EvidenceError(f"record {rec['seq']} cannot be plotted: {why}")
    tol = (rec.get("errors") or {}).get("tolerance")
    if tol is not None and not (isinstance(tol, (int, float)) and not isinstance(tol, bool)
                                and math.isfinite(tol) and tol >= 0):
        raise EvidenceError(f"record {rec['seq']} cannot be plotted: its tolerance "
                            f"{tol!r} is not a finite number >= 0")
    try:
        heat = heat_from_tensors(tensors, float(tol) if tol is not None else None)
    except NothingToPlot as exc:
        raise EvidenceError(f"record {rec['seq']} cannot be plotted: {exc}") from None
    kinds = ", ".join(map(str, rec.get("checks") or [])) or "anomaly"
    plural = "s" if len(heat.blocks) > 1 else ""
    title = (f"kv-sidecar evidence #{rec['seq']}: {kinds} - group {heat.group}, "
             f"block{plural} #{', #'.join(map(str, heat.blocks))}")
    subtitle = (f"{heat.block_tokens} tokens per block; cells over the tolerance are red to "
                "yellow")
    try:
        png, lay, vmax = render(heat, title, subtitle)
    except NothingToPlot as exc:
        raise EvidenceError(f"record {rec['seq']} cannot be plotted: {exc}") from None
    try:
        Path(out).write_bytes(png)
    except OSError as exc:
        raise EvidenceError(f"cannot write {out}: {exc}") from None
    import torch

    flat = heat.values.nan_to_num(nan=float("inf"))
    layer, head, kv, token = (int(i) for i in torch.unravel_index(flat.argmax(), flat.shape))
    block = heat.blocks[token // heat.block_tokens]
    within = token % heat.block_tokens
    return {"path": out, "layer": layer, "head": head, "kv": ("K", "V")[kv],
            "token": within, "block": block, "position": block * heat.block_tokens + within,
            "value": float(flat[layer, head, kv, token]), "tolerance": heat.tolerance,
            "scale_top": vmax, "layout": lay}


def _directory(value: str | None) -> Path:
    if not value:
        raise EvidenceError(f"no evidence directory: pass --dir DIR or set ${ENV_DIR}")
    path = Path(value)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise EvidenceError(f"evidence directory {value!r} does not exist") from None
    except (OSError, ValueError) as exc:  # a link loop, no permission, a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise EvidenceError(f"evidence directory {value!r}: {why}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise EvidenceError(f"evidence directory {value!r} is not a directory")
    return path


def _parse_id(text: str) -> int:
    m = re.fullmatch(r"(?:anomaly-)?0*(\d{1,20})(?:\.json)?", text.strip())
    if m is None:
        raise EvidenceError(f"bad record ID {text!r}: expected a number such as 12")
    return int(m.group(1))


def _num(v: Any) -> str:
    # + 0.0: a stored -0.0 (a clean block's signed error) shows as 0
    return f"{v + 0.0:.3g}" if isinstance(v, (int, float)) else "-"
