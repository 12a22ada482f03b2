"""Clean runs stay quiet: >= 1,000 verified chunks per dtype, from both tiers, no anomaly,
no dropped sample. The CPU tier is small, so LMCache evicts to disk and reads chunks back
from there: both paths are verified, with the HF recompute under the dtype's tolerance."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sidecar import signals as S
from sidecar.checks.tolerance import tolerance_for
from tests.lmcache.harness import build

pytestmark = pytest.mark.lmcache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_run_is_quiet_over_a_thousand_chunks(tmp_path: Path, dtype: str) -> None:
    rig = build(tmp_path, dtype=dtype, cpu_gb=0.001, blocks_per_sample=8)
    try:
        rng = random.Random(7)
        # Conversations: each turn re-sends the conversation so far plus 32 new tokens, so
        # the chunks a turn hits were stored by the turns before, computed incrementally
        # after loaded KV (not the from-scratch prefill the recompute runs). Skewed, as real
        # traffic is: hot conversations stay on the CPU tier, cold ones are evicted to disk
        # and read back from there. A sample verifies up to 8 chunks of the hit.
        chats = [[rng.randrange(256) for _ in range(4 * rig.chunk_size)] for _ in range(20)]
        for _ in range(200):
            c = min(int(rng.expovariate(0.25)), len(chats) - 1)
            if len(chats[c]) > 12 * rig.chunk_size:  # a new conversation in that slot
                chats[c] = [rng.randrange(256) for _ in range(4 * rig.chunk_size)]
            chats[c] = chats[c] + [rng.randrange(256) for _ in range(32)]
            rig.serve(chats[c])
        assert rig.monitor.drain(120)
        m = rig.monitor.metrics
        verified = m.by_label(S.LMCACHE_VERIFIED_CHUNKS.name, "tier")
        assert sum(verified.values()) >= 1000, verified
        assert verified.get("disk", 0) > 0 and verified.get("cpu", 0) > 0, verified
        assert m.value_sum(S.ANOMALIES.name) == 0, m.by_label(S.ANOMALIES.name, "kind")
        assert m.value_sum(S.SAMPLES_DROPPED.name) == 0, \
            m.by_label(S.SAMPLES_DROPPED.name, "reason")
        assert m.value_sum(S.HOOK_ERRORS.name) == 0
        assert m.value_sum(S.ADAPTER_ERRORS.name) == 0
        assert m.value(S.LMCACHE_RETRIEVED_CHUNKS.name, tier="disk", outcome="failed") == 0
        # Quiet because the recompute agrees, not because nothing was compared.
        err = rig.monitor.max_recompute_error
        print(f"{dtype}: verified {verified}, largest recompute error {err:.3g}")
        assert 0.0 <= err < tolerance_for(dtype)
    finally:
        rig.close()
