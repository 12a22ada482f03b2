"""The probe's block decoder against the kernel that writes vLLM's CPU KV cache.

vLLM picks the CPU attention kernel per dtype *and CPU*: bf16 on a CPU with AMX tiles gets
the ``amx`` kernel, which VNNI-packs K and V; everything else here the ``vec`` one. Decoding
an AMX block with the ``vec`` order scrambled every value (HF-vs-vLLM normalized error ~5 in
bf16 on AMX hosts only), so each order is checked against vLLM's own
``cpu_attn_reshape_and_cache`` for every ISA this CPU can run. No engine: ~1 s.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.adapters.vllm.layout import cpu_attn_isa, decode_cpu_block, encode_cpu_block

pytestmark = pytest.mark.vllm
AMX = torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize(("isa", "dtype", "shape"), [
    ("vec", torch.float32, (2, 32, 32)),
    ("vec", torch.bfloat16, (2, 64, 128)),
    ("vec16", torch.float32, (2, 16, 80)),
    pytest.param("amx", torch.bfloat16, (2, 32, 32), marks=pytest.mark.skipif(
        not AMX, reason="this CPU has no AMX tiles: vLLM never runs its amx kernel here")),
    pytest.param("amx", torch.bfloat16, (4, 128, 96), marks=pytest.mark.skipif(
        not AMX, reason="this CPU has no AMX tiles: vLLM never runs its amx kernel here")),
])
def test_decode_reads_what_vllms_kernel_writes(isa: str, dtype: torch.dtype,
                                               shape: tuple[int, int, int]) -> None:
    from vllm import _custom_ops as ops

    h, bs, d = shape
    cache = torch.zeros(3, h, bs, 2 * d, dtype=dtype)
    key_cache, value_cache = cache.view(3, h, 2 * bs, d).chunk(2, dim=2)
    g = torch.Generator().manual_seed(bs + d)
    k = torch.randn(bs, h, d, generator=g).to(dtype)  # (tokens, heads, dim), as vLLM passes
    v = torch.randn(bs, h, d, generator=g).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(bs, 2 * bs), isa)
    assert cache[0].abs().sum() == 0 and cache[2].abs().sum() == 0  # block 1 only
    dk, dv = decode_cpu_block([cache, cache], 1, bs, isa=isa)
    assert torch.equal(dk[1], k.transpose(0, 1)) and torch.equal(dv[0], v.transpose(0, 1))
    assert torch.equal(encode_cpu_block(dk[0], dv[0], isa), cache[1])


def test_default_isa_is_the_one_vllm_picks_on_this_cpu() -> None:
    """The probe decodes with ``cpu_attn_isa`` of the caches' dtype: bf16 on AMX is amx."""
    assert cpu_attn_isa(torch.float32, 32, 32) == "vec"
    assert cpu_attn_isa(torch.bfloat16, 32, 32) == ("amx" if AMX else "vec")
    assert cpu_attn_isa(torch.float32, 16, 80) == "vec16"
