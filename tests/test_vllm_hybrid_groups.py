"""The vLLM adapter's hybrid-model parts that need no vLLM: cache groups from a checkpoint
config, per-group block choice on the contract's required blocks, the recurrent-state block
layout, state blocks on the probe wire, and the HF reference per group on tiny Gemma2/LFM2
checkpoints. (Real vLLM hybrids: tests/vllm/test_hybrid.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sidecar.adapters.vllm.adapter import engine_info_from_checkpoint, hello_mismatches
from sidecar.adapters.vllm.groups import (
    UnsupportedModel,
    choose_group_blocks,
    groups_from_config,
    groups_from_specs,
)
from sidecar.adapters.vllm.state_layout import (
    StateSpec,
    UnsupportedStateLayout,
    decode_state_block,
    encode_conv_state,
    validate_state_layout,
)
from sidecar.adapters.vllm.wire import capture_fields, decode_capture, pack, unpack
from sidecar.checks.group_coverage import required_blocks
from sidecar.core.protocol import BlockRef, CacheGroup, GroupKind, Hit

GEMMA2 = {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 64,
          "layer_types": ["sliding_attention", "full_attention"] * 2}
LFM2 = {"model_type": "lfm2", "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention"] * 2}


def test_groups_from_config_follow_vllms_grouping() -> None:
    sliding, full = groups_from_config(GEMMA2)
    assert (sliding.group_id, sliding.kind, sliding.layers, sliding.sliding_window) == \
        (0, GroupKind.SLIDING_WINDOW, (0, 2), 64)
    assert (full.group_id, full.kind, full.layers, full.sliding_window) == \
        (1, GroupKind.FULL_ATTENTION, (1, 3), None)
    assert sliding.null_block_ids == full.null_block_ids == frozenset({0})
    legacy = {k: v for k, v in GEMMA2.items() if k != "layer_types"}  # even = sliding
    assert groups_from_config(legacy) == (sliding, full)
    state, attn = groups_from_config(LFM2)
    assert (state.kind, state.layers, state.label, attn.layers) == \
        (GroupKind.RECURRENT_STATE, (0, 2), "recurrent", (1, 3))
    (plain,) = groups_from_config({"num_hidden_layers": 2})
    assert (plain.kind, plain.layers, plain.label) == (GroupKind.FULL_ATTENTION, (0, 1), "full")
    with pytest.raises(UnsupportedModel, match="moe_router"):
        groups_from_config({**LFM2, "layer_types": ["conv", "moe_router", "conv", "conv"]})


def test_groups_from_engine_specs_read_kinds_by_name() -> None:
    class SlidingWindowSpec:
        sliding_window = 64

    class FullAttentionSpec:
        sliding_window = None

    class MambaSpec:
        shapes = ((2, 128),)

    class Group:
        def __init__(self, spec: object, names: list[str]) -> None:
            self.kv_cache_spec, self.layer_names = spec, names

    class Config:
        kv_cache_groups = [Group(MambaSpec(), ["m.layers.2.conv", "m.layers.0.conv"]),
                           Group(FullAttentionSpec(), ["m.layers.1.attn"]),
                           Group(SlidingWindowSpec(), ["m.layers.3.attn"])]

    out = groups_from_specs(Config(), lambda n: int(n.split(".")[2]))
    assert [(g.kind, g.layers, g.sliding_window) for g, _ in out] == [
        (GroupKind.RECURRENT_STATE, (0, 2), None), (GroupKind.FULL_ATTENTION, (1,), None),
        (GroupKind.SLIDING_WINDOW, (3,), 64)]
    assert out[0][1] == ["m.layers.0.conv", "m.layers.2.conv"]


def test_block_choice_takes_only_blocks_each_group_must_hold() -> None:
    """The hit vLLM gives at 256 tokens: the sliding group keeps the last two blocks (null
    block 0 before them), the recurrent group its last boundary only."""
    groups = groups_from_config(GEMMA2) + (CacheGroup(
        2, GroupKind.RECURRENT_STATE, (4,), null_block_ids=frozenset({0})),)
    hit = Hit(tokens=list(range(256)), hit_tokens=256,
              blocks={0: [0] * 6 + [21, 22], 1: list(range(24, 32)), 2: [0] * 7 + [40]})
    rng = random.Random(0)
    for _ in range(50):
        refs = choose_group_blocks(hit, groups, 32, 3, rng)
        by_group = {g: [r.index for r in refs if r.group_id == g] for g in (0, 1, 2)}
        assert by_group[0] == [6, 7]  # in-window only, both of them
        assert by_group[2] == [7]  # the state at the hit's boundary
        assert len(by_group[1]) == 3 and by_group[1][-1] == 7
        assert all(r.block_id != 0 for r in refs)
        for r in refs:
            assert r.index in required_blocks(next(g for g in groups
                                                   if g.group_id == r.group_id), 256, 32)
    assert choose_group_blocks(Hit([1] * 20, 20, {0: []}), groups, 32, 2, rng) == []


@pytest.mark.parametrize("dim_first", [False, True])
def test_state_blocks_decode_from_vllms_raw_pages(dim_first: bool) -> None:
    """vLLM hands a state layer over as raw int8 pages; the conv state (dim, state_len)
    comes back as written, the next block untouched, padding ignored."""
    shape = (128, 2) if dim_first else (2, 128)
    spec = StateSpec((shape,), (torch.float32,), dim_first)
    layers = [torch.zeros(4, 1, 1, 1024 + 64, dtype=torch.int8) for _ in range(2)]
    states = [torch.randn(128, 2) for _ in layers]
    for cache, s in zip(layers, states, strict=True):
        validate_state_layout("l", cache, spec)
        encode_conv_state(cache, 3, spec, s)
    key, value = decode_state_block(layers, 3, spec)
    assert key.shape == (2, 128, 2) and value.numel() == 0
    assert torch.equal(key, torch.stack(states))
    assert not decode_state_block(layers, 2, spec)[0].any()
    with pytest.raises(UnsupportedStateLayout, match="bytes per block"):
        validate_state_layout("l", torch.zeros(4, 512, dtype=torch.int8), spec)


def test_state_blocks_from_typed_views_and_two_states() -> None:
    spec = StateSpec(((2, 16), (4, 8)), (torch.bfloat16, torch.float32))
    conv, ssm = torch.randn(3, 2, 16).bfloat16(), torch.randn(3, 4, 8)
    validate_state_layout("l", [conv, ssm], spec)
    key, value = decode_state_block([[conv, ssm]], 1, spec)
    assert torch.equal(key[0], conv[1].transpose(0, 1)) and torch.equal(value[0], ssm[1])
    with pytest.raises(UnsupportedStateLayout, match="views"):
        validate_state_layout("l", [conv], spec)


def test_state_block_crosses_the_probe_wire_with_an_empty_value() -> None:
    key = torch.randn(2, 128, 2).bfloat16()
    kv = torch.randn(2, 2, 32, 32).bfloat16()
    fields = capture_fields("c", "hit", None, range(64), 70, 64, {0: [0, 5], 1: [6, 7]},
                            [(0, 1, 5, key, torch.empty(0, dtype=key.dtype)),
                             (1, 1, 7, kv, kv)])
    cap = decode_capture(unpack(pack("capture", **fields)))
    k, v = cap.kv[(0, 1)]
    assert torch.equal(k, key) and v.shape == (0,) and v.dtype == torch.bfloat16
    assert torch.equal(cap.kv[(1, 1)][1], kv)


# ------------------------------------------------------------------ HF reference per group
@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from kvtestbed.tiny_models.tiny_hybrid import write_tiny_gemma2, write_tiny_lfm2

    root = tmp_path_factory.mktemp("hybrid")
    return {"gemma2": str(write_tiny_gemma2(root / "gemma2")),  # sliding 0, 2; full 1, 3
            "lfm2": str(write_tiny_lfm2(root / "lfm2", num_layers=2))}


def test_engine_info_and_hello_for_a_hybrid_checkpoint(hybrids: dict[str, str]) -> None:
    info = engine_info_from_checkpoint(hybrids["gemma2"], "float32", 32)
    assert [g.kind for g in info.groups] == [GroupKind.SLIDING_WINDOW, GroupKind.FULL_ATTENTION]
    hello = {"block_size": 32, "dtype": "float32", "kv_heads": 2, "head_dim": 32,
             "groups": {0: [0, 2], 1: [1, 3]},
             "group_kinds": {0: "sliding_window", 1: "full_attention"}}
    assert hello_mismatches(info, hello) == []
    wrong = {**hello, "group_kinds": {0: "full_attention", 1: "full_attention"}}
    assert [m.split(":")[0] for m in hello_mismatches(info, wrong)] == ["cache group kinds"]


def test_hf_reference_keeps_sliding_positions_and_takes_conv_state_at_boundaries(
        hybrids: dict[str, str]) -> None:
    """Sliding layers: the block K/V equal what HF's own window-trimmed cache keeps for the
    positions it keeps (so keeping every position changed nothing). Conv layers: the state at
    a boundary equals HF's own conv cache after a prefill that ends there."""
    from transformers import AutoModelForCausalLM

    from sidecar.adapters.vllm.reference import HFReference

    tokens = [random.Random(1).randrange(3, 500) for _ in range(128)]
    hit = Hit(tokens=tokens, hit_tokens=128, blocks={0: [0, 0, 3, 4], 1: [5, 6, 7, 8]})
    info = engine_info_from_checkpoint(hybrids["gemma2"], "float32", 32)
    ref = HFReference(hybrids["gemma2"], info)
    (blk,) = ref.recompute(hit, [BlockRef(0, 3, 4)])
    with torch.inference_mode():
        own = ref.model(torch.tensor([tokens]), use_cache=True).past_key_values
    for j, layer in enumerate(info.groups[0].layers):  # layer 2 sees the window's effect
        kept = own.layers[layer].keys.shape[2]  # the trimmed cache keeps the last positions
        assert kept < 128
        assert torch.allclose(blk.key[j], own.layers[layer].keys[0, :, -32:], atol=1e-5)
        assert torch.allclose(blk.value[j], own.layers[layer].values[0, :, -32:], atol=1e-5)

    info = engine_info_from_checkpoint(hybrids["lfm2"], "float32", 32)
    ref = HFReference(hybrids["lfm2"], info)
    assert info.groups[0].kind is GroupKind.RECURRENT_STATE
    states = ref.recompute(hit, [BlockRef(0, 1, 9), BlockRef(0, 3, 10)])
    model = AutoModelForCausalLM.from_pretrained(Path(hybrids["lfm2"])).eval()
    for state, end in zip(states, (64, 128), strict=True):
        assert state.key.shape == (1, 128, 2) and state.value.numel() == 0
        with torch.inference_mode():
            cache = model(torch.tensor([tokens[:end]]), use_cache=True).past_key_values
        conv = cache.layers[0].conv_states[0][0]  # (dim, conv_L_cache)
        assert torch.allclose(state.key[0], conv[:, -2:], atol=1e-6)
