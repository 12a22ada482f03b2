"""The hit rate the sidecar exports is LMCache's own, counted over the same run.

LMCache's own numbers are its Prometheus counters (``lmcache:num_retrieve_requests``,
``num_requested_tokens``, ``num_hit_tokens``, ``num_lookup_tokens``, ``num_lookup_hits``),
flushed from its stats monitor as its logger thread does. The run mixes misses, partial
hits, hits from both tiers and a chunk the disk tier fails to load (LMCache drops it and
the rest of the prefix: those tokens are recomputed, not served).
"""

from __future__ import annotations

import errno
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar import signals as S
from tests.lmcache.harness import build

pytestmark = pytest.mark.lmcache


def test_exported_hit_rate_equals_lmcache_own_counts(tmp_path: Path) -> None:
    rig = build(tmp_path, cpu_gb=0.001, sample_every=5)
    disk = rig.backend("LocalDiskBackend")
    real_read = disk.read_file
    rng = random.Random(11)
    prefixes = [[rng.randrange(256) for _ in range(4 * rig.chunk_size)] for _ in range(6)]
    unloadable = rig.chunk_key(prefixes[0], 2)

    def failing_read(key: Any, buffer: Any, path: str) -> None:
        if key == unloadable:
            raise OSError(errno.EIO, "Input/output error", path)
        real_read(key, buffer, path)

    try:
        for i in range(40):
            p = prefixes[i % 6][: rng.choice((2, 3, 4)) * rig.chunk_size]
            rig.serve(p + [rng.randrange(256) for _ in range(rng.randrange(40))])
        for i in range(4):  # every chunk landed on disk (the tier writes asynchronously)
            rig.wait_on_disk(rig.chunk_key(prefixes[0], i))
        rig.evict_from_cpu(unloadable)
        disk.read_file = failing_read  # test-only: a disk read error on one chunk file
        rig.serve(prefixes[0])
        assert rig.monitor.drain(60)
        m = rig.monitor.metrics
        assert m.value(S.LOOKUPS.name) == rig.lmcache_counter("num_retrieve_requests")
        assert m.value(S.QUERY_TOKENS.name) == rig.lmcache_counter("num_requested_tokens")
        assert m.value(S.HIT_TOKENS.name) == rig.lmcache_counter("num_hit_tokens")
        assert m.value(S.LMCACHE_LOOKUP_TOKENS.name) == rig.lmcache_counter("num_lookup_tokens")
        assert m.value(S.LMCACHE_LOOKUP_HIT_TOKENS.name) \
            == rig.lmcache_counter("num_lookup_hits")
        assert m.value(S.HIT_TOKENS.name) > 0 and m.value(S.LOOKUPS.name) >= 30
        assert m.value(S.HIT_TOKENS.name) / m.value(S.QUERY_TOKENS.name) == pytest.approx(
            rig.lmcache_counter("num_hit_tokens") / rig.lmcache_counter("num_requested_tokens"))
        # The chunk that failed to load, and the one after it, are counted where they were.
        assert m.value(S.LMCACHE_RETRIEVED_CHUNKS.name, tier="disk", outcome="failed") == 2
        assert m.value_sum(S.ANOMALIES.name) == 0
    finally:
        disk.read_file = real_read
        rig.close()


def test_a_masked_retrieve_counts_as_lmcache_does_and_verifies_both_parts(
        tmp_path: Path) -> None:
    """vLLM masks out of a retrieve the prefix its own prefix cache already holds. LMCache
    counts only the unmasked tokens as requested; the sidecar does the same. A sample may
    check the engine-held chunks too (tier ``engine``): they are hashed into chunk ids
    only when the retrieve is sampled."""
    rig = build(tmp_path, blocks_per_sample=8)
    try:
        rng = random.Random(5)
        tokens = [rng.randrange(256) for _ in range(6 * rig.chunk_size)]
        rig.serve(tokens)
        kv = rig.prefill_kv(tokens)  # the engine's buffer, its own prefix already in place
        kv[:, :, 2 * rig.chunk_size:] = 0
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[: 2 * rig.chunk_size] = False
        loaded = rig.adapter.retrieve(tokens, mask=mask, kvcaches=kv)
        assert int(loaded.sum()) == 4 * rig.chunk_size
        assert rig.monitor.drain(60)
        m = rig.monitor.metrics
        assert m.value(S.QUERY_TOKENS.name) == rig.lmcache_counter("num_requested_tokens") \
            == 4 * rig.chunk_size
        assert m.value(S.HIT_TOKENS.name) == rig.lmcache_counter("num_hit_tokens")
        assert m.by_label(S.LMCACHE_VERIFIED_CHUNKS.name, "tier") == {"engine": 2, "cpu": 4}
        assert m.value_sum(S.ANOMALIES.name) == 0
    finally:
        rig.close()
