"""``kv-sidecar bench detection``: every catalogued fault against the sidecar, per dtype.

For each fault of the reference engine's registry (``kv-sidecar faults``) and each dtype,
one run of the chat workload with the sidecar attached (:mod:`.harness`), scored against
the engine's ground truth:

* ``affected``: hits with at least one *corrupt* block: bytes that differ from what the
  clean write path stored, or a block that stands for another prefix than the hit's own
  tokens and key fields; ``sampled``: of those, the ones the policy verified;
  ``bad_verified``: of those, the ones where a corrupt block was among the verified blocks
  (every block of a sampled hit is verified by default, so the two are equal);
  ``detected``: of ``bad_verified``, the ones where a verified corrupt block was flagged.
  **recall = detected / bad_verified.** Blocks whose KV was computed over a corrupt past
  (*tainted*) are neither misses nor false alarms (``tainted_only_hits`` counts hits with
  nothing worse).
* ``samples_to_first_detection``: sampled hits verified from the first affected hit up to
  and including the first affected hit flagged (blocks: ``blocks_to_first_detection``);
  ``detected_any`` counts every sampled affected hit flagged, corrupt block checked or not.
* faults that corrupt no KV (leak, fragmentation) are caught by allocator signals instead:
  the number of requests from the fault's first action to the first signal.
* ``false_alarms``: anomalies on blocks the ground truth calls good, in any run.

Clean runs (one per dtype and storage format) verify every block of every hit until at
least ``--clean-samples`` blocks were verified and report false positives, the measured
noise floor (largest recompute error) and the tolerance used: what the sidecar ships
with for these engines, the profile ``kv-sidecar demo`` loads (``--calibration-profile``;
``""`` for none), tightened by what it learns from the first ``--calibrate`` clean blocks of
each run (the floor it learnt is reported too), or the fixed table with ``--calibrate 0``.
Then the sampling policies at equal budget (:mod:`.policies`) and the fingerprint digest's
throughput (:mod:`.digest`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvtestbed.bench import digest, policies
from kvtestbed.bench.args import add_arguments
from kvtestbed.bench.harness import Scenario, ScenarioResult, run_many
from kvtestbed.demo import SHIPPED_PROFILE
from kvtestbed.engines.faults import FAULTS
from kvtestbed.engines.hybrid_faults import fault_applies
from sidecar.checks.calibration_profile import ProfileError, load_profile


# ---------------------------------------------------------------------- rows
def fault_row(r: ScenarioResult) -> dict[str, Any]:
    sc = r.scenario
    by_allocator = not FAULTS[sc.fault].corrupts_kv
    return {
        "fault": sc.fault, "model": sc.model, "dtype": sc.dtype, "kv_storage": r.kv_storage,
        "caught_by": "allocator signals" if by_allocator else "verification",
        "requests": r.requests, "hits": r.hits, "affected": r.affected, "sampled": r.sampled,
        "bad_verified": r.bad_verified, "detected": r.detected, "detected_any": r.detected_any,
        "tainted_only_hits": r.tainted_only,
        "recall": None if by_allocator or r.recall is None else round(r.recall, 4),
        "samples_to_first_detection": r.samples_to_first_detection,
        "blocks_to_first_detection": r.blocks_to_first_detection,
        "kinds": sorted(r.kinds), "kind_counts": dict(sorted(r.kinds.items())),
        "false_alarms": r.false_alarm_blocks, "verified_hits": r.verified_hits,
        "false_alarm_kinds": dict(sorted(r.false_alarm_kinds.items())),
        "verified": r.verified_blocks, "noise_floor": r.max_clean_error,
        "tolerance": r.tolerance, "calibrated_floor": r.calibrated_floor,
        "injections": r.injections,
        "first_injection_request": r.first_injection_request,
        "allocator_signals": dict(sorted(r.allocator_alarms.items(), key=lambda kv: kv[1])),
        "requests_to_allocator_detection": r.requests_to_allocator_detection,
        "wall_s": round(r.wall_s, 2),
    }


def clean_row(r: ScenarioResult) -> dict[str, Any]:
    noise = r.max_clean_error
    return {
        "model": r.scenario.model,
        "dtype": r.scenario.dtype, "kv_storage": r.kv_storage, "requests": r.requests,
        "verified": r.verified_blocks, "verified_hits": r.verified_hits,
        "false_positives": r.false_alarm_blocks, "false_positive_hits": r.false_alarm_hits,
        "false_positive_kinds": dict(sorted(r.false_alarm_kinds.items())),
        "affected": r.affected, "noise_floor": noise, "tolerance": r.tolerance,
        "calibrated_floor": r.calibrated_floor,
        "margin": round(r.tolerance / noise, 1) if noise > 0 else None,
        "allocator_false_alarms": sorted(r.allocator_alarms), "wall_s": round(r.wall_s, 2),
    }


def failures(report: dict[str, Any], clean_samples: int) -> list[str]:
    """What ``--check`` refuses: a miss, a false alarm, a short or noisy clean run."""
    out: list[str] = []
    for row in report["faults"]:
        name = f"{row['fault']}/{row['dtype']}"
        if row.get("model", "reference") != "reference":
            name = f"{row['model']}/{name}"
        if row["caught_by"] == "verification":
            if not row["bad_verified"]:
                out.append(f"{name}: no affected hit was verified")
            elif row["recall"] != 1.0:
                out.append(f"{name}: recall {row['recall']}")
        elif row["requests_to_allocator_detection"] is None:
            out.append(f"{name}: no allocator signal fired")
        if row["false_alarms"]:
            out.append(f"{name}: {row['false_alarms']} false alarms")
    for row in report["clean"]:
        name = f"clean {row['dtype']}/{row['kv_storage'] or 'model'}"
        if row.get("model", "reference") != "reference":
            name = f"clean {row['model']}/{row['dtype']}"
        if row["false_positives"] or row["allocator_false_alarms"] or row["affected"]:
            out.append(f"{name}: false positives")
        if row["verified"] < clean_samples:
            out.append(f"{name}: only {row['verified']} verified blocks")
    return out


# ---------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    faults = args.faults or [n for n in FAULTS if n != "none"]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(f"kv-sidecar: error: unknown fault(s) {', '.join(unknown)}; known: "
              f"{', '.join(FAULTS)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    if args.calibrate < 0 or not args.calibration_multiple >= 1:
        print("kv-sidecar: error: --calibrate must be >= 0 and --calibration-multiple >= 1",
              file=sys.stderr)
        return 2
    profile = str(SHIPPED_PROFILE) if args.calibration_profile is None \
        else args.calibration_profile or None
    if profile is not None:
        try:  # one line for a bad file, before any run starts
            load_profile(profile)
        except ProfileError as exc:
            print(f"kv-sidecar: error: --calibration-profile: {exc}", file=sys.stderr)
            return 2
    cal = {"calibration_samples": args.calibrate,
           "calibration_multiple": args.calibration_multiple,
           "calibration_profile": profile}
    fault_runs = [Scenario(fault=f, dtype=d, requests=args.requests,
                           sample_every=args.sample_every,
                           blocks_per_sample=args.blocks_per_sample, seed=args.seed,
                           model=m, **cal)
                  for m in args.model for f in faults if fault_applies(f, m)
                  for d in args.dtype]
    storages = [None if s == "model" else s for s in args.clean_storage]
    # Quantised storage is the plain engine's (the hybrid pools keep the model dtype).
    clean_runs = [Scenario(dtype=d, kv_storage=s, sample_every=1, requests=200,
                           seed=args.seed, min_verified_blocks=args.clean_samples, model=m,
                           **cal)
                  for m in args.model for d in args.dtype for s in storages
                  if m == "reference" or s is None] if args.clean_samples > 0 else []
    policy_runs = policies.scenarios(args.policy_seeds, 8, 2, 200) \
        if args.policy_seeds > 0 else []
    everything = [*clean_runs, *fault_runs, *policy_runs]

    def progress(done: int, total: int, r: ScenarioResult) -> None:
        if not args.quiet:
            print(f"[{done:>3}/{total}] {r.scenario.label():<52} {r.wall_s:6.1f}s",
                  file=sys.stderr, flush=True)

    results = run_many(everything, args.jobs, quiet=not args.verbose, progress=progress)
    n_clean, n_fault = len(clean_runs), len(fault_runs)
    report: dict[str, Any] = {
        "faults": [fault_row(r) for r in results[n_clean:n_clean + n_fault]],
        "clean": [clean_row(r) for r in results[:n_clean]],
        "policies": [row.as_dict() for row in
                     policies.summarise(results[n_clean + n_fault:])],
        "digest": [d.as_dict() for d in digest.measure()],
        "settings": {"requests": args.requests, "sample_every": args.sample_every,
                     "blocks_per_sample": args.blocks_per_sample or "all",
                     "clean_samples": args.clean_samples, "policy_seeds": args.policy_seeds,
                     "policy_sample_every": 8, "policy_blocks_per_sample": 2,
                     "seed": args.seed, "jobs": args.jobs, "models": args.model,
                     "calibration_samples": args.calibrate,
                     "calibration_multiple": args.calibration_multiple,
                     "calibration_profile": profile},
    }
    report["wall_s"] = round(time.perf_counter() - started, 1)
    problems = failures(report, args.clean_samples)
    report["problems"] = problems
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        from kvtestbed.bench.tables import render

        print(render(report))
    return 1 if args.check and problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kv-sidecar bench detection")
    add_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
