"""``kv-sidecar bench NAME``: runs the named benchmark (each imported only when chosen)."""

from __future__ import annotations

import argparse
import sys


def run_bench(args: argparse.Namespace) -> int:
    """Entry point from :mod:`sidecar.cli.main`; returns the exit code."""
    if getattr(args, "bench", None) == "detection":
        from kvtestbed.bench.detection import run

        return run(args)
    if getattr(args, "bench", None) == "perf":
        from kvtestbed.bench.perf import run as run_perf

        return run_perf(args)
    if getattr(args, "bench", None) == "reliability":
        from kvtestbed.bench.reliability import run as run_reliability

        return run_reliability(args)
    print("usage: kv-sidecar bench detection|perf|reliability [--json] ...", file=sys.stderr)
    return 2
