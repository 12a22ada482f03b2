"""Benchmarks (``kv-sidecar bench ...``): commands that print a table and, with ``--json``,
one JSON object. ``detection``: every catalogued fault against the sidecar, per dtype;
``perf``: what the sidecar costs the engine, against baselines measured in the same run."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its benchmarks on the CLI's subparsers."""
    from kvtestbed.bench.args import add_arguments

    b = sub.add_parser("bench", help="benchmarks (detection, perf, reliability)",
                       description="Benchmarks that print a table (or JSON with --json).")
    bench_sub = b.add_subparsers(dest="bench", metavar="BENCHMARK")
    d = bench_sub.add_parser(
        "detection", help="every catalogued fault vs the sidecar, per dtype",
        description="Run the reference engine with each catalogued fault (and clean) per "
                    "dtype, verify sampled hits with kv-sidecar, and score every verdict "
                    "against the engine's ground truth: recall, false positives, samples "
                    "until first detection, noise floor vs tolerance, sampling policies at "
                    "equal budget, and the fingerprint digest's throughput.")
    add_arguments(d)
    from kvtestbed.bench.perf import add_arguments as add_perf_arguments

    pf = bench_sub.add_parser(
        "perf", help="what the sidecar costs the engine, as ratios against baselines",
        description="Hot-path ns per hook vs a no-op call (and callgrind instruction "
                    "counts), engine throughput attached vs detached, check throughput vs "
                    "clone/amax of the same bytes, vLLM event ingestion vs msgpack alone, "
                    "memory over 100k/1M events, sampled-hit-to-verdict latency vs one "
                    "prefill, and hook tail latency while the verifier is busy. One table "
                    "(or --json); every figure measured side by side in one run.")
    add_perf_arguments(pf)
    r = bench_sub.add_parser(
        "reliability", help="fuzzers, floods, adapter faults, SIGKILL cycles (issue 12)",
        description="Seeded mutation fuzzers (KV events, probe wire, hook objects, HTTP), "
                    "floods, adapter faults and SIGKILL/restart cycles of evidence writing; "
                    "prints cases, survived, escaped and lost (must be 0).")
    # Arguments here, not in the module: building the parser must not import the fuzzers'
    # decoders (msgpack, an extra) for `kv-sidecar --help`.
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--quick", action="store_true",
                   help="1k cases per decoder, 3 kill cycles (seconds; the test suite's run)")
    r.add_argument("--seed", type=int, default=0)


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
