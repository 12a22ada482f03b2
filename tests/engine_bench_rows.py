"""What the real-engine benches' tests (tests/vllm, tests/sglang) check alike in the table of
``bench perf --engine vllm|sglang``."""

from __future__ import annotations

import math
from typing import Any


def split_thread_rows(rows: list[dict[str, Any]], engine_label: str
                      ) -> list[dict[str, Any]]:
    """The rows without the per-thread ones, after checking those: where the engine's CPU
    went, by thread name, for the (at most 3) threads that grew most."""
    threads = [r for r in rows if " thread '" in r["figure"]]
    assert 1 <= len(threads) <= 3
    for r in threads:
        assert r["figure"].rsplit(": ", 1)[1].startswith(f"{engine_label} thread '"), r
        assert math.isfinite(r["sidecar"]) and math.isfinite(r["baseline"]), r
        assert r["sidecar"] > 0 or r["baseline"] > 0, r
        assert r["spread"].endswith(" us/request"), r
    return [r for r in rows if r not in threads]
