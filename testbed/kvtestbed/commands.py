"""The testbed's ``kv-sidecar`` subcommands: demo, faults, bench, actions-demo, calibrate.

The core CLI (:mod:`sidecar.cli.main`) adds these when the testbed is importable (installed,
or on ``PYTHONPATH`` as in the prebuilt venvs): :func:`add_parser` registers one by name,
:func:`run` runs a parsed one. Heavy imports (torch models, transformers) stay inside the
functions, so ``kv-sidecar --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from sidecar.checks import tolerance
from sidecar.cli.arg_types import DTYPES, UsageError, nonneg_float, port, positive_int
from sidecar.core.extras import require


def _add_demo(sub: Any) -> None:
    d = sub.add_parser(
        "demo", help="reference engine + sidecar under a chat workload, optionally with a fault",
        description="Run the reference paged engine (a tiny random-init Llama) under a seeded "
                    "multi-turn chat workload with kv-sidecar attached, serve /metrics, "
                    "/healthz and /status on 127.0.0.1 while it runs, and print a summary. "
                    "With --fault, the engine corrupts its cache in the named way from a "
                    "request index on, and the summary shows what the sidecar caught.")
    d.add_argument("--fault", default="none", metavar="NAME",
                   help="fault to inject (see `kv-sidecar faults`); default: none")
    d.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="model and KV dtype (default: float32)")
    d.add_argument("--model", default="reference", choices=("reference", "hybrid", "recurrent"),
                   help="reference: tiny Llama (one full-attention group); hybrid: Gemma2 "
                        "sliding window + full; recurrent: LFM2 conv state + full "
                        "(default: reference)")
    d.add_argument("--requests", type=positive_int, default=400,
                   help="requests to serve (default: 400)")
    d.add_argument("--sample-every", type=positive_int, default=4, metavar="N",
                   help="verify 1 hit in every N (default for the demo: 4; production: 1000)")
    d.add_argument("--seed", type=int, default=0, help="seed for model, workload and faults")
    d.add_argument("--port", type=port, default=9464,
                   help="port for /metrics on 127.0.0.1 (0 = any free port; default: 9464)")
    d.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the table (progress goes to stderr)")
    d.add_argument("--hold", type=nonneg_float, default=0.0, metavar="SECONDS",
                   help="keep serving /metrics this long after the workload ends")
    d.add_argument("--pace", type=nonneg_float, default=0.0, metavar="SECONDS",
                   help="sleep between requests (stretches the run for live scraping)")
    d.add_argument("--evidence-dir", default=None, metavar="DIR",
                   help="write one JSON evidence file per anomaly here")
    d.add_argument("--otel", choices=("none", "console"), default="none",
                   help="also export through OpenTelemetry (console exporter)")
    from sidecar.export.otel_push import add_arguments as add_otlp_arguments

    add_otlp_arguments(d)
    d.add_argument("--quiet", action="store_true", help="no progress output")
    d.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where the engine's model and KV live: cpu or cuda[:N] (default: cpu; "
                        "cuda without a CUDA device is an error)")
    tolerance.add_arguments(d)


def _add_faults(sub: Any) -> None:
    sub.add_parser("faults", help="list the injectable faults",
                   description="List the faults the reference engine can inject by name.")


def _add_bench(sub: Any) -> None:
    from kvtestbed.bench import add_parser as add_bench_parser

    add_bench_parser(sub)


def _add_actions_demo(sub: Any) -> None:
    from kvtestbed.actions_demo_cli import add_parser as add_actions_demo_parser

    add_actions_demo_parser(sub)  # background scrub, quarantine + breaker (engineer scrub)


def _add_calibrate(sub: Any) -> None:
    from kvtestbed.calibrate_cli import add_parser as add_calibrate_parser

    add_calibrate_parser(sub)  # a calibration profile from a trusted engine


PARSERS: dict[str, Callable[[Any], None]] = {
    "demo": _add_demo,
    "faults": _add_faults,
    "bench": _add_bench,
    "actions-demo": _add_actions_demo,
    "calibrate": _add_calibrate,
}


def add_parser(sub: Any, name: str) -> None:
    """Register the subcommand ``name`` (one of :data:`PARSERS`) on the CLI's subparsers."""
    PARSERS[name](sub)


def run(args: argparse.Namespace) -> int:
    """Run a parsed testbed subcommand; returns the exit code."""
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "faults":
        return cmd_faults()
    if args.command == "bench":
        require("bench")
        from kvtestbed.bench import run_bench

        return run_bench(args)
    if args.command == "calibrate":
        require("demo")
        from kvtestbed.calibrate_cli import run_calibrate

        return run_calibrate(args)
    if args.command == "actions-demo":
        require("demo")
        from kvtestbed.actions_demo import run as run_actions_demo

        return run_actions_demo(args)
    raise ValueError(f"not a testbed command: {args.command!r}")


def cmd_faults() -> int:
    require("faults")
    from kvtestbed.engines.faults import FAULTS

    width = max(len(n) for n in FAULTS)
    for name, cls in FAULTS.items():
        print(f"{name:<{width}}  {cls.description}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    require("demo")
    from sidecar.export.otel_push import check_arguments as check_otlp

    try:
        check_otlp(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from kvtestbed.demo import DemoOptions, format_summary, run_demo
    from kvtestbed.engines.faults import FAULTS

    if args.fault not in FAULTS:
        raise UsageError(f"unknown fault {args.fault!r}; known faults: {', '.join(FAULTS)} "
                         "(see `kv-sidecar faults`)")
    from kvtestbed.engines.hybrid_faults import fault_applies
    if not fault_applies(args.fault, args.model):
        raise UsageError(f"fault {args.fault!r} does not apply to --model {args.model} "
                         "(it needs cache groups that model does not have)")
    opts = DemoOptions(fault=args.fault, model=args.model, dtype=args.dtype,
                       requests=args.requests,
                       sample_every=args.sample_every, seed=args.seed, port=args.port,
                       hold_s=args.hold, pace_s=args.pace, evidence_dir=args.evidence_dir,
                       otel=args.otel, otlp_endpoint=args.otlp_endpoint,
                       otlp_interval_s=args.otlp_interval,
                       otlp_protocol=args.otlp_protocol, progress=not args.quiet,
                       sidecar={**args.sidecar_overrides, **tolerance.config_fields(args)})
    opts.device = _device(args.device)
    if opts.device != "cpu" and args.model != "reference":
        raise UsageError(f"--model {args.model} runs on the CPU only; --device "
                         f"{args.device} needs --model reference")
    from sidecar.checks.calibration_profile import ProfileError

    try:
        summary = run_demo(opts)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
    else:
        print(format_summary(summary))
    return 0


def _device(name: str) -> str:
    """``--device``, checked before anything is built (a usage error, exit 2)."""
    from sidecar.core.device import DeviceUnavailable, resolve_device

    try:
        return str(resolve_device(name))
    except DeviceUnavailable as exc:
        raise UsageError(str(exc)) from None
