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
token: ``testbed/kvtestbed/engines/quant.py``); its rounding is at most ``amax / 254`` of a
row. fp8 shares int8's tolerance but has no storage mode here to measure it on.

A tolerance sits 6-15x above the noise floor it covers (600x in float32: headroom for
kernels noisier than these two) and below the smallest corruption we inject,
so neither false positives nor misses ride on luck. What a tolerance cannot see (a flipped
low mantissa bit) the write-time fingerprint sees exactly.

These are *hard* tolerances: the ceiling a comparison never exceeds. A deployment may
replace one (``SidecarConfig.tolerances``, ``--tolerance [REFERENCE:]DTYPE=VALUE``), and the
calibration mode (:mod:`sidecar.checks.calibration`) tightens it under the ceiling to a stated
multiple of the noise floor it measures, never below :func:`min_tolerance` (a few ulps of the
dtype, so a reference whose floor is exactly 0 still tolerates one rounding step).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from sidecar.core.capabilities import REFERENCE_KINDS  # declared with the capability

TOLERANCES: dict[str, float] = {
    "float32": 1e-3,
    "float16": 5e-2,
    "bfloat16": 2.5e-1,
}

# The loosest tolerance a deployment may set: KV elements are O(1) after normalisation, so
# an error bound above 1 passes zeroed or garbage blocks (1e30 blinded the demo's checks).
MAX_OVERRIDE = 1.0

# Lossy KV storage formats widen the tolerance to at least this much.
STORAGE_TOLERANCES: dict[str, float] = {
    "int8": 2.5e-1,
    "fp8": 2.5e-1,
}


# Machine epsilon (the gap between 1.0 and the next value) per KV dtype, without torch.
EPSILON: dict[str, float] = {
    "float32": 2.0 ** -23,
    "float16": 2.0 ** -10,
    "bfloat16": 2.0 ** -7,
}
MIN_ULPS = 8.0  # the smallest tolerance a calibration may set, in epsilons of the dtype
# A dtype whose measured noise floor (the table above) is over a few epsilons gets a
# minimum of that floor with a margin: float32's floor is ~1.65e-6 (14 epsilons) on the
# reference engine and ~1.5e-6 on vLLM, so 8 epsilons (9.5e-7) sat *under* honest noise and a
# 64-block calibration (floor 6.05e-7, tolerance 2.42e-6) kept only 1.6x over the largest
# clean error of 5,238 blocks. 1e-5 is 6x that floor and 5,000x under the smallest
# corruption seen (5e-2).
MEASURED_MINIMUMS: dict[str, float] = {"float32": 1e-5}


def min_tolerance(dtype: str) -> float:
    """The floor under any calibrated tolerance: ``MIN_ULPS`` epsilons of ``dtype``, or the
    dtype's :data:`MEASURED_MINIMUMS` entry where that is larger.

    The error is relative to the block's RMS, and one rounding step on the largest
    element of a block is about ``eps * amax / rms``, with ``amax / rms`` commonly 3-6 for
    K/V. Measured on the hybrid reference engine in bfloat16: the first 500+ blocks (short
    contexts) match the recompute bit for bit, so the learnt floor is 0, and from a few
    hundred tokens of context on the cached path's different accumulation order costs an
    honest 0.02-0.03 (3-4 epsilons). Eight epsilons (0.0625 in bfloat16) survive that
    lone re-rounding with a 2x margin, and stay far under what a real corruption costs
    (an fp8 round trip of bfloat16 KV: ~0.2; a zeroed or stale block: >= 1)."""
    name = dtype.removeprefix("torch.")
    if name not in EPSILON:
        raise ValueError(f"no epsilon for dtype {dtype!r}; known: {', '.join(sorted(EPSILON))}")
    return max(MIN_ULPS * EPSILON[name], MEASURED_MINIMUMS.get(name, 0.0))


