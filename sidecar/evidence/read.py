"""Reading evidence records back without trusting the directory they sit in.

``kv-sidecar evidence list`` must list every good record even when one beside it is
hostile or damaged: a link to ``/dev/zero``, a FIFO, a sparse 10 GiB file, JSON nested
2,000 deep, a ``NaN`` time, a list where a string belongs. Each file is read through
:func:`sidecar.evidence.files.read_regular` (regular files only, size checked first) and
its fields checked against what the writer (:mod:`sidecar.evidence.record`) produces; a file that
fails is an :class:`Unreadable` entry with its reason, listed beside the others.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.evidence.files import (
    MAX_RECORD_BYTES,
    MAX_TENSOR_FILE_BYTES,
    open_regular,
    read_exact,
    read_regular,
)
from sidecar.evidence.record import tensors_name

NAME = re.compile(r"^anomaly-(\d{8,20})\.json$")
MAX_NESTING = 16  # the writer caps records at depth 6 (sidecar.evidence.record.MAX_DEPTH)
LAST_TIME = 253402300799.0  # 9999-12-31: past it, a timestamp cannot be printed


class RecordUnreadable(ValueError):
    """A record file that cannot be read or is not shaped like the writer's records."""


@dataclass(frozen=True)
class Unreadable:
    """A name in the directory that looks like a record and is not a readable one."""

    seq: int
    name: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.seq, "file": self.name, "unreadable": self.reason}


def scan_records(directory: Path) -> tuple[list[dict[str, Any]], list[Unreadable]]:
    """Every record file in ``directory``, oldest first: the good ones, and the bad ones
    with their reasons. Files removed meanwhile (the writer's retention) are skipped."""
    good: list[dict[str, Any]] = []
    bad: list[Unreadable] = []
    for name in sorted(os.listdir(directory)):
        m = NAME.match(name)
        if m is None:
            continue
        seq = int(m.group(1))
        try:
            good.append(read_record(directory / name, seq))
        except FileNotFoundError:
            continue
        except RecordUnreadable as exc:
            bad.append(Unreadable(seq, name, str(exc)))
    return good, bad


