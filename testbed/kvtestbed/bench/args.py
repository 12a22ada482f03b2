"""Flags of ``kv-sidecar bench detection``, kept free of heavy imports: the CLI builds its
parser on every invocation, and importing torch for ``--help`` would cost seconds."""

from __future__ import annotations

import argparse
import os

from sidecar.cli.arg_types import positive_int

DTYPES = ("float32", "bfloat16", "float16")
MODELS = ("reference", "hybrid", "recurrent")  # faults.MODEL_GROUP_KINDS (tested)
KV_STORAGES = ("int8",)  # mirrors kvtestbed.engines.quant.KV_STORAGES (tested)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES, metavar="DTYPE",
                   help=f"model/KV dtypes ({', '.join(DTYPES)}; default: all)")
    p.add_argument("--faults", nargs="+", default=None, metavar="NAME",
                   help="faults to run (default: every fault in `kv-sidecar faults`)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--requests", type=positive_int, default=300,
                   help="requests per fault run (default: 300)")
    p.add_argument("--sample-every", type=positive_int, default=2, metavar="N",
                   help="verify 1 hit in N in the fault runs (default: 2)")
    p.add_argument("--blocks-per-sample", type=positive_int, default=None, metavar="N",
                   help="blocks verified per sampled hit (default: all of them)")
    p.add_argument("--clean-samples", type=int, default=5000, metavar="N",
                   help="verified blocks per clean run, at least (default: 5000; 0: skip)")
    p.add_argument("--clean-storage", nargs="+", default=["model", *KV_STORAGES],
                   choices=["model", *KV_STORAGES], metavar="FORMAT",
                   help="KV storage formats of the clean runs (default: model int8)")
    p.add_argument("--policy-seeds", type=int, default=10, metavar="N",
                   help="seeds per sampling-policy comparison (default: 10; 0: skip)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault and clean runs")
    p.add_argument("--jobs", type=positive_int, default=max(1, min(2, os.cpu_count() or 1)),
                   help="worker processes (default: min(2, CPUs))")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless every fault is caught (recall 1.0, or an allocator "
                        "signal) with no false alarm and every clean run is clean")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--calibrate", type=int, default=64, metavar="N",
                   help="the sidecar calibrates its tolerance from the first N clean blocks "
                        "of every run (default: 64, done before any fault starts; 0: the "
                        "fixed tolerance table)")
    p.add_argument("--model", nargs="+", default=["reference"], choices=MODELS,
                   metavar="MODEL",
                   help="reference engine models to run (reference, hybrid: Gemma2 sliding "
                        "+ full, recurrent: LFM2 conv state + full; default: reference). "
                        "Each fault runs on the models that have the cache groups it needs")
    p.add_argument("--calibration-multiple", type=float, default=4.0, metavar="X",
                   help="calibrated tolerance = X x noise floor (default: 4)")
    p.add_argument("--calibration-profile", default=None, metavar="PATH",
                   help="the calibration profile every run starts from (default: the "
                        "reference engines' shipped profile, as `kv-sidecar demo` uses; "
                        "\"\": none, the tolerance learnt from the first --calibrate blocks "
                        "alone)")




def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its benchmarks on the CLI's subparsers."""
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
