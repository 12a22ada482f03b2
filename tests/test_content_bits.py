"""Content statistics read through the elements' bits (sidecar.checks.content): NaN and Inf
of either sign found exactly in every float dtype it knows, zeros of either sign counted,
the sampled zero ratio and the first-head spread shortcut answering as the full checks do,
and tensors it cannot view (non-contiguous, other devices) through the float path."""

from __future__ import annotations

import pytest
import torch

from sidecar.checks import content as C
from sidecar.checks.content import check_content
from sidecar.core.protocol import BlockKV, BlockRef
from sidecar.signals import AnomalyKind

REF = BlockRef(0, 1, 7)
DTYPES = list(C._NONFINITE_BITS)
# Tensors below the sampled zero ratio's size and above it (8B-class: 32 x 8 x 16 x 128).
SHAPES = [(2, 2, 4, 8), (32, 8, 16, 128)]


def kv(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def kinds(findings):
    return {f.kind for f in findings}


def nonfinite_bits(dtype):
    """Every NaN/Inf pattern worth trying: the smallest and largest of each sign."""
    signed, _, lowest = C._NONFINITE_BITS[dtype]
    width = torch.tensor([], dtype=signed).element_size() * 8
    magnitude = (1 << (width - 1)) - 1
    out = [lowest, magnitude, lowest | (1 << (width - 1)), -1]  # -1: every bit set
    return [v - (1 << width) if v > magnitude else v for v in out]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_nonfinite_element_of_either_sign_is_found_and_counted(dtype, shape):
    k, v = kv(shape, dtype)
    assert check_content(BlockKV(REF, k, v)) == []
    signed = C._NONFINITE_BITS[dtype][0]
    for pattern in nonfinite_bits(dtype):
        bad = v.clone()
        flat = bad.view(signed).reshape(-1)
        flat[flat.numel() * 2 // 3] = pattern
        found = check_content(BlockKV(REF, k, bad))
        assert kinds(found) == {AnomalyKind.NONFINITE}, hex(pattern)
        assert found[0].detail.startswith(f"value: 1/{v.numel()} "), found[0].detail


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_largest_finite_values_are_not_nonfinite(dtype):
    info = torch.finfo(dtype)
    k, v = kv((2, 2, 4, 8), dtype)
    v.view(-1)[0], v.view(-1)[1] = info.max, info.min  # sums overflow float32 in fp64
    assert AnomalyKind.NONFINITE not in kinds(check_content(BlockKV(REF, k, v)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("share", [0.0, 0.3, 0.45, 0.55, 0.7, 1.0])
def test_zeros_of_either_sign_count_and_the_sample_agrees_with_the_limit(dtype, shape, share):
    k, v = kv(shape, dtype, seed=3)
    n = v.numel()
    flat = v.view(-1)
    g = torch.Generator().manual_seed(4)
    where = torch.randperm(n, generator=g)[: int(share * n)]
    flat[where] = torch.where(torch.arange(len(where)) % 2 == 0, 0.0, -0.0).to(dtype)
    found = kinds(check_content(BlockKV(REF, k, v)))
    assert (AnomalyKind.ZEROS in found) == (share >= C.ZERO_RATIO_LIMIT)
    exact = 1.0 - int(torch.count_nonzero(v)) / n  # torch counts -0.0 as zero
    got = C._zero_ratio(v, C._bits(v))
    assert abs(got - exact) < 0.05 if abs(exact - 0.5) > C._ZERO_EXACT_BAND else got == exact


def test_a_zeroed_half_of_the_layers_is_counted_exactly_not_sampled():
    k, v = kv(SHAPES[1], torch.bfloat16)
    v[: v.shape[0] // 2 + 1] = 0  # just over half, in one contiguous run
    assert kinds(check_content(BlockKV(REF, k, v))) == {AnomalyKind.ZEROS}
    v[v.shape[0] // 2 - 1: v.shape[0] // 2 + 1] = 1.5  # now just under half
    assert AnomalyKind.ZEROS not in kinds(check_content(BlockKV(REF, k, v)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_spread_only_when_every_head_repeats_one_row(dtype):
    k, v = kv(SHAPES[1], dtype)
    v[:] = v[..., :1, :]  # every head: one row broadcast over the tokens
    assert kinds(check_content(BlockKV(REF, k, v))) == {AnomalyKind.DEGENERATE}
    v[5, 3, 7, 9] += 1  # one element of another head differs
    assert check_content(BlockKV(REF, k, v)) == []
    k2, v2 = kv(SHAPES[1], dtype)
    v2[0, 0] = v2[0, 0, :1]  # the first head alone repeats its row
    assert check_content(BlockKV(REF, k2, v2)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_views_give_the_same_findings(dtype):
    k, v = kv((2, 2, 8, 4), dtype)
    kt, vt = k.transpose(-1, -2), v.transpose(-1, -2)
    assert check_content(BlockKV(REF, kt, vt)) == []
    vt = vt.clone().transpose(-1, -2).contiguous().transpose(-1, -2)
    vt[0, 1, 2, 3] = float("-inf")
    assert kinds(check_content(BlockKV(REF, kt, vt))) == {AnomalyKind.NONFINITE}
    vt.zero_()
    assert kinds(check_content(BlockKV(REF, kt, vt))) == {AnomalyKind.ZEROS}


def test_dtypes_without_a_bit_pattern_take_the_float_path():
    assert C._bits(torch.zeros(4, dtype=torch.int32)) is None
    _, v = kv((2, 2, 4, 8), torch.float32)
    v[0, 0, 0, 0] = float("nan")
    assert C._may_be_nonfinite(v, None) and C._nonfinite_count(v, None) == 1


@pytest.mark.parametrize("pattern", ["heads", "tokens", "layers", "dims"])
def test_half_zeroed_along_any_axis_is_flagged(pattern):
    """A missing tensor-parallel shard (half the heads), a torn write (the last half of the
    tokens), every other layer, half of each head's dimensions: each is half zeros, and
    the sample must not look past it by landing on the same head or token every time."""
    k, v = kv(SHAPES[1], torch.bfloat16)
    _, heads, tokens, _ = v.shape
    if pattern == "heads":
        v[:, heads // 2:] = 0
    elif pattern == "tokens":
        v[:, :, tokens // 2:] = 0
    elif pattern == "layers":
        v[1::2] = 0
    else:
        v[..., 1::2] = 0
    assert kinds(check_content(BlockKV(REF, k, v))) == {AnomalyKind.ZEROS}, pattern


@pytest.mark.parametrize(("shape", "zeroed", "flagged"), [
    ((60, 8, 32, 128), (..., slice(64, None)), True),  # half of every head row
    ((60, 8, 32, 128), (..., slice(52, None)), True),
    ((60, 8, 64, 128), (slice(None), slice(None), slice(1, None, 2)), True),  # odd tokens
    ((60, 8, 32, 128), (..., slice(None, 63)), False),  # 49.2%: not half
])
def test_the_sample_does_not_alias_with_60_layer_shapes(shape, zeroed, flagged):
    """Found from outside: on 60-layer shapes (Yi-34B, Falcon-40B) a golden-ratio choice of
    runs saw one half of every head row: a half-zero block passed, a 49%-zero one was
    flagged with a sampled ratio of 0.93."""
    k, v = kv(shape, torch.bfloat16)
    k[zeroed] = 0
    assert (AnomalyKind.ZEROS in kinds(check_content(BlockKV(REF, k, v)))) == flagged


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.float8_e4m3fnuz, torch.float8_e5m2fnuz], ids=str)
def test_fp8_blocks_strided_or_rocm_are_checked_not_crashed(dtype):
    """Found from outside: a non-contiguous fp8 block (an adapter's permute) and ROCm's fnuz
    fp8 raised torch's "not implemented" for fp8 reductions."""
    k, v = kv((4, 2, 8, 16), torch.float32)
    kt, vt = k.transpose(1, 2).to(dtype).transpose(1, 2), v.to(dtype)[:, :, ::2]
    assert check_content(BlockKV(REF, kt, vt)) == []
    bad = v.clone()
    bad[1, 1, 2, 5] = float("nan")  # an even token: kept by the ::2 view
    assert kinds(check_content(BlockKV(REF, kt, bad.to(dtype)[:, :, ::2]))) == {
        AnomalyKind.NONFINITE}
    assert kinds(check_content(BlockKV(REF, kt, torch.zeros_like(vt)))) == {AnomalyKind.ZEROS}


def test_a_single_element_is_not_degenerate():
    one = torch.tensor(1.5, dtype=torch.bfloat16)
    assert check_content(BlockKV(REF, one, one.reshape(1))) == []
