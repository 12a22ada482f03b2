"""What an allocator invariant check costs: ``python -m kvtestbed.bench.allocator_pool``.

Fills a reference :class:`~kvtestbed.engines.pool.BlockPool` the way a busy engine
does (live sequences sharing prefix blocks, an evictable cached tail, a free remainder),
then times, per pool size, taking a :class:`~sidecar.core.protocol.BlockTableSnapshot` (what the
adapter does under the engine's lock) and checking it (what the poll thread does). Prints a
table, and JSON with ``--json``. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence

from kvtestbed.engines.pool import BlockPool, chain_hash
from sidecar.allocator.invariants import check_snapshot, unheld_references
from sidecar.core.protocol import BlockTableSnapshot, SequenceId


def busy_pool(num_blocks: int, seed: int = 0) -> tuple[BlockPool, dict[int, tuple[int, ...]]]:
    """A pool about 60% held by live sequences (a quarter of them sharing a prefix), 25%
    cached and evictable, the rest free; returns it with the live block tables."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks, 16, 1, 1, 1)
    tables: dict[int, tuple[int, ...]] = {}
    prefix = pool.allocate(4, holder=0).block_ids
    for i, b in enumerate(prefix):
        pool.cache(b, chain_hash(None, [i], ()), [i], (), i * 16)
    tables[0] = prefix
    seq = 1
    while pool.num_free > num_blocks * 0.45:
        shared = prefix if rng.random() < 0.25 else ()
        alloc = pool.allocate(rng.randint(2, 8), holder=seq, reserve=shared)
        tables[seq] = (*shared, *alloc.block_ids)
        seq += 1
    for s in [s for s in tables if s and rng.random() < 0.3]:  # finish some: cached tail
        for j, b in enumerate(tables[s]):
            if b not in prefix:
                pool.cache(b, chain_hash(None, [s, j], ()), [s, j], (), j * 16)
        pool.release(tables.pop(s), s)
    return pool, tables


def snapshot(pool: BlockPool, tables: dict[int, tuple[int, ...]]) -> BlockTableSnapshot:
    free, cached, index = pool.lists()
    sequences: dict[SequenceId, tuple[int, ...]] = {s: t for s, t in tables.items()}
    metas = pool.blocks
    return BlockTableSnapshot(0, pool.num_blocks, free, cached,
                              tuple([m.ref_count for m in metas]),
                              tuple([m.block_hash for m in metas]), index, sequences,
                              tuple([m.generation for m in metas]), pool.release_errors)


def measure(num_blocks: int, repeat: int = 50) -> dict[str, float]:
    pool, tables = busy_pool(num_blocks)
    snap = snapshot(pool, tables)
    if check_snapshot(snap):
        raise RuntimeError("the benchmark pool itself breaks an invariant")
    t0 = time.perf_counter()
    for _ in range(repeat):
        snap = snapshot(pool, tables)
    t1 = time.perf_counter()
    for _ in range(repeat):
        check_snapshot(snap)
        unheld_references(snap)
    t2 = time.perf_counter()
    return {"blocks": num_blocks, "live_sequences": len(tables),
            "snapshot_ms": (t1 - t0) / repeat * 1e3, "check_ms": (t2 - t1) / repeat * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[128, 1024, 4096, 16384])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [measure(n) for n in args.blocks]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'blocks':>8} {'live seqs':>10} {'snapshot ms':>12} {'check ms':>9} {'total ms':>9}")
    for r in rows:
        print(f"{r['blocks']:>8} {r['live_sequences']:>10} {r['snapshot_ms']:>12.3f} "
              f"{r['check_ms']:>9.3f} {r['snapshot_ms'] + r['check_ms']:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
