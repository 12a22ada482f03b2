"""What LMCache's storage tiers return, verified against a real LMCacheEngine (CPU + disk).

Each fault is one a user of LMCache 0.5.6 can meet, injected in the real backends: bytes
changed in a chunk file on disk (LMCache's chunk files carry no checksum), a load that does
not land while retrieve reports the tokens loaded (LMCache issue 3388's shape) and a store
that failed but stays visible to lookups (issue 4991's shape). In every case LMCache itself
reports a full hit and no error; the sidecar names the kind and the tier.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sidecar import signals as S
from tests.lmcache.harness import Rig, build

pytestmark = pytest.mark.lmcache

ANOMALY_KINDS = S.ANOMALIES.name


def prompt(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def tier_anomalies(rig: Rig) -> dict[tuple[str, str], float]:
    fam = rig.monitor.metrics.instruments.families[S.LMCACHE_ANOMALIES.name]
    return {key: cell.value for key, cell in fam.series.items() if cell.value}


def kinds(rig: Rig) -> set[str]:
    return set(rig.monitor.metrics.by_label(ANOMALY_KINDS, "kind"))


def store_then_reload_from_disk(rig: Rig, tokens: list[int], index: int) -> Path:
    """Serve ``tokens`` once (LMCache stores its chunks on both tiers), wait until chunk
    ``index`` is on disk, and evict it from the CPU tier so the next retrieve reads disk."""
    rig.serve(tokens)
    # The disk tier writes asynchronously; a lookup walks the tiers in order and stops at
    # the first chunk the current tier lacks, so every chunk must have landed on disk.
    for i in range(len(tokens) // rig.chunk_size):
        rig.wait_on_disk(rig.chunk_key(tokens, i))
    key = rig.chunk_key(tokens, index)
    path = rig.wait_on_disk(key)
    rig.evict_from_cpu(key)
    return path


def retrieve_again(rig: Rig, tokens: list[int]) -> torch.Tensor:
    """The next request with the same prompt: lookup + retrieve; what LMCache reported."""
    found = rig.adapter.lookup(tokens)
    assert found == len(tokens), "LMCache should report the whole prompt cached"
    kv = torch.zeros_like(rig.prefill_kv(tokens))
    loaded = rig.adapter.retrieve(tokens, kvcaches=kv)
    assert rig.monitor.drain(60)
    return loaded


def test_zeroed_chunk_file_on_disk_is_caught_with_tier_disk(tmp_path: Path) -> None:
    """Seed 000: LMCache reports a full hit while the chunk it loads is all zeros."""
    rig = build(tmp_path, blocks_per_sample=8)
    try:
        tokens = prompt(1)
        path = store_then_reload_from_disk(rig, tokens, index=2)
        path.write_bytes(bytes(path.stat().st_size))
        loaded = retrieve_again(rig, tokens)
        assert bool(loaded.all()), "LMCache reports every token loaded (the trap)"
        assert kinds(rig) == {"zeros"}
        assert tier_anomalies(rig) == {("disk", "zeros"): 1.0}
        # Chunks 0-1 still on the CPU tier; from chunk 2 on, LMCache reads the disk tier.
        m = rig.monitor.metrics
        assert m.value(S.LMCACHE_RETRIEVED_CHUNKS.name, tier="cpu", outcome="loaded") == 2
        assert m.value(S.LMCACHE_RETRIEVED_CHUNKS.name, tier="disk", outcome="loaded") == 2
    finally:
        rig.close()


def test_one_flipped_byte_in_a_chunk_file_is_caught_with_tier_disk(tmp_path: Path) -> None:
    """One flipped bit in a disk chunk: within no tolerance's reach in the low mantissa,
    but the write-time fingerprint sees it."""
    rig = build(tmp_path, blocks_per_sample=8)
    try:
        tokens = prompt(2)
        path = store_then_reload_from_disk(rig, tokens, index=1)
        data = bytearray(path.read_bytes())
        data[len(data) // 3 & ~3] ^= 0x01  # the lowest mantissa bit of one float32
        path.write_bytes(bytes(data))
        loaded = retrieve_again(rig, tokens)
        assert bool(loaded.all())
        assert kinds(rig) == {"fingerprint_mismatch"}
        assert tier_anomalies(rig) == {("disk", "fingerprint_mismatch"): 1.0}
    finally:
        rig.close()


def test_without_store_fingerprints_a_flipped_low_bit_passes(tmp_path: Path) -> None:
    """What the fingerprint (on by default, paid on the store path) buys: without it the
    same flipped bit is within the recompute's tolerance and goes unseen."""
    rig = build(tmp_path, blocks_per_sample=8, fingerprint=False)
    try:
        tokens = prompt(2)
        path = store_then_reload_from_disk(rig, tokens, index=1)
        data = bytearray(path.read_bytes())
        data[len(data) // 3 & ~3] ^= 0x01  # the lowest mantissa bit again
        path.write_bytes(bytes(data))
        retrieve_again(rig, tokens)
        m = rig.monitor.metrics
        assert m.value(S.LMCACHE_VERIFIED_CHUNKS.name, tier="disk") >= 1
        assert m.value_sum(S.ANOMALIES.name) == 0
        assert 0 < rig.monitor.max_recompute_error < 1e-3, "seen only as rounding noise"
    finally:
        rig.close()


def test_a_load_that_does_not_land_but_is_reported_loaded_is_caught(tmp_path: Path) -> None:
    """LMCache 3388's shape: retrieve reports the tokens loaded, but one chunk's copy into
    the engine's KV never happened, so the engine decodes over the stale KV its buffer held
    (another request's). The tier's copy is fine: ``changed_after_serving`` says the engine
    was handed other bytes than the tier holds, the fingerprint that they are not what was
    stored; the tier named is the one the chunk was reported loaded from."""
    rig = build(tmp_path, blocks_per_sample=8)
    try:
        tokens = prompt(3)
        rig.serve(tokens)
        rig.connector.skipped.add(2 * rig.chunk_size)  # chunk 2's load is dropped
        stale = rig.prefill_kv(prompt(99))  # the buffer last held another request's KV
        found = rig.adapter.lookup(tokens)
        loaded = rig.adapter.retrieve(tokens[:found], kvcaches=stale)
        assert rig.monitor.drain(60)
        assert bool(loaded.all()), "LMCache reports the chunk loaded"
        assert kinds(rig) == {"changed_after_serving", "fingerprint_mismatch"}
        assert tier_anomalies(rig) == {("cpu", "changed_after_serving"): 1.0,
                                       ("cpu", "fingerprint_mismatch"): 1.0}
    finally:
        rig.close()


def test_a_failed_store_left_visible_to_lookups_is_caught(tmp_path: Path) -> None:
    """LMCache 4991's shape: a disk write fails part-way (a torn write: the file has the
    right size, its last eighth never written), the failure is swallowed, and the key is
    indexed anyway. Lookups count the chunk as a hit, retrieve loads it as if whole."""
    rig = build(tmp_path, blocks_per_sample=8)
    disk = rig.backend("LocalDiskBackend")
    real_write = disk.write_file
    tokens = prompt(4)
    victim = Path(disk._key_to_path(rig.chunk_key(tokens, 3)))

    def torn_write(buffer: object, path: str) -> None:
        if Path(path) != victim:
            real_write(buffer, path)
            return
        data = bytes(memoryview(buffer).cast("B"))  # type: ignore[arg-type]
        kept = len(data) * 7 // 8
        with open(path, "wb") as f:
            f.write(data[:kept] + bytes(len(data) - kept))

    disk.write_file = torn_write  # test-only fault in LMCache's real disk backend
    try:
        store_then_reload_from_disk(rig, tokens, index=3)
        lookups_before = rig.monitor.metrics.value(S.LMCACHE_LOOKUP_HIT_TOKENS.name)
        loaded = retrieve_again(rig, tokens)
        assert rig.monitor.metrics.value(S.LMCACHE_LOOKUP_HIT_TOKENS.name) \
            - lookups_before == len(tokens), "the failed chunk counted as a lookup hit"
        assert bool(loaded.all())
        assert kinds(rig) == {"fingerprint_mismatch"}
        assert tier_anomalies(rig) == {("disk", "fingerprint_mismatch"): 1.0}
    finally:
        disk.write_file = real_write
        rig.close()


def test_kv_computed_wrong_before_it_was_stored_is_caught_by_the_recompute(
        tmp_path: Path) -> None:
    """A checksum of the bytes as stored (AuditConnector's, or the fingerprint) cannot see
    KV the engine computed wrong before LMCache stored it: every copy agrees with it. Only
    the recompute does. Here chunk 1's values come out of the engine 10% too large (a
    kernel or layout bug); LMCache stores and serves them faithfully."""
    rig = build(tmp_path, blocks_per_sample=8)
    try:
        tokens = prompt(7)
        kv = rig.prefill_kv(tokens)
        cs = rig.chunk_size
        kv[1, :, cs:2 * cs] *= 1.1  # V of chunk 1, as the engine wrote it
        rig.adapter.store(tokens, kvcaches=kv)
        loaded = retrieve_again(rig, tokens)
        assert bool(loaded.all())
        assert kinds(rig) == {"recompute_mismatch"}
        assert tier_anomalies(rig) == {("cpu", "recompute_mismatch"): 1.0}
    finally:
        rig.close()
