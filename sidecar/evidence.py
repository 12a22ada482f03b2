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
* grow without bound: the directory keeps at most ``capacity`` records *and*
  ``max_bytes`` bytes, oldest first; every string, list and map in a record is capped
  (:data:`MAX_FIELD_CHARS`, :data:`MAX_ITEMS`), so one 5 MB key field cannot make every
  record 5 MB;
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

if TYPE_CHECKING:
    from sidecar.verifier import Verdict

log = logging.getLogger(__name__)

MAX_FIELD_CHARS = 1024
MAX_ITEMS = 64
MAX_DEPTH = 6
SECRET_FIELD = re.compile(r"salt|token|secret|password|auth|key$", re.IGNORECASE)
_NAME = re.compile(r"^anomaly-(\d{8,})\.json$")
_TMP = re.compile(r"^anomaly-(\d{8,})\.json\.tmp$")


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
                 include_tokens: bool = False, max_bytes: int = 64 * 2**20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
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
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._scan()

    # ------------------------------------------------------------------ start-up
    def _scan(self) -> None:
        """Resume numbering after the highest record; settle ``.tmp`` leftovers."""
        assert self.directory is not None
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            m = _TMP.match(entry.name)
            if m is not None:
                self._settle_tmp(Path(entry.path), int(m.group(1)))
        for entry in os.scandir(self.directory):
            m = _NAME.match(entry.name)
            if m is not None:
                self._files[int(m.group(1))] = entry.stat().st_size
        self._seq = max(self._files, default=0)
        self._prune()
        _fsync_dir(self.directory)

    def _settle_tmp(self, tmp: Path, seq: int) -> None:
        final = tmp.with_name(f"anomaly-{seq:08d}.json")
        try:
            rec = json.loads(tmp.read_bytes())
            complete = isinstance(rec, dict) and rec.get("seq") == seq
        except (OSError, ValueError):
            complete = False
        try:
            if complete and not final.exists():
                os.replace(tmp, final)
                self.recovered += 1
            else:
                tmp.unlink()
                self.discarded += 1
        except OSError as exc:
            log.warning("evidence: cannot settle leftover %s: %s", tmp, exc)

    # ------------------------------------------------------------------ records
    def record(self, verdict: Verdict, engine: str, model: str,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
        hit = verdict.sample.hit
        tokens = list(hit.tokens[: hit.hit_tokens])
        rec: dict[str, Any] = {
            "time": time.time(),
            "engine": engine,
            "model": model,
            "hit_tokens": hit.hit_tokens,
            "tokens_digest": hashlib.blake2b(array("q", tokens).tobytes(),
                                             digest_size=16).hexdigest(),
            "key_fields": redact_key_fields(hit.key_fields),
            "blocks": [{"group": r.group_id, "index": r.index, "block_id": r.block_id}
                       for r in verdict.sample.refs],
            "findings": [{"kind": f.kind.value, "group": f.group_id, "index": f.block_index,
                          "detail": f.detail, "value": f.value} for f in verdict.findings],
            **(extra or {}),
        }
        if self.include_tokens:
            rec["tokens"] = tokens
        return self.add(rec)

    def add(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Keep a record built elsewhere (allocator invariant violations carry no verdict):
        capped, numbered, bounded and written durably like every other."""
        rec = cap(rec)
        rec.setdefault("time", time.time())
        with self._lock:
            self._seq += 1
            rec["seq"] = self._seq
            self._records.append(rec)
            if self.directory is not None:
                try:
                    self._write(rec)
                except OSError as exc:
                    self.write_errors += 1
                    if self.write_errors == 1 or self.write_errors % 1000 == 0:
                        log.warning("evidence record %d not written (#%d): %s",
                                    rec["seq"], self.write_errors, exc)
        return rec

    def _write(self, rec: dict[str, Any]) -> None:
        assert self.directory is not None
        seq = rec["seq"]
        final = self.directory / f"anomaly-{seq:08d}.json"
        tmp = final.with_name(final.name + ".tmp")
        body = json.dumps(rec, indent=1, default=str).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        self._files[seq] = len(body)
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
            (self.directory / f"anomaly-{seq:08d}.json").unlink(missing_ok=True)
            total -= self._files.pop(seq)

    def recent(self, n: int = 10) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)[-n:]

    @property
    def files(self) -> list[int]:
        """Sequence numbers of the records on disk, oldest first."""
        with self._lock:
            return sorted(self._files)


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
