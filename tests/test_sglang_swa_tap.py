"""The SGLang tap on a hybrid SWA server, without SGLang: full and sliding-window layers in
two pools of plain tensors, a full slot reaching its SWA slot through a mapping as SGLang's
``full_to_swa_index_mapping`` does (0 once SGLang tombstoned it). A sampled hit names every
block in both groups (the sliding group's tombstoned blocks null), the capture carries each
group's K/V from its own pool, and the sidecar's block choice never picks a null block. Also
the tap's insert path: the token-digest chain resumed from the last stored block."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.adapters.sglang.key_values import key_fields
from sidecar.adapters.sglang.slot_ids import block_names
from sidecar.adapters.sglang.tap import PoolGroup, SglangTap
from sidecar.core.protocol import CacheGroup, GroupKind

BS = 4
WINDOW = 2 * BS  # tokens: the sliding group must hold the hit's last two blocks


class FakePool:
    """SGLang's NHD layout: per layer (slots, kv_heads, head_dim)."""

    def __init__(self, slots: int, layers: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k_buffer = [torch.randn(slots + 1, 2, 8, generator=g) for _ in range(layers)]
        self.v_buffer = [torch.randn(slots + 1, 2, 8, generator=g) for _ in range(layers)]


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def groups(full: FakePool, swa: FakePool, mapping: torch.Tensor) -> list[PoolGroup]:
    nulls = frozenset({0})
    return [PoolGroup(CacheGroup(1, GroupKind.FULL_ATTENTION, (1, 3), name="full",
                                 null_block_ids=nulls), full),
            PoolGroup(CacheGroup(0, GroupKind.SLIDING_WINDOW, (0, 2), sliding_window=WINDOW,
                                 name="sliding", null_block_ids=nulls), swa,
                      lambda slots: mapping[slots])]


def test_block_ids_are_null_where_any_slot_is_tombstoned() -> None:
    slots = torch.tensor([5, 6, 7, 8, 0, 0, 0, 0, 9, 0, 11, 12, 13, 14, 15, 16])
    assert block_names(slots, BS) == [8, 0, 0, 16]


def test_a_sampled_hit_carries_both_pools(sockdir: Path) -> None:
    from sidecar.adapters.vllm.receiver import ProbeReceiver
    from sidecar.export.metrics import Metrics

    caps: list[Any] = []
    hellos: list[dict[str, Any]] = []
    endpoint = f"ipc://{sockdir}/p.sock"
    rx = ProbeReceiver(endpoint, Metrics("sglang", "tiny"), lambda items: None, caps.append,
                       hellos.append, groups=[0, 1]).start()
    try:
        full, swa = FakePool(64, 2, 0), FakePool(32, 2, 1)
        path = torch.arange(30, 46)  # 4 blocks of the full pool
        mapping = torch.zeros(65, dtype=torch.int64)
        mapping[path[8:]] = torch.arange(10, 18)  # the last two blocks keep SWA slots
        mapping[path[5]] = 3  # block 1 half: tombstoned in part
        tap = SglangTap(endpoint, BS, sample_every=1, blocks_per_sample=8, census_every_s=3600)
        tap.attach(groups(full, swa, mapping), 64, "0.5.23", "tiny")
        tokens = list(range(10, 26))
        tap.admitted("a", tokens + [99], 16, path, key_fields(None, None))
        deadline = time.monotonic() + 120
        while not caps and time.monotonic() < deadline:
            time.sleep(0.01)
        tap.close()
    finally:
        rx.stop()
    assert hellos[0]["groups"] == {0: [0, 2], 1: [1, 3]}
    assert hellos[0]["group_kinds"] == {0: "sliding_window", 1: "full_attention"}
    cap = caps[0]
    assert cap.blocks == {1: [33, 37, 41, 45], 0: [0, 0, 13, 17]}
    # every full block, and the sliding group's two in-window blocks, each from its pool
    assert sorted(cap.kv) == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    for (g, i), (k, v) in cap.kv.items():
        pool = swa if g == 0 else full
        slots = mapping[path[i * BS:(i + 1) * BS]] if g == 0 else path[i * BS:(i + 1) * BS]
        want_k = torch.stack([b[slots] for b in pool.k_buffer]).transpose(1, 2)
        want_v = torch.stack([b[slots] for b in pool.v_buffer]).transpose(1, 2)
        assert torch.equal(k, want_k) and torch.equal(v, want_v), (g, i)


def test_the_sidecar_numbers_the_groups_as_the_tap(tmp_path: Path) -> None:
    """``kv-sidecar sglang serve`` reads the checkpoint: a hybrid SWA model's two groups in
    order of each kind's first layer (as the tap numbers them), one full group otherwise;
    a recurrent-state model is refused with its kinds named."""
    from kvtestbed.tiny_models.tiny_hybrid import write_tiny_lfm2, write_tiny_mellum
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    from sidecar.adapters.sglang.service import engine_info

    info = engine_info(str(write_tiny_mellum(tmp_path / "mellum")), "bfloat16", 16)
    assert [(g.group_id, g.kind, g.layers, g.sliding_window) for g in info.groups] == [
        (0, GroupKind.SLIDING_WINDOW, (0, 2), 32), (1, GroupKind.FULL_ATTENTION, (1, 3), None)]
    assert all(g.null_block_ids == {0} for g in info.groups)
    info = engine_info(str(write_tiny_llama(tmp_path / "llama")), "float32", 16)
    assert [(g.group_id, g.kind) for g in info.groups] == [(0, GroupKind.FULL_ATTENTION)]
    with pytest.raises(ValueError, match="recurrent_state"):
        engine_info(str(write_tiny_lfm2(tmp_path / "lfm2")), "float32", 16)


def test_pool_groups_read_sglangs_pools_and_refuse_what_they_cannot() -> None:
    """The backend's view of SGLang's ``SWATokenToKVPoolAllocator`` (plain objects here):
    the sliding group reaches its slots through the allocator's mapping, its window is
    SGLang's plus the query itself (the checkpoint's ``sliding_window``), and a server
    keeping SWA K/V in per-request rings, or with no window, is refused."""
    from types import SimpleNamespace

    from sidecar.adapters.sglang.backend import pool_groups, slot_allocator

    full, swa = FakePool(8, 2, 0), FakePool(8, 2, 1)
    full.model_layer_ids, swa.model_layer_ids = [1, 3], [0, 2]
    mapping = torch.arange(9) * 2 % 9
    kv = SimpleNamespace(full_kv_pool=full, swa_kv_pool=swa)
    full_alloc = SimpleNamespace(size=8)
    allocator = SimpleNamespace(get_kvcache=lambda: kv, full_to_swa_index_mapping=mapping,
                                full_attn_allocator=full_alloc, size=6)
    got = {g.group.group_id: g for g in pool_groups(allocator, 31)}
    assert got[0].group.kind is GroupKind.SLIDING_WINDOW and got[0].group.layers == (0, 2)
    assert got[0].group.sliding_window == 32 and got[0].pool is swa
    assert got[1].group.kind is GroupKind.FULL_ATTENTION and got[1].translate is None
    assert torch.equal(got[0].translate(torch.tensor([1, 2, 5])), torch.tensor([2, 4, 1]))
    assert slot_allocator(allocator) is full_alloc and slot_allocator(full_alloc) is full_alloc
    with pytest.raises(ValueError, match="window"):
        pool_groups(allocator, None)
    allocator._swa_req_ring = True
    with pytest.raises(ValueError, match="ring"):
        pool_groups(allocator, 31)


def test_inserts_chain_digests_from_the_last_stored_block(sockdir: Path) -> None:
    """An insert past a cached prefix starts the token-digest chain at the stored block
    before its new ones (a 500-token prompt with one new block: 43 -> 6 us on SGLang's
    thread); every store's parent digest is the chain's from the first token, also after
    that parent block was freed (the chain then starts over)."""
    from sidecar.adapters.vllm.receiver import ProbeReceiver
    from sidecar.checks.keys import token_digest
    from sidecar.export.metrics import Metrics

    got: list[dict[str, Any]] = []
    endpoint = f"ipc://{sockdir}/p.sock"
    rx = ProbeReceiver(endpoint, Metrics("sglang", "tiny"), lambda items: None,
                       lambda cap: None, groups=[0],
                       handlers={"stores": got.append, "frees": lambda m: None}).start()
    tokens = list(range(10, 10 + 6 * BS))
    path = torch.arange(1, 1 + 6 * BS)
    try:
        tap = SglangTap(endpoint, BS, sample_every=10**9, census_every_s=3600)
        tap.attach([PoolGroup.full(FakePool(64, 2, 0))], 64, "0.5.23", "tiny")
        f = key_fields(None, None)
        tap.inserted(tokens[:2 * BS], path[:2 * BS], 0, f)
        tap.inserted(tokens[:4 * BS], path[:4 * BS], 2 * BS, f)  # from block 1's digest
        tap.freed(path[4 * BS - 1:4 * BS])  # block 3 gone: its digest too
        tap.inserted(tokens, path, 4 * BS, f)  # the chain starts over
        tap.flush()
        deadline = time.monotonic() + 120
        while sum(len(m["items"]) for m in got) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        tap.close()
    finally:
        rx.stop()
    stores = [item for m in got for item in m["items"]]
    chain: list[int | None] = [None]
    for lo in range(0, 6 * BS, BS):
        chain.append(token_digest(chain[-1], tokens[lo:lo + BS]))
    assert [(s[1], s[3]) for s in stores] == [(lo, chain[lo // BS])
                                              for lo in range(0, 6 * BS, BS)]
