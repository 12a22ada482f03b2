"""``kv-sidecar calibrate``: measure the noise floor on a trusted engine, write a profile.

For the reference engines (the testbed: ``--model reference hybrid recurrent``) a trusted
engine is a clean one: a demo-like chat workload with no fault, every hit sampled and every
block of it verified, the tolerance held at the fixed table so nothing learnt can hide a
block. The largest error among the blocks that passed is the floor; the profile's tolerance
is ``multiple x floor`` (3 by default: the floor here is the largest error over thousands of
blocks, long contexts included, where a learnt one is the largest of the first 64 and takes
4x), clamped like a learnt one (:mod:`sidecar.checks.calibration`). One entry per write
path the engine reports (``prefill``, ``decode``) and one over all blocks (``all``); a
``prefill`` floor of exactly 0 makes the sidecar compare those blocks bit-exactly. A run that
flagged anything is refused: a profile must not be measured on an engine that is not clean.
Entries already in ``--out`` for other keys are kept (``--replace`` drops them).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sidecar.checks.calibration_profile import ProfileEntry, ProfileError, host_kernels
from sidecar.checks.calibration_write import (
    measured_entries,
    profile_to_extend,
    save_entries,
)
from sidecar.checks.tolerance import DEFAULT_CALIBRATION_SAMPLES
from sidecar.cli.arg_types import positive_int

MODELS = ("reference", "hybrid", "recurrent")
DTYPES = ("float32", "bfloat16", "float16")


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "calibrate", help="measure the recompute noise floor on a trusted engine and write "
                          "a calibration profile",
        description=__doc__.splitlines()[0] + " The sidecar loads it at start "
                    "(calibration_profile / --calibration-profile / "
                    "KVSIDECAR_CALIBRATION_PROFILE).")
    c.add_argument("--out", required=True, metavar="FILE", help="the profile to write")
    c.add_argument("--model", nargs="+", choices=MODELS, default=["reference"],
                   help="reference engine models to calibrate (default: reference)")
    c.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES),
                   help="KV dtypes to calibrate (default: all three)")
    c.add_argument("--requests", type=positive_int, default=200,
                   help="requests of the clean chat workload per model and dtype "
                        "(default: 200)")
    c.add_argument("--min-blocks", type=positive_int, default=DEFAULT_CALIBRATION_SAMPLES,
                   help="refuse to write an entry measured over fewer clean blocks "
                        f"(default: {DEFAULT_CALIBRATION_SAMPLES})")
    c.add_argument("--multiple", type=float, default=3.0,
                   help="profile tolerance = X x the floor (default: 3)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--replace", action="store_true",
                   help="write only the new entries (default: keep the file's other ones)")




def measure(model: str, dtype: str, requests: int, seed: int, multiple: float,
            min_blocks: int) -> list[ProfileEntry]:
    """One clean reference-engine run -> its profile entries: one per write path the engine
    reported (``prefill``, ``decode``) with at least ``min_blocks`` clean blocks, and the
    ``all`` entry over every block (for blocks stored without a path: a tier's loads).
    ``ValueError`` when the run was not clean or verified too few blocks."""
    from kvtestbed.demo import DemoOptions, build
    from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive

    opts = DemoOptions(fault="none", model=model, dtype=dtype, requests=requests,
                       sample_every=1, seed=seed, progress=False,
                       sidecar={"blocks_per_sample": 1 << 16, "calibration_samples": 0,
                                "calibration_profile": "", "dispatch": "inline",
                                "allocator_every_s": 0.0})
    engine, monitor = build(opts)
    monitor.start()
    try:
        drive(engine, ChatWorkload(WorkloadConfig(
            seed=seed, conversations=max(8, requests // 3 + 8),
            block_size=engine.block_size)), max_requests=requests)
        monitor.drain(timeout_s=600)
        summary = monitor.summary()
    finally:
        monitor.stop()
    flagged = sum(summary["anomalies"].values())
    if flagged:
        raise ValueError(f"{model}/{dtype}: the calibration run flagged {flagged} anomalies "
                         f"({summary['anomalies']}): not a trusted engine, no profile written")
    info = monitor.info
    try:
        return measured_entries(monitor.verifier.calibration.states(),
                                reference=monitor.verifier.reference_kind, dtype=dtype,
                                model=info.model, kv_storage=info.kv_storage,
                                engine=info.engine, multiple=multiple, min_blocks=min_blocks)
    except ValueError as exc:
        raise ValueError(f"{model}/{dtype}: {exc}; raise --requests") from None


def run_calibrate(args: argparse.Namespace) -> int:
    if not (args.multiple >= 1 and args.multiple < float("inf")):
        print("kv-sidecar: error: --multiple must be a finite number >= 1", file=sys.stderr)
        return 2
    try:
        base = profile_to_extend(args.out, args.replace, "--replace")
    except ProfileError as exc:
        print(f"kv-sidecar: error: {exc}", file=sys.stderr)
        return 2
    entries = []
    for model in args.model:
        for dtype in args.dtype:
            try:
                measured = measure(model, dtype, args.requests, args.seed, args.multiple,
                                   args.min_blocks)
            except ValueError as exc:
                print(f"kv-sidecar: error: {exc}", file=sys.stderr)
                return 1
            entries.extend(measured)
            for entry in measured:
                print(entry.describe(), flush=True)
    total = save_entries(args.out, entries, base)
    print(f"wrote {args.out} ({len(entries)} entries measured on {host_kernels()}, "
          f"{total} in the file)")
    return 0
