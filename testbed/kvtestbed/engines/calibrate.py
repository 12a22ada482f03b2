"""Measure what the recompute check sees on the reference engine: noise and corruption.

For every prefix hit of the demo workload, every hit block is read from the pool and compared
with a from-scratch recompute (``normalized_error``), synchronously inside the engine's
lookup event (so the block is exactly what the request is about to decode over). Clean runs
give the noise floor per dtype, faulty runs the error of corrupted blocks; together they
calibrate :data:`sidecar.checks.tolerance.TOLERANCES`. Prints a table and, with ``--json``, JSON::

    python -m kvtestbed.engines.calibrate --dtypes float32 bfloat16 float16 \\
        --faults none zero-block boundary-off-by-one
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.faults import FAULTS
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from sidecar.checks.content import check_content
from sidecar.checks.recompute import block_error
from sidecar.checks.tolerance import tolerance_for
from sidecar.core.protocol import BlockRef, Lookup, StoredBlock


@dataclass
class ErrorRecorder:
    """An EventSink that checks every hit block against recompute as the hit happens."""

    adapter: ReferenceAdapter
    errors: list[float] = field(default_factory=list)
    content_kinds: Counter[str] = field(default_factory=Counter)
    stale_generations: int = 0
    _stored_generation: dict[int, int] = field(default_factory=dict)

    def on_lookup(self, lookup: Lookup) -> None:
        hit = lookup.hit
        if hit is None:
            return
        ids = hit.blocks[0]
        refs = [BlockRef(0, i, b) for i, b in enumerate(ids)]
        for ref, gen in zip(refs, hit.generations[0], strict=True):
            if self._stored_generation.get(ref.block_id, gen) != gen:
                self.stale_generations += 1
        cached = self.adapter.read(hit, refs)
        reference = self.adapter.recompute(hit, refs)
        for c, r in zip(cached, reference, strict=True):
            self.errors.append(block_error(c, r))
            for finding in check_content(c):
                self.content_kinds[finding.kind.value] += 1

    def on_store(self, block: StoredBlock) -> None:
        self._stored_generation[block.block_id] = block.generation

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self._stored_generation.pop(b, None)

    def on_request_done(self, latency_seconds: float) -> None:
        pass


def measure(dtype: str, fault: str, workload: WorkloadConfig, seed: int = 0) -> dict[str, object]:
    engine = ReferenceEngine(EngineConfig(model=ModelConfig(dtype=dtype), fault=fault,
                                          fault_seed=seed))
    recorder = ErrorRecorder(ReferenceAdapter(engine))
    engine.sink = recorder
    start = time.perf_counter()
    results = drive(engine, ChatWorkload(workload))
    elapsed = time.perf_counter() - start
    tol = tolerance_for(dtype)
    errs = recorder.errors
    over = [e for e in errs if e > tol]
    under = [e for e in errs if e <= tol]
    finite_over = [e for e in over if math.isfinite(e)]
    return {
        "dtype": dtype, "fault": fault, "requests": len(results),
        "hit_rate": round(engine.hit_rate(), 4), "blocks_checked": len(errs),
        "tolerance": tol, "max_clean_error": max(under, default=0.0),
        "over_tolerance": len(over),
        "min_error_over": min(over, default=None),
        "median_error_over": statistics.median(finite_over) if finite_over else None,
        "nonfinite_errors": len(over) - len(finite_over),
        "content": dict(recorder.content_kinds),
        "stale_generations": recorder.stale_generations,
        "injections": len(engine.fault.injections),
        "sink_errors": sum(engine.sink_errors.values()),
        "seconds_with_checks": round(elapsed, 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--faults", nargs="+", default=list(FAULTS))
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    wl = WorkloadConfig(seed=args.seed, conversations=args.conversations)
    rows = [measure(d, f, wl, args.seed) for d in args.dtypes for f in args.faults]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    cols = ["dtype", "fault", "blocks_checked", "max_clean_error", "over_tolerance",
            "min_error_over", "median_error_over", "content", "stale_generations",
            "injections", "hit_rate"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c])
                         for c in cols))


if __name__ == "__main__":
    main()
