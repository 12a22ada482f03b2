"""The testbed's ``kv-sidecar`` subcommands: demo, faults, bench, actions-demo, calibrate.

The core CLI (:mod:`sidecar.cli.main`) adds these when the testbed is importable (installed,
or on ``PYTHONPATH`` as in the prebuilt venvs): :func:`kvtestbed.parsers.add_parser` registers
one by name (re-exported here), :func:`run` runs a parsed one. Heavy imports (torch
models, transformers) stay inside the functions, so ``kv-sidecar --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json

from kvtestbed.parsers import PARSERS, add_parser
from sidecar.checks import tolerance
from sidecar.cli.arg_types import UsageError
from sidecar.core.extras import require

__all__ = ["PARSERS", "add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Run a parsed testbed subcommand; returns the exit code."""
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "faults":
        return cmd_faults()
    if args.command == "bench":
        require("bench")
        from kvtestbed.bench.entry import run_bench

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
    from kvtestbed.engines.hybrid_faults import fault_applies

    # An unknown --fault never gets here: the flag's type (kvtestbed.parsers.fault_name)
    # refuses it, for the flag, the config file, the env and --set alike.
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
    from sidecar.export.server import load_token

    try:  # /status behind a bearer token when one is set; an empty one is an error
        opts.token = load_token()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from sidecar.adapters.remote.process import SidecarProcessError

    try:
        summary = run_demo(opts)
    except (ProfileError, SidecarProcessError) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # what dispatch = "process" does not run beside
        if "dispatch = 'process'" not in str(exc):
            raise
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
