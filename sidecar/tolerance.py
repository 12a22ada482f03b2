"""Recompute tolerances per KV dtype: one table, calibrated from measured noise.

The error metric is :func:`sidecar.checks.recompute.normalized_error`: the largest absolute
difference between cached and recomputed KV, divided by the RMS of the recomputed block. It
is scale-free, so one number per dtype serves every model.

Measured noise floors (two correct computations of the same tokens) and the margin we keep.
The reference-engine column is ``kv-sidecar bench detection``'s clean runs: every block of
every hit verified, 5,238 blocks per row, largest error seen; the vLLM column is
``examples/vllm`` (vLLM's cached KV vs an HF recompute):

==============  ===============  ===========  ==========  =======  ============================
dtype           KV storage       noise floor  vLLM        tol.     smallest corruption seen
==============  ===============  ===========  ==========  =======  ============================
float32         float32          1.65e-6      1.5e-6      1e-3     ~5e-2 (KV computed over a
                                                                   zeroed block); 0.2-6 directly
float16         float16          3.2e-3       -           5e-2     same
bfloat16        bfloat16         2.6e-2       3.5e-2      2.5e-1   same
float32         int8 (per row)   1.7e-2       -           2.5e-1   stale scale (x0.25): 2.3-2.9
float16         int8 (per row)   1.8e-2       -           2.5e-1   same
bfloat16        int8 (per row)   4.0e-2       -           2.5e-1   same
==============  ===============  ===========  ==========  =======  ============================

int8 is the reference pool's symmetric per-row format (one scale per layer, block, head and
token: ``sidecar/engines/reference/quant.py``); its rounding is at most ``amax / 254`` of a
row. fp8 shares int8's tolerance but has no storage mode here to measure it on.

A tolerance sits 6-15x above the noise floor it covers (600x in float32: headroom for
kernels noisier than these two) and below the smallest corruption we inject,
so neither false positives nor misses ride on luck. What a tolerance cannot see (a flipped
low mantissa bit) the write-time fingerprint sees exactly.
"""

from __future__ import annotations

TOLERANCES: dict[str, float] = {
    "float32": 1e-3,
    "float16": 5e-2,
    "bfloat16": 2.5e-1,
}

# Lossy KV storage formats widen the tolerance to at least this much.
STORAGE_TOLERANCES: dict[str, float] = {
    "int8": 2.5e-1,
    "fp8": 2.5e-1,
}


def tolerance_for(dtype: str, kv_storage: str | None = None) -> float:
    """The recompute tolerance for KV read back as ``dtype`` (and stored as ``kv_storage``)."""
    name = dtype.removeprefix("torch.")
    if name not in TOLERANCES:
        raise ValueError(f"no recompute tolerance for dtype {dtype!r}; "
                         f"known: {', '.join(sorted(TOLERANCES))}")
    tol = TOLERANCES[name]
    if kv_storage is not None:
        if kv_storage not in STORAGE_TOLERANCES:
            raise ValueError(f"no tolerance for KV storage {kv_storage!r}; "
                             f"known: {', '.join(sorted(STORAGE_TOLERANCES))}")
        tol = max(tol, STORAGE_TOLERANCES[kv_storage])
    return tol