def parse_override(text: str) -> tuple[str, float]:
    """``[REFERENCE:]DTYPE=VALUE`` (a CLI flag) -> (key, value), with a clear error.

    The key is ``DTYPE`` or ``REFERENCE:DTYPE``; REFERENCE is a reference kind
    (:data:`REFERENCE_KINDS`)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"expected [REFERENCE:]DTYPE=VALUE, got {text!r}")
    try:
        tol = float(value)
    except ValueError:
        raise ValueError(f"tolerance {value!r} in {text!r} is not a number") from None
    check_override(key, tol)
    return key, tol


DEFAULT_CALIBRATION_SAMPLES = 64  # clean blocks learnt from by default (--calibrate)


def check_override(key: str, value: float) -> None:
    """Refuse an override that names an unknown reference or dtype, or is not > 0."""
    reference, _, dtype = key.rpartition(":")
    if reference and reference not in REFERENCE_KINDS:
        raise ValueError(f"unknown reference kind {reference!r} in {key!r}; known: "
                         f"{', '.join(REFERENCE_KINDS)}")
    if dtype.removeprefix("torch.") not in TOLERANCES:
        raise ValueError(f"no recompute tolerance for dtype {dtype!r} in {key!r}; "
                         f"known: {', '.join(sorted(TOLERANCES))}")
    if not (value > 0 and value <= MAX_OVERRIDE):
        raise ValueError(f"tolerance for {key!r} must be a number > 0 and <= {MAX_OVERRIDE:g}, "
                         f"got {value} (a looser tolerance passes KV that differs by more "
                         f"than a KV element's typical size: the check would be blind)")


def override_problems(overrides: Mapping[str, float]) -> list[str]:
    """Every entry of a tolerances table that :func:`check_override` refuses, each named
    (a file with three bad entries hears of all three, not one per run)."""
    problems = []
    for key, value in overrides.items():
        try:
            check_override(key, value)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def override_for(overrides: dict[str, float], reference: str, dtype: str) -> float | None:
    """The deployment's tolerance for ``reference`` and ``dtype``: ``REFERENCE:DTYPE``
    first, then ``DTYPE``; ``None`` when neither is set."""
    name = dtype.removeprefix("torch.")
    for key in (f"{reference}:{name}", name):
        if key in overrides:
            return overrides[key]
    return None


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tolerance flags of ``kv-sidecar demo`` and ``kv-sidecar vllm serve``."""
    p.add_argument("--tolerance", action="append", default=[], type=_override_arg,
                   metavar="[REFERENCE:]DTYPE=VALUE",
                   help="replace the recompute tolerance for a dtype (and reference kind: "
                        f"{', '.join(REFERENCE_KINDS)}); repeatable; not calibrated")
    p.add_argument("--calibrate", type=_calibration_samples,
                   default=DEFAULT_CALIBRATION_SAMPLES, metavar="N",
                   help="learn the noise floor from the first N clean blocks per reference "
                        "and dtype, then use --calibration-multiple x floor, never above the "
                        f"fixed table (default: {DEFAULT_CALIBRATION_SAMPLES}; 0: the fixed "
                        "table, or the profile's tolerance as it is)")
    p.add_argument("--calibration-multiple", type=_multiple, default=4.0, metavar="X",
                   help="calibrated tolerance = X x noise floor (default: 4)")
    p.add_argument("--calibration-profile", default=None, metavar="FILE",
                   help="noise floors measured on a trusted engine (`kv-sidecar calibrate`): "
                        "the starting tolerance, which learning may tighten but never loosen "
                        "(default: none, with a warning; the demo uses the reference "
                        "engine's shipped profile, '' for none)")


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``SidecarConfig`` fields the flags of :func:`add_arguments` set."""
    return {"tolerances": dict(args.tolerance), "calibration_samples": args.calibrate,
            "calibration_multiple": args.calibration_multiple,
            "calibration_profile": args.calibration_profile}


def _override_arg(text: str) -> tuple[str, float]:
    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _calibration_samples(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _multiple(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (1.0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {value}")
    return value