def read_record(path: Path, seq: int) -> dict[str, Any]:
    """The record at ``path`` (``seq``: the number in its name), read and checked;
    :class:`RecordUnreadable` says why not, ``FileNotFoundError`` when it is gone."""
    try:
        data = read_regular(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RecordUnreadable(exc.strerror or str(exc)) from None
    try:
        rec = json.loads(data)
    except RecursionError:
        raise RecordUnreadable("JSON nested too deep") from None
    except ValueError as exc:  # UnicodeDecodeError and over-long integers included
        raise RecordUnreadable(f"not JSON: {str(exc)[:120]}") from None
    problem = record_problem(rec, seq)
    if problem is not None:
        raise RecordUnreadable(problem)
    assert isinstance(rec, dict)
    return rec


class TensorsUnreadable(ValueError):
    """A record's tensor file that is not the one it states; the message names the file."""


def open_tensors(directory: Path, rec: dict[str, Any]) -> int | None:
    """A descriptor open on the tensor file of ``rec`` (a checked record), or ``None`` when
    it has none: a regular file in ``directory`` (no link, FIFO or device), of exactly the
    size the record states and at most :data:`MAX_TENSOR_FILE_BYTES`. The one rule of
    ``evidence list`` (its KV column) and ``evidence show`` (which then checks the SHA-256);
    :class:`TensorsUnreadable` says why not. The caller closes the descriptor."""
    spec = rec.get("tensors")
    if not isinstance(spec, dict) or "file" not in spec:
        return None
    name, want = tensors_name(rec["seq"]), spec["bytes"]
    if want > MAX_TENSOR_FILE_BYTES:
        raise TensorsUnreadable(f"{name}: the record states {want} bytes, over the "
                                f"{MAX_TENSOR_FILE_BYTES}-byte limit")
    try:
        fd, size = open_regular(directory / name, MAX_TENSOR_FILE_BYTES)
    except OSError as exc:
        raise TensorsUnreadable(f"{name}: {exc.strerror or exc}") from None
    if size != want:
        os.close(fd)
        raise TensorsUnreadable(f"{name} is {size} bytes, the record states {want}")
    return fd


def tensors_state(directory: Path, rec: dict[str, Any]) -> str:
    """``yes``, ``no``, ``skipped`` (the writer said why) or ``unreadable: <why>``: the
    record's tensors as ``evidence list`` shows them, by :func:`open_tensors`."""
    try:
        fd = open_tensors(directory, rec)
    except TensorsUnreadable as exc:
        return f"unreadable: {exc}"
    if fd is None:
        return "skipped" if "skipped" in (rec.get("tensors") or {}) else "no"
    os.close(fd)
    return "yes"


def read_tensors(directory: Path, rec: dict[str, Any]) -> bytearray | None:
    """The bytes of the record's tensor file (:func:`open_tensors`), in one buffer read
    once and hashed in place, checked against the SHA-256 the record states."""
    fd = open_tensors(directory, rec)
    if fd is None:
        return None
    name = tensors_name(rec["seq"])
    try:
        data = read_exact(fd, rec["tensors"]["bytes"])
    except OSError as exc:
        raise TensorsUnreadable(f"{name}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if hashlib.sha256(data).hexdigest() != rec["tensors"]["sha256"]:
        raise TensorsUnreadable(f"{name} is not the file record {rec['seq']} wrote "
                                "(its SHA-256 differs)")
    return data


def record_problem(rec: Any, seq: int) -> str | None:
    """Why ``rec`` is not a record the writer could have written as number ``seq``
    (None: it is). Only the fields the reader uses are checked, each for its type."""
    if not isinstance(rec, dict):
        return f"not a JSON object but {_type(rec)}"
    if _depth(rec) > MAX_NESTING:
        return f"nested deeper than {MAX_NESTING} levels"
    if not _is_int(rec.get("seq")):
        return f"field 'seq' is {_type(rec.get('seq'))}, not an integer"
    if rec["seq"] != seq:
        return f"field 'seq' is {rec['seq']} but the file name says {seq}"
    when = rec.get("time")
    if when is not None and not (_is_num(when) and 0 <= when <= LAST_TIME):
        return f"field 'time' is {_show(when)}, not a time (seconds since 1970)"
    for key in ("engine", "kind", "model"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            return f"field {key!r} is {_type(rec[key])}, not a string"
    problem = (_list_of(rec, "checks", lambda v: None if isinstance(v, str) else "a string")
               or _list_of(rec, "findings", _finding) or _list_of(rec, "blocks", _block))
    if problem:
        return problem
    errors = rec.get("errors")
    if errors is not None:
        if not isinstance(errors, dict):
            return f"field 'errors' is {_type(errors)}, not an object"
        for key in ("max_error", "tolerance", "duration_s"):
            v = errors.get(key)
            if v is not None and not _is_num(v):
                return f"field 'errors.{key}' is {_show(v)}, not a number"
    return _tensors_problem(rec.get("tensors"))


def _tensors_problem(spec: Any) -> str | None:
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return f"field 'tensors' is {_type(spec)}, not an object"
    if "file" in spec:
        if not isinstance(spec["file"], str):
            return "field 'tensors.file' is not a string"
        if not (_is_int(spec.get("bytes")) and spec["bytes"] >= 0):
            return f"field 'tensors.bytes' is {_show(spec.get('bytes'))}, not a size"
        if not isinstance(spec.get("sha256"), str):
            return "field 'tensors.sha256' is not a string"
    if "skipped" in spec and not isinstance(spec["skipped"], str):
        return "field 'tensors.skipped' is not a string"
    return None


def _finding(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "an object"
    return None if v.get("kind") is None or isinstance(v["kind"], str) else \
        "an object whose 'kind' is a string"


def _block(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "an object"
    for key in ("group", "block_id", "index"):
        if v.get(key) is not None and not _is_int(v[key]):
            return f"an object whose {key!r} is an integer"
    if v.get("condemned") is not None and not isinstance(v["condemned"], bool):
        return "an object whose 'condemned' is true or false"
    return None


def _list_of(rec: dict[str, Any], key: str, item_problem: Any) -> str | None:
    value = rec.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        return f"field {key!r} is {_type(value)}, not a list"
    for i, item in enumerate(value):
        want = item_problem(item)
        if want:
            return f"field '{key}[{i}]' is {_show(item)}: expected {want}"
    return None


def _depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d > MAX_NESTING:
                return d
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A JSON number; the error statistics may be inf (the writer records NaN KV so)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and \
        (not isinstance(v, int) or abs(v) < 2**63)


def _type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def _show(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    text = json.dumps(v) if not isinstance(v, dict | list) else _type(v)
    return text if len(text) <= 40 else text[:40] + "..."
