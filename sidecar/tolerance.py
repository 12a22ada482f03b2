"""Recompute tolerances per KV dtype: one table, calibrated from measured noise.

The error metric is :func:`sidecar.checks.recompute.normalized_error`: the largest absolute
difference between cached and recomputed KV, divided by the RMS of the recomputed block. It
is scale-free, so one number per dtype serves every model.

Measured noise floors (two correct computations of the same tokens; see README "Tolerances"
and ``kv-sidecar bench detection``) and the margin we keep:

==========  ============================  ==========  ============================
dtype       noise floor (normalized err)  tolerance   corruption seen (one token
                                                      changed / other sequence)
==========  ============================  ==========  ============================
float32     ~1e-6 (HF vs HF), ~1e-5 vLLM  1e-3        >= 0.5
float16     ~5e-3                         5e-2        >= 0.5
bfloat16    ~3e-2                         2.5e-1      >= 0.5
int8 / fp8  format rounding ~2e-2         2.5e-1      >= 0.5 (a wrong scale: >= 1)
==========  ============================  ==========  ============================

A tolerance sits about 10x above the noise floor and at least 2x below the smallest
corruption we inject, so neither false positives nor misses ride on luck.
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
