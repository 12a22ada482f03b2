"""The LMCache adapter's engine-free parts (run in the main unit suite: no LMCache needed)."""

from __future__ import annotations

import pytest
import torch

from sidecar.adapters.lmcache.chunks import ChunkIds
from sidecar.adapters.lmcache.layout import FlatServedKV, chunk_to_block
from sidecar.adapters.lmcache.taps import tier_of
from sidecar.checks.fingerprint import kv_digest


def test_chunk_ids_are_bounded_and_recycle_the_least_recently_used() -> None:
    freed: list[int] = []
    ids = ChunkIds(3, on_recycle=freed.append)
    a, b, c = ids.id_for("a"), ids.id_for("b"), ids.id_for("c")
    assert (a, b, c) == (0, 1, 2)
    assert ids.id_for("a") == 0  # touched: "b" is now the oldest
    d = ids.id_for("d")
    assert d == b and freed == [b], "the oldest id is reused and reported freed"
    assert ids.key_of(d) == "d" and ids.key_of(a) == "a"
    assert len(ids) == 3 and ids.recycled == 1
    with pytest.raises(ValueError, match="capacity"):
        ChunkIds(0)


def test_chunk_layout_round_trips_and_fingerprints_equal_bytes_equally() -> None:
    layers, heads, tokens, dim = 2, 2, 4, 3
    k = torch.randn(layers, heads, tokens, dim)
    v = torch.randn(layers, heads, tokens, dim)
    # LMCache's KV_2LTD chunk of the same KV: (2, layers, tokens, heads * dim).
    chunk = torch.stack([t.permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)
                         for t in (k, v)])
    k2, v2 = chunk_to_block(chunk, heads, dim)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert kv_digest(k2, v2) == kv_digest(k, v)
    buffer = torch.cat([torch.zeros(2, layers, 5, heads * dim), chunk], dim=2)
    k3, v3 = FlatServedKV(heads, dim)({"kvcaches": buffer}, 5, 5 + tokens)
    assert torch.equal(k3, k) and torch.equal(v3, v)
    with pytest.raises(ValueError, match="KV_2LTD"):
        chunk_to_block(torch.zeros(2, layers, tokens, 5), heads, dim)
    with pytest.raises(ValueError, match="kvcaches"):
        FlatServedKV(heads, dim)({}, 0, 4)


def test_tier_labels_are_bounded() -> None:
    assert tier_of("LocalCPUBackend") == "cpu"
    assert tier_of("LocalDiskBackend") == "disk"
    assert tier_of("RemoteBackend") == "remote"
    assert tier_of("SomePluginBackend") == "other" and tier_of(None) == "other"


def test_the_adapter_conforms_to_the_protocol() -> None:
    from sidecar.adapters.lmcache import LMCacheAdapter
    from sidecar.core.conformance import check_adapter

    assert check_adapter(LMCacheAdapter) == []
