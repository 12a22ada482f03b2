"""The detection benchmark's report as Markdown tables (what the README pastes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _storage(row: dict[str, Any]) -> str:
    return row["kv_storage"] or row["dtype"]


def render(report: dict[str, Any]) -> str:
    parts: list[str] = []
    content = [r for r in report["faults"] if r["caught_by"] == "verification"]
    allocator = [r for r in report["faults"] if r["caught_by"] != "verification"]
    if content:
        blocks = report["settings"]["blocks_per_sample"]
        parts.append("Faults caught by verification (recall = detected / affected hits "
                     "sampled with a corrupt block among the verified ones; blocks verified per "
                     f"sampled hit: {blocks})\n")
        parts.append(_table(
            ["fault", "dtype", "KV storage", "affected hits", "sampled", "corrupt block verified",
             "detected", "recall", "samples to 1st detection", "false alarms",
             "anomaly kinds"],
            [(r["fault"], r["dtype"], _storage(r), r["affected"], r["sampled"],
              r["bad_verified"], r["detected"],
              None if r["recall"] is None else f"{r['recall']:.2f}",
              r["samples_to_first_detection"], r["false_alarms"], ", ".join(r["kinds"]))
             for r in content]))
    if allocator:
        parts.append("\nFaults caught by allocator signals (no KV is corrupted; requests "
                     "from the fault's first action to the first signal)\n")
        parts.append(_table(
            ["fault", "dtype", "first action (request)", "requests to detection",
             "signals (request they fired)", "false alarms"],
            [(r["fault"], r["dtype"], r["first_injection_request"],
              r["requests_to_allocator_detection"],
              ", ".join(f"{k} ({v})" for k, v in r["allocator_signals"].items()),
              r["false_alarms"]) for r in allocator]))
    if report["clean"]:
        s = report["settings"]
        how = (f"calibrated: {s.get('calibration_multiple')} x the floor of the first "
               f"{s.get('calibration_samples')} clean blocks") \
            if s.get("calibration_samples") else "fixed table"
        if s.get("calibration_profile"):  # learning tightens a profile, never loosens it
            how = f"from the shipped profile, {how} where lower"
        parts.append(f"\nClean runs (every block of every hit verified; tolerance {how})\n")
        parts.append(_table(
            ["dtype", "KV storage", "verified blocks", "verified hits", "false positives",
             "noise floor", "calibrated floor", "tolerance", "margin",
             "allocator false alarms"],
            [(r["dtype"], _storage(r), r["verified"], r["verified_hits"],
              r["false_positives"], r["noise_floor"], r.get("calibrated_floor"),
              r["tolerance"],
              f"{r['margin']}x" if r["margin"] else None,
              ", ".join(r["allocator_false_alarms"]) or 0) for r in report["clean"]]))
    if report["policies"]:
        s = report["settings"]
        parts.append(f"\nSampling policies at equal budget (1 hit in "
                     f"{s['policy_sample_every']}, {s['policy_blocks_per_sample']} blocks "
                     f"per sample, {s['policy_seeds']} seeds each)\n")
        parts.append(_table(
            ["fault", "policy", "verified blocks", "affected hits", "detected",
             "detected / 1000 blocks", "median blocks to 1st detection", "runs detected"],
            [(r["fault"], r["policy"], r["verified_blocks"], r["affected"], r["detected"],
              r["detections_per_1000_blocks"], r["median_blocks_to_first_detection"],
              f"{r['runs_detected']}/{r['runs']}") for r in report["policies"]]))
    parts.append("\nWrite-time fingerprint (BLAKE2b over the KV bytes)\n")
    parts.append(_table(["block", "bytes", "us / digest", "GB/s"],
                        [(d["what"], d["bytes"], d["microseconds_per_digest"], d["gb_per_s"])
                         for d in report["digest"]]))
    problems = report.get("problems") or []
    parts.append("\n" + ("Problems: " + "; ".join(problems) if problems
                         else "Every fault caught, no false alarm.")
                 + f" ({report['wall_s']} s)")
    return "\n".join(parts)
