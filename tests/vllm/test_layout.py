"""The probe's block decoder against the kernel that writes vLLM's CPU KV cache.

vLLM picks the CPU attention kernel per dtype *and CPU*: bf16 on a CPU with AMX tiles gets
the ``amx`` kernel, which VNNI-packs K and V; everything else here the ``vec`` one. Decoding
an AMX block with the ``vec`` order scrambled every value (HF-vs-vLLM normalized error ~5 in
bf16 on AMX hosts only), so each order is checked against vLLM's own
``cpu_attn_reshape_and_cache`` for every ISA this CPU can run. No engine: ~1 s.

The GPU backends' layouts (FlashAttention, FlashInfer; every stride layout, TP=2) are
checked against vLLM's own layout code and backend classes, which import without a GPU,
for the installed vLLM and the next release (~15 s, most of it the second vLLM's import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sidecar.adapters.vllm.layout import (
    STRIDE_LAYOUTS,
    UnsupportedLayout,
    cpu_attn_isa,
    decode_cpu_block,
    encode_cpu_block,
    validate_layout,
)
from sidecar.adapters.vllm.version import (
    SUPPORTED_VLLM,
    UnsupportedVllmVersion,
    check_vllm_version,
)

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
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


# ------------------------------------------------------------------ GPU backends (on CPU)
# FlashAttention/FlashInfer layouts, built with vLLM's own classes (tests/vllm/layout_cases):
# the installed vLLM in this process, the next release's sources in a subprocess. Both extras
# are set up by scripts/test-vllm.sh (flashinfer-python without its CUDA deps, vLLM 0.33's
# Python files from its wheel); without them these tests fail and say so, never skip.
VENV = Path(sys.prefix)
FLASHINFER_SITE = VENV / "flashinfer-site"
NEXT_VLLM_SRC = VENV / "vllm-0.33.0-src"


@pytest.fixture(scope="module", autouse=True)
def next_vllm_report() -> Iterator[subprocess.Popen[str]]:
    """The next release's cases, started with the module's first test so its vLLM import
    (most of its ~15 s) overlaps this process's own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(_need(NEXT_VLLM_SRC)), str(_need(FLASHINFER_SITE)), str(REPO)])}
    proc = subprocess.Popen([sys.executable, "-m", "tests.vllm.layout_cases"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _need(path: Path) -> Path:
    assert path.is_dir(), f"{path} is missing: run scripts/test-vllm.sh (it builds it)"
    return path


@pytest.fixture(scope="module")
def flashinfer_importable() -> Iterator[None]:
    """flashinfer on sys.path for vLLM's FlashInfer backend class only: removed again after
    (vLLM's own has_flashinfer() must not see it in the engine tests)."""
    site = str(_need(FLASHINFER_SITE))
    sys.path.insert(0, site)
    try:
        yield
    finally:
        sys.path.remove(site)
        for name in [m for m in sys.modules
                     if m.split(".")[0] in {"flashinfer", "tvm_ffi"}
                     or m == "vllm.v1.attention.backends.flashinfer"]:
            del sys.modules[name]
        from vllm.utils.flashinfer import has_flashinfer

        has_flashinfer.cache_clear()  # answered while flashinfer was importable


def _assert_covered(report: dict) -> None:
    cases = report["cases"]
    failed = [c for c in cases if not (c["placed_as_vllm_says"] and c["round_trip"]
                                       and c["wrong_layout_refused"])]
    assert not failed, failed
    assert {c["backend"] for c in cases} == {"FLASH_ATTN", "FLASHINFER"}
    assert {(c["tp"], c["kv_heads"]) for c in cases} == {(1, 4), (2, 4), (2, 1)}
    # vLLM's default preference, NHD first, when the backend declares none (FA, FlashInfer
    # off Blackwell)
    fa = [c["layout"] for c in cases if c["backend"] == "FLASH_ATTN" and c["tp"] == 1
          and c["dtype"] == "bfloat16"]
    assert fa[0] == "LBNHC" and set(fa) == set(STRIDE_LAYOUTS), fa


def test_gpu_layouts_round_trip_through_the_installed_vllm(flashinfer_importable) -> None:
    from tests.vllm.layout_cases import report

    r = report()
    assert r["vllm"] in SUPPORTED_VLLM
    _assert_covered(r)


def test_gpu_layouts_round_trip_through_the_next_vllm_release(
        next_vllm_report: subprocess.Popen[str]) -> None:
    """vLLM 0.33.0 is only published as a CUDA wheel: its Python sources (the layout code and
    backend classes import without a GPU) first on PYTHONPATH, the same cases."""
    out, err = next_vllm_report.communicate(timeout=300)
    assert next_vllm_report.returncode == 0, err[-3000:]
    r = json.loads(out)
    assert r["vllm"] == "0.33.0" and r["vllm"] in SUPPORTED_VLLM
    _assert_covered(r)


def test_blackwell_flashinfer_layouts_are_the_ones_vllm_declares(
        flashinfer_importable, monkeypatch: pytest.MonkeyPatch) -> None:
    """On SM 10.x FlashInfer declares head-major layouts only: the decoder is driven by
    what vLLM reports, so those round-trip and the others are never assumed."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    from tests.vllm.layout_cases import run_case

    monkeypatch.setattr(current_platform, "get_device_capability",
                        lambda *a, **k: DeviceCapability(10, 0))
    layouts = get_supported_kv_cache_layouts([FlashInferBackend])
    assert [m.name for m in layouts] == ["LBHNC", "BLHNC"]
    for layout in layouts:
        c = run_case(FlashInferBackend, layout, torch.bfloat16, 2, 4)
        assert c["placed_as_vllm_says"] and c["round_trip"] and c["wrong_layout_refused"], c


def test_unknown_backends_quantised_caches_and_wrong_shapes_refuse_to_start() -> None:
    view = torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)  # LBHNC view, D = 64
    caches = {"layers.0.attn": view}
    validate_layout(caches, 32, "FLASH_ATTN", "HND")  # the legacy name of LBHNC
    with pytest.raises(UnsupportedLayout, match="TRITON_ATTN"):
        validate_layout(caches, 32, "TRITON_ATTN", "LBHNC")
    with pytest.raises(UnsupportedLayout, match="layout 'XYZ'"):
        validate_layout(caches, 32, "FLASHINFER", "XYZ")
    with pytest.raises(UnsupportedLayout, match="quantised"):
        validate_layout({"l": view.view(torch.uint8)[..., :128]}, 32, "FLASHINFER", "LBHNC")
    with pytest.raises(UnsupportedLayout, match="kernel-split"):
        validate_layout(caches, 16, "FLASH_ATTN", "LBHNC")
    with pytest.raises(UnsupportedLayout, match="strides"):
        validate_layout(caches, 32, "FLASH_ATTN", "LBNHC")


def test_version_range_is_what_the_layout_tests_cover() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.0+cu130")
    for bad in ("0.31.0", "0.34.0", "1.0.0"):
        with pytest.raises(UnsupportedVllmVersion, match=bad):
            check_vllm_version(bad)
