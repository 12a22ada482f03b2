"""The vLLM probe's write-time fingerprint in ``kv-sidecar bench perf`` (``--figures
fingerprint``): what ``fingerprint_every=1`` adds per block the engine writes, on CPU.

Per block shape, in vLLM's CPU layout (one ``(blocks, kv_heads, block_size, 2 * head_dim)``
tensor per layer, block size 32): the probe's digest (:func:`sidecar.adapters.vllm.
block_writes.raw_digest`: each layer's slice stacked, then xxh3) next to a raw one-pass read
of the same bytes (the floor) and next to digesting the decoded block (what the probe would
pay if it fingerprinted what it ships). Times are medians per block; the ratio is the
probe's time over the baseline's.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from kvtestbed.bench.perf_data import _best_s, raw_read
from kvtestbed.bench.perf_row import Row

# name -> (layers, kv heads, head dim): vLLM CPU blocks of 32 tokens, bfloat16.
SHAPES: dict[str, tuple[int, int, int]] = {
    "8B-class bf16 block (32 layers x 8 heads x 32 tokens x 128)": (32, 8, 128),
    "1B-class bf16 block (16 layers x 8 heads x 32 tokens x 64)": (16, 8, 64),
}
BLOCK = 32


def _timings(pool: list[torch.Tensor], read: Any, base_name: str, repeats: int,
             min_time: float) -> dict[str, list[float]]:
    from sidecar.adapters.vllm.block_writes import raw_digest
    from sidecar.adapters.vllm.layout import decode_cpu_block
    from sidecar.checks.fingerprint import kv_digest

    k, v = decode_cpu_block(pool, 1, BLOCK, "vec")
    return {"probe digest": _best_s(lambda: raw_digest(pool, 1), repeats, min_time),
            base_name: _best_s(lambda: read(k, v), repeats, min_time),
            "decoded digest": _best_s(
                lambda: kv_digest(*decode_cpu_block(pool, 1, BLOCK, "vec")), repeats,
                min_time)}


def fingerprint_rows(quick: bool, repeats: int, raw: dict[str, Any]) -> list[Row]:
    min_time = 0.02 if quick else 0.2
    rows, out = [], []
    base_name, read = raw_read()
    for name, (layers, heads, dim) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        pool = [torch.randn(4, heads, BLOCK, 2 * dim, generator=g).to(torch.bfloat16)
                for _ in range(layers)]
        t = _timings(pool, read, base_name, repeats, min_time)
        us = {key: statistics.median(s) * 1e6 for key, s in t.items()}
        out.append({"block": name, "us_per_block": us})
        for base in (base_name, "decoded digest"):
            rows.append(Row(f"vLLM probe write-time fingerprint, {name}: us/block vs {base}",
                            us["probe digest"], us[base], "us", us["probe digest"] / us[base],
                            "-", None))
    raw["fingerprint"] = out
    return rows
