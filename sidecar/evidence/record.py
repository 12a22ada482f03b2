"""Evidence: a bounded, durable record of each anomaly, for the post-mortem.

The newest ``capacity`` records are kept in memory (``/status`` shows them) and, when a
directory is given, each is also written as one JSON file. What a crash, a restart or a
hostile input can no longer do:

* overwrite earlier records: the sequence continues across processes (the directory is
  scanned on start, numbering resumes after the highest record found);
* leave a half record: each file is written to ``anomaly-N.json.tmp`` (0600), fsynced,
  renamed, and the directory fsynced. On start a ``.tmp`` left by a kill is recovered when
  it is a complete record of its own number (parses, ``seq`` matches, no final file yet)
  and deleted otherwise: deterministic, whatever the moment of the kill;
* separate a record from its tensors: the cached and recomputed KV of the offending blocks
  go to ``anomaly-N.safetensors`` (:mod:`sidecar.evidence.safetensors_io`), written to a ``.tmp``
  and fsynced *before* the JSON; the tensors are renamed first and the JSON's rename is
  the commit. On start a tensor file without its record is deleted, and a record ``.tmp``
  is recovered only with its tensors (size and SHA-256 as the record states): a record and
  its tensors appear together or not at all;
* grow without bound: the directory keeps at most ``capacity`` records *and*
  ``max_bytes`` bytes (records and tensors), oldest first, and one record's tensors are
  at most ``max_tensor_bytes`` (else skipped, saying so); every string, list and map in a
  record is capped (:data:`MAX_FIELD_CHARS`, :data:`MAX_ITEMS`), so one 5 MB key field
  cannot make every record 5 MB;
* be redirected: the directory is created 0700 by the sidecar, or refused when it is
  world-writable or another user's; temp files are created ``O_EXCL|O_NOFOLLOW``
  (:mod:`sidecar.evidence.files`), so a planted link is never written through;
* leak user data: files are 0600, token ids are stored as a digest unless
  ``include_tokens`` is set, and key fields that are secrets (a cache salt, a token) are
  stored as an unsalted SHA-256 prefix, enough to tell two values apart, not to read one.

A failed write (disk full, permissions) keeps the record in memory, is counted in
``write_errors`` and logged once; it never raises into the verifier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from array import array
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.evidence.files import (
    MAX_RECORD_BYTES,
    MAX_TENSOR_FILE_BYTES,
    prepare_directory,
    read_regular,
    write_exclusive,
)

if TYPE_CHECKING:
    import torch

    from sidecar.checks.verifier import Verdict

log = logging.getLogger(__name__)

MAX_FIELD_CHARS = 1024
MAX_ITEMS = 64
MAX_DEPTH = 6
SECRET_FIELD = re.compile(r"salt|token|secret|password|auth|key$", re.IGNORECASE)
_NAME = re.compile(r"^anomaly-(\d{8,})\.json$")
_TMP = re.compile(r"^anomaly-(\d{8,})\.json\.tmp$")
_TENSORS = re.compile(r"^anomaly-(\d{8,})\.safetensors(\.tmp)?$")


def record_name(seq: int) -> str:
    return f"anomaly-{seq:08d}.json"


def tensors_name(seq: int) -> str:
    return f"anomaly-{seq:08d}.safetensors"


def tensor_key(group_id: int, index: int, side: str, part: str) -> str:
    """The safetensors name of one tensor: ``g{group}.b{index}.{cached|recomputed}.{key|value}``
    (``index``: the block's position in the hit)."""
    return f"g{group_id}.b{index}.{side}.{part}"


def digest(value: object) -> str:
    """A short, stable fingerprint of a secret value (never the value itself)."""
    return "sha256:" + hashlib.sha256(str(value).encode()).hexdigest()[:16]


def cap(obj: Any, depth: int = 0) -> Any:
    """``obj`` with strings, lists and maps cut to bounded sizes (JSON-safe scalars kept)."""
    if isinstance(obj, str):
        return obj if len(obj) <= MAX_FIELD_CHARS else obj[:MAX_FIELD_CHARS] + "...[cut]"
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if depth >= MAX_DEPTH:
        return "[too deep]"
    if isinstance(obj, dict):
        out = {cap(str(k)): cap(v, depth + 1) for k, v in list(obj.items())[:MAX_ITEMS]}
        if len(obj) > MAX_ITEMS:
            out["[cut]"] = f"{len(obj) - MAX_ITEMS} more entries"
        return out
    if isinstance(obj, (list, tuple)):
        items = [cap(v, depth + 1) for v in list(obj[:MAX_ITEMS])]
        return items + ([f"[{len(obj) - MAX_ITEMS} more cut]"] if len(obj) > MAX_ITEMS else [])
    return cap(str(obj), depth)


def redact_key_fields(fields: Any) -> dict[str, Any]:
    """Key fields with secrets (salts, tokens) replaced by their digest."""
    items = dict(fields).items() if hasattr(fields, "items") else ()
    return {str(k): digest(v) if SECRET_FIELD.search(str(k)) else v for k, v in items}


class EvidenceLog:
    def __init__(self, capacity: int = 100, directory: str | os.PathLike[str] | None = None,
                 include_tokens: bool = False, max_bytes: int = 64 * 2**20,
                 max_tensor_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.max_tensor_bytes = max_bytes // 4 if max_tensor_bytes is None else max_tensor_bytes
        self.directory = Path(directory) if directory is not None else None
        self.include_tokens = include_tokens
        self._records: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0
        self._files: dict[int, int] = {}  # seq -> bytes on disk, for the bounds
        self.write_errors = 0
        self.recovered = 0  # complete .tmp records renamed on start
        self.discarded = 0  # partial .tmp leftovers deleted on start
        if self.directory is not None:
            prepare_directory(self.directory)  # or EvidenceDirRefused: exit 2 at start
            self._scan()

    # ------------------------------------------------------------------ start-up
    def _scan(self) -> None:
        """Resume numbering after the highest record; settle ``.tmp`` leftovers."""
        assert self.directory is not None
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            m = _TMP.match(entry.name)
            if m is not None:
                self._settle_tmp(Path(entry.path), int(m.group(1)))
        names = {e.name: e for e in os.scandir(self.directory)}
        for name, entry in names.items():
            m = _TENSORS.match(name)
            if m is not None and (m.group(2) or record_name(int(m.group(1))) not in names):
                Path(entry.path).unlink(missing_ok=True)  # tensors without their record
                self.discarded += 1
        for name, entry in names.items():
            m = _NAME.match(name)
            if m is not None:
                seq = int(m.group(1))
                tensors = self.directory / tensors_name(seq)
                self._files[seq] = entry.stat(follow_symlinks=False).st_size + (
                    tensors.lstat().st_size if tensors.exists() else 0)
        self._seq = max(self._files, default=0)
        self._prune()
        _fsync_dir(self.directory)

    def _settle_tmp(self, tmp: Path, seq: int) -> None:
        final = tmp.with_name(f"anomaly-{seq:08d}.json")
        tensors = tmp.with_name(tensors_name(seq))
        tensors_tmp = tensors.with_name(tensors.name + ".tmp")
        try:
            rec = json.loads(read_regular(tmp, MAX_RECORD_BYTES))
            complete = isinstance(rec, dict) and rec.get("seq") == seq
        except (OSError, ValueError, RecursionError):
            complete = False
        try:
            if complete and not final.exists() and self._tensors_ready(rec, tensors,
                                                                         tensors_tmp):
                os.replace(tmp, final)
                self.recovered += 1
            else:
                tmp.unlink()
                tensors_tmp.unlink(missing_ok=True)
                self.discarded += 1
        except OSError as exc:
            log.warning("evidence: cannot settle leftover %s: %s", tmp, exc)

    @staticmethod
    def _tensors_ready(rec: dict[str, Any], tensors: Path, tensors_tmp: Path) -> bool:
        """Whether the tensors a recovered record names are complete (renaming the ``.tmp``
        into place when the kill came between the two renames)."""
        want = rec.get("tensors")
        if not isinstance(want, dict) or "file" not in want:
            return True
        for candidate in (tensors, tensors_tmp):
            try:
                data = read_regular(candidate, MAX_TENSOR_FILE_BYTES)
            except OSError:
                continue
            if len(data) == want.get("bytes") and \
                    hashlib.sha256(data).hexdigest() == want.get("sha256"):
                if candidate is tensors_tmp:
                    os.replace(tensors_tmp, tensors)
                return True
        return False

    # ------------------------------------------------------------------ records
    def record(self, verdict: Verdict, engine: str, model: str,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One anomalous verdict: what fired where, the key, the error statistics and
        (as safetensors) the bytes of the condemned blocks, served and recomputed."""
        hit = verdict.sample.hit
        epochs = verdict.sample.epochs
        tokens = list(hit.tokens[: hit.hit_tokens])
        rec: dict[str, Any] = {
            "time": time.time(),
            "engine": engine,
            "model": model,
            "hit_tokens": hit.hit_tokens,
            "tokens_digest": hashlib.blake2b(array("q", tokens).tobytes(),
                                             digest_size=16).hexdigest(),
            "key_fields": redact_key_fields(hit.key_fields),
            "block_size_tokens": _block_tokens(verdict),
            "blocks": [{"group": r.group_id, "index": r.index, "block_id": r.block_id,
                        "epoch": epochs.get(r), "generation": _generation(hit, r),
                        "condemned": r in verdict.kv}
                       for r in verdict.sample.refs],
            "checks": sorted({f.kind.value for f in verdict.findings}),
            "findings": [{"kind": f.kind.value, "group": f.group_id, "index": f.block_index,
                          "detail": f.detail, "value": f.value} for f in verdict.findings],
            "errors": {"tolerance": verdict.tolerance, "max_error": verdict.max_error,
                       "per_block": [{"group": g, "error": e} for g, e in verdict.errors],
                       "duration_s": verdict.duration_s},
            **(extra or {}),
        }
        if self.include_tokens:
            rec["tokens"] = tokens
        return self.add(rec, block_tensors(verdict))

    def add(self, rec: dict[str, Any],
            tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Keep a record built elsewhere (allocator invariant violations carry no verdict):
        capped, numbered, bounded and written durably like every other. ``tensors`` go to
        the record's safetensors file, written before the record and bound to it."""
        rec = cap(rec)
        blob = self._tensor_blob(rec, tensors)
        rec.setdefault("time", time.time())
        with self._lock:
            self._seq += 1
            rec["seq"] = self._seq
            self._records.append(rec)
            if self.directory is not None:
                try:
                    self._write(rec, blob)
                except OSError as exc:
                    self.write_errors += 1
                    if self.write_errors == 1 or self.write_errors % 1000 == 0:
                        log.warning("evidence record %d not written (#%d): %s",
                                    rec["seq"], self.write_errors, exc)
        return rec

    def _tensor_blob(self, rec: dict[str, Any],
                     tensors: dict[str, torch.Tensor] | None) -> bytes | None:
        """The safetensors bytes for ``rec`` (its ``tensors`` entry says what they are, or
        why there are none); no directory, no tensors, no bytes."""
        if not tensors or self.directory is None:
            return None
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.max_tensor_bytes:
            rec["tensors"] = {"skipped": f"{size} bytes > max_tensor_bytes "
                                         f"{self.max_tensor_bytes}"}
            return None
        try:
            from sidecar.evidence import safetensors_io  # torch: where tensors are written

            blob = safetensors_io.dumps(tensors, {"format": "kv-sidecar evidence"})
        except (TypeError, RuntimeError) as exc:
            rec["tensors"] = {"skipped": f"not serialisable: {exc}"}
            return None
        rec["tensors"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                          "names": sorted(tensors)[:MAX_ITEMS]}
        return blob

    def _write(self, rec: dict[str, Any], blob: bytes | None = None) -> None:
        assert self.directory is not None
        seq = rec["seq"]
        final = self.directory / record_name(seq)
        tmp = final.with_name(final.name + ".tmp")
        tensors = self.directory / tensors_name(seq)
        if blob is not None:
            rec["tensors"]["file"] = tensors.name
            _write_synced(tensors.with_name(tensors.name + ".tmp"), blob)
        body = json.dumps(rec, indent=1, default=str).encode()
        _write_synced(tmp, body)
        if blob is not None:  # tensors first: the record's rename is the commit
            os.replace(tensors.with_name(tensors.name + ".tmp"), tensors)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        self._files[seq] = len(body) + (len(blob) if blob is not None else 0)
        self._prune()

    def _prune(self) -> None:
        """Oldest first, until the directory holds at most ``capacity`` records and
        ``max_bytes`` bytes (the newest record is always kept)."""
        assert self.directory is not None
        total = sum(self._files.values())
        for seq in sorted(self._files):
            if len(self._files) <= self.capacity and total <= self.max_bytes:
                break
            if len(self._files) == 1:
                break
            # the record first: a kill in between leaves tensors the next start deletes
            (self.directory / record_name(seq)).unlink(missing_ok=True)
            (self.directory / tensors_name(seq)).unlink(missing_ok=True)
            total -= self._files.pop(seq)

    def recent(self, n: int = 10) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)[-n:]

    @property
    def files(self) -> list[int]:
        """Sequence numbers of the records on disk, oldest first."""
        with self._lock:
            return sorted(self._files)


def block_tensors(verdict: Verdict) -> dict[str, torch.Tensor]:
    """The served and (where it ran) recomputed K and V of each condemned block."""
    out: dict[str, torch.Tensor] = {}
    for ref, (served, reference) in verdict.kv.items():
        for side, kv in (("cached", served), ("recomputed", reference)):
            if kv is not None:
                out[tensor_key(ref.group_id, ref.index, side, "key")] = kv.key
                out[tensor_key(ref.group_id, ref.index, side, "value")] = kv.value
    return out


def _generation(hit: Any, ref: Any) -> int | None:
    gens = hit.generations.get(ref.group_id) if hasattr(hit, "generations") else None
    return int(gens[ref.index]) if gens is not None and ref.index < len(gens) else None


def _block_tokens(verdict: Verdict) -> int | None:
    for served, _ in verdict.kv.values():
        return int(served.key.shape[2]) if served.key.dim() == 4 else None
    return None


def _write_synced(path: Path, data: bytes) -> None:
    write_exclusive(path, data)  # O_EXCL|O_NOFOLLOW: never through a planted link


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
