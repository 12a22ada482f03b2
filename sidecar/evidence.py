"""Evidence: a bounded, atomic record of each anomaly, for the post-mortem.

The newest ``capacity`` records are kept in memory (``/status`` shows them) and, when a
directory is given, each is also written as one JSON file via write-then-rename, so a reader
never sees half a record and a crash never leaves one. Token ids are stored as a digest
unless ``include_tokens`` is set: prompts are user data.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from sidecar.verifier import Verdict


class EvidenceLog:
    def __init__(self, capacity: int = 100, directory: str | os.PathLike[str] | None = None,
                 include_tokens: bool = False) -> None:
        self.capacity = capacity
        self.directory = Path(directory) if directory is not None else None
        self.include_tokens = include_tokens
        self._records: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

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
            "key_fields": dict(hit.key_fields),
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
        numbered, bounded and written atomically like every other."""
        rec.setdefault("time", time.time())
        with self._lock:
            self._seq += 1
            rec["seq"] = self._seq
            self._records.append(rec)
            if self.directory is not None:
                self._write(rec)
        return rec

    def _write(self, rec: dict[str, Any]) -> None:
        assert self.directory is not None
        final = self.directory / f"anomaly-{rec['seq']:08d}.json"
        tmp = final.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        os.replace(tmp, final)
        # Keep the directory bounded too.
        stale = rec["seq"] - self.capacity
        if stale > 0:
            (self.directory / f"anomaly-{stale:08d}.json").unlink(missing_ok=True)

    def recent(self, n: int = 10) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)[-n:]
