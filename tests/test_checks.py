"""Each check on its own: what it flags, and the noise it must not flag."""

from __future__ import annotations

import pytest
import torch

from sidecar.checks.content import check_content
from sidecar.checks.fingerprint import PoolDigests, check_fingerprint, kv_digest
from sidecar.checks.keys import StoreRecord, check_keys, hit_digests, token_digest
from sidecar.checks.recompute import block_error, normalized_error
from sidecar.checks.structure import check_structure
from sidecar.checks.tolerance import tolerance_for
from sidecar.core.protocol import BlockKV, BlockRef, CacheGroup, EngineInfo, GroupKind, Hit
from sidecar.signals import AnomalyKind

REF = BlockRef(group_id=0, index=1, block_id=7)
INFO = EngineInfo("t", "m", "r1", "float32", 4, 2, 8,
                  (CacheGroup(0, GroupKind.FULL_ATTENTION, (0, 1)),))


def block(dtype=torch.float32, seed=0) -> BlockKV:
    g = torch.Generator().manual_seed(seed)
    return BlockKV(REF, torch.randn(2, 2, 4, 8, generator=g).to(dtype),
                   torch.randn(2, 2, 4, 8, generator=g).to(dtype))


def kinds(findings):
    return {f.kind for f in findings}


def test_content_accepts_real_kv_and_flags_zeros_nan_and_constant():
    assert check_content(block()) == []
    b = block()
    b.value.zero_()
    assert kinds(check_content(b)) == {AnomalyKind.ZEROS}
    b = block()
    b.key[0, 0, 2, 3] = float("nan")
    assert kinds(check_content(b)) == {AnomalyKind.NONFINITE}
    b = block()
    b.key[:] = 0.5
    assert kinds(check_content(b)) == {AnomalyKind.DEGENERATE}


def test_rows_alike_in_a_block_of_one_repeated_token_are_no_finding():
    """A one-layer model's V depends on the token alone: a block of one token repeated has
    identical V rows, clean (an outside check's clean run flagged it). Other tokens, or
    no tokens given, still flag a row broadcast over the block."""
    b = block()  # REF is block index 1: tokens[4:8] with a block size of 4
    b.value[:] = b.value[..., :1, :].clone()
    assert check_content(b, [1, 2, 3, 4, 7, 7, 7, 7], 4) == []
    assert kinds(check_content(b, [1, 2, 3, 4, 7, 7, 8, 7], 4)) == {AnomalyKind.DEGENERATE}
    assert kinds(check_content(b)) == {AnomalyKind.DEGENERATE}


def test_structure_flags_shape_dtype_and_transposed_views():
    assert check_structure(block(), INFO, 2) == []
    bad_shape = BlockKV(REF, torch.randn(2, 4, 2, 8), torch.randn(2, 2, 4, 8))
    assert kinds(check_structure(bad_shape, INFO, 2)) == {AnomalyKind.STRUCTURE}
    assert kinds(check_structure(block(torch.bfloat16), INFO, 2)) == {AnomalyKind.STRUCTURE}
    t = torch.randn(2, 2, 8, 4).transpose(-1, -2)  # right shape, wrong layout
    assert kinds(check_structure(BlockKV(REF, t, t), INFO, 2)) == {AnomalyKind.STRUCTURE}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fingerprint_catches_a_single_low_mantissa_bit(dtype):
    b = block(dtype)
    digest = kv_digest(b.key, b.value)
    assert check_fingerprint(b, digest) == []
    raw = b.value.view(torch.int16 if dtype != torch.float32 else torch.int32)
    raw[1, 1, 3, 5] ^= 1  # lowest mantissa bit of one element
    found = check_fingerprint(b, digest)
    assert kinds(found) == {AnomalyKind.FINGERPRINT_MISMATCH}
    # ...which a tolerance-based compare cannot see:
    assert normalized_error(b.value, block(dtype).value) < tolerance_for(str(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_digests_equal_kv_digest_of_each_block_and_see_one_bit(dtype):
    g = torch.Generator().manual_seed(3)
    key = torch.randn(3, 5, 2, 4, 8, generator=g).to(dtype)  # (layers, blocks, ...)
    value = torch.randn(3, 5, 2, 4, 8, generator=g).to(dtype)
    digests = PoolDigests(key, value)
    for b in range(5):
        assert digests(b) == kv_digest(key[:, b].clone(), value[:, b].clone())
    before = digests(2)
    key.view(torch.int16 if dtype != torch.float32 else torch.int32)[2, 2, 1, 3, 7] ^= 1
    assert digests(2) != before  # read in place: the pool's bytes now
    assert digests(1) == kv_digest(key[:, 1].clone(), value[:, 1].clone())
    with pytest.raises(ValueError, match="contiguous host"):
        PoolDigests(key.transpose(0, 1), value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_recompute_tolerance_passes_rounding_noise_and_flags_corruption(dtype):
    torch_dtype = getattr(torch, dtype)
    exact = block(torch.float32)
    cached = BlockKV(REF, exact.key.to(torch_dtype), exact.value.to(torch_dtype))
    tol = tolerance_for(dtype)
    # The verifier's own comparison (sidecar/checks/verifier.py): block_error <= tolerance.
    assert block_error(cached, exact) <= tol  # storage rounding only
    other = block(torch.float32, seed=1)  # KV of another sequence
    assert block_error(BlockKV(REF, other.key.to(torch_dtype),
                               other.value.to(torch_dtype)), exact) > tol


def test_unknown_dtype_tolerance_is_a_clear_error():
    with pytest.raises(ValueError, match="no recompute tolerance"):
        tolerance_for("float8_e9")


def test_keys_flag_generation_tokens_and_fields():
    tokens = list(range(12))
    hit = Hit(tokens, 8, {0: [3, 7]}, {0: [1, 5]}, {"adapter": "a"})
    digests = hit_digests(hit, 4, 1)
    good = StoreRecord(5, digests[1], True, 4, {"adapter": "a"})
    assert check_keys(hit, REF, good, 4, 5, digests) == []
    assert kinds(check_keys(hit, REF, good, 4, 6, digests)) == {AnomalyKind.STALE_GENERATION}
    other = token_digest(digests[0], [99, 98, 97, 96])
    collided = StoreRecord(5, other, True, 4, {"adapter": "a"})
    assert kinds(check_keys(hit, REF, collided, 4, 5, digests)) == {AnomalyKind.TOKEN_MISMATCH}
    wrong_field = StoreRecord(5, digests[1], True, 4, {"adapter": "b"})
    assert kinds(check_keys(hit, REF, wrong_field, 4, 5, digests)) == {
        AnomalyKind.KEY_FIELDS_MISMATCH}
    assert check_keys(hit, REF, None, 4, 5, digests) == []
