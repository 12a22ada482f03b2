"""``kv-sidecar``: the command line.

Subcommands:
  demo      run the reference engine under a chat workload with the sidecar attached
  faults    list the faults the reference engine can inject
  signals   list the exported signals (``--markdown`` prints the README table)
  vllm      the sidecar beside a vLLM server (event audit, metrics bridge, probe)
  sglang    the sidecar beside an SGLang server (radix-cache backend tap)
  bench     benchmarks (``bench detection``)
  config    check a configuration file, show the effective configuration
  evidence  list and open the anomaly evidence records (``evidence show ID --plot out.png``)

Exit codes: 0 success, 1 a run failed, 2 bad usage (unknown fault, bad flag value).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sidecar import __version__
from sidecar.checks import tolerance
from sidecar.config.layers import ConfigError
from sidecar.core.extras import MissingExtra, require


class UsageError(Exception):
    """Bad user input: printed without a traceback, exit code 2."""


def _bounded(kind: type, low: float, high: float | None = None) -> Callable[[str], Any]:
    """An argparse type: parse ``kind`` and check ``low <= value (<= high)``, with a message
    that says what was expected (argparse turns it into exit code 2)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'whole number' if kind is int else 'number'}, got {text!r}"
            ) from None
        if value < low or (high is not None and value > high):
            bound = f"{low:g}..{high:g}" if high is not None else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


_positive_int = _bounded(int, 1)
_nonneg_float = _bounded(float, 0.0)
_port = _bounded(int, 0, 65535)


DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-sidecar",
        description="Verify that an LLM engine's KV-cache hits hold the right KV: sample 1 in "
                    "N hits, recompute the KV for the prefix, compare, and export the anomaly "
                    "rate next to the hit rate (Prometheus /metrics, OpenTelemetry).")
    p.add_argument("--version", action="version", version=f"kv-sidecar {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

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
    d.add_argument("--requests", type=_positive_int, default=400,
                   help="requests to serve (default: 400)")
    d.add_argument("--sample-every", type=_positive_int, default=4, metavar="N",
                   help="verify 1 hit in every N (default for the demo: 4; production: 1000)")
    d.add_argument("--seed", type=int, default=0, help="seed for model, workload and faults")
    d.add_argument("--port", type=_port, default=9464,
                   help="port for /metrics on 127.0.0.1 (0 = any free port; default: 9464)")
    d.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the table (progress goes to stderr)")
    d.add_argument("--hold", type=_nonneg_float, default=0.0, metavar="SECONDS",
                   help="keep serving /metrics this long after the workload ends")
    d.add_argument("--pace", type=_nonneg_float, default=0.0, metavar="SECONDS",
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

    sub.add_parser("faults", help="list the injectable faults",
                   description="List the faults the reference engine can inject by name.")

    v = sub.add_parser("vllm", add_help=False,
                       help="the sidecar beside a vLLM server (`kv-sidecar vllm --help`)",
                       description="Run kv-sidecar beside vLLM: event audit, metrics bridge, "
                                   "sampled content verification through the in-engine probe.")
    v.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    g = sub.add_parser("sglang", add_help=False,
                       help="the sidecar beside an SGLang server (`kv-sidecar sglang --help`)",
                       description="Run kv-sidecar beside SGLang: the kv-sidecar radix-cache "
                                   "backend's tap, sampled verification, slot invariants.")
    g.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    s = sub.add_parser("signals", help="list the exported signals",
                       description="List every signal kv-sidecar exports (the single source "
                                   "of truth in sidecar/signals.py).")
    s.add_argument("--markdown", action="store_true", help="print the README's table")

    from sidecar.bench import add_parser as add_bench_parser

    add_bench_parser(sub)

    from sidecar.canary.cli import add_parser as add_canary_parser

    add_canary_parser(sub)

    from sidecar.evidence.cli import add_parser as add_evidence_parser

    add_evidence_parser(sub)

    from sidecar.config.cli import add_config_arguments
    from sidecar.config.cli import add_parser as add_config_parser

    add_config_parser(sub)
    for name in CONFIGURED:
        add_config_arguments(sub.choices[name])
    from sidecar.actions_demo_cli import add_parser as add_actions_demo_parser

    add_actions_demo_parser(sub)  # background scrub, quarantine + breaker (engineer scrub)
    from sidecar.protect.cli import add_parser as add_guard_parser

    add_guard_parser(sub)  # the cache-bypass guard (sidecar/protect/)
    add_config_arguments(sub.choices["guard"])
    from sidecar.calibrate_cli import add_parser as add_calibrate_parser

    add_calibrate_parser(sub)  # a calibration profile from a trusted engine
    return p


CONFIGURED = ("demo", "canary")  # the subcommands that take --config (sidecar/config/cli.py)


def cmd_faults() -> int:
    require("faults")
    from sidecar.engines.reference.faults import FAULTS

    width = max(len(n) for n in FAULTS)
    for name, cls in FAULTS.items():
        print(f"{name:<{width}}  {cls.description}")
    return 0


def cmd_signals(markdown: bool) -> int:
    from sidecar import signals

    if markdown:
        print(signals.markdown_table())
        return 0
    for sig in signals.ALL_SIGNALS:
        labels = ",".join(signals.BASE_LABELS + sig.labels)
        print(f"{sig.name:<44} {sig.type.value:<9} {{{labels}}}  {sig.help}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    require("demo")
    from sidecar.export.otel_push import check_arguments as check_otlp

    try:
        check_otlp(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from sidecar.demo import DemoOptions, format_summary, run_demo
    from sidecar.engines.reference.faults import FAULTS

    if args.fault not in FAULTS:
        raise UsageError(f"unknown fault {args.fault!r}; known faults: {', '.join(FAULTS)} "
                         "(see `kv-sidecar faults`)")
    from sidecar.engines.reference.hybrid_faults import fault_applies
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


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: finally blocks close the server


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm"]:  # its own parser: every flag after `vllm` is the adapter's
        try:
            require("vllm")
        except MissingExtra as exc:
            print(f"kv-sidecar: error: {exc}", file=sys.stderr)
            return 2
        from sidecar.adapters.vllm.cli import main as vllm_main

        return vllm_main(argv[1:] or ["--help"])
    if argv[:1] == ["sglang"]:  # its own parser too; the pipe needs the vllm extra's zmq
        try:
            require("vllm")
        except MissingExtra as exc:
            print(f"kv-sidecar: error: {exc}", file=sys.stderr)
            return 2
        from sidecar.adapters.sglang.cli import main as sglang_main

        return sglang_main(argv[1:] or ["--help"])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        if args.command in CONFIGURED:
            from sidecar.config.cli import configure

            configure(args.command, args.command, parser, argv, args)
        if args.command == "config":
            from sidecar.config.cli import run_config

            return run_config(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "faults":
            return cmd_faults()
        if args.command == "signals":
            return cmd_signals(args.markdown)
        if args.command == "bench":
            require("bench")
            from sidecar.bench import run_bench

            return run_bench(args)
        if args.command == "canary":
            from sidecar.canary.cli import run_canary

            return run_canary(args)
        if args.command == "evidence":
            from sidecar.evidence.cli import EvidenceError, run_evidence

            try:
                return run_evidence(args)
            except EvidenceError as exc:
                raise UsageError(str(exc)) from None
        if args.command == "guard":
            from sidecar.config.cli import configure
            from sidecar.protect.cli import run_guard

            configure("guard", "guard", parser, argv, args)
            return run_guard(args)
        if args.command == "calibrate":
            require("demo")
            from sidecar.calibrate_cli import run_calibrate

            return run_calibrate(args)
        if args.command == "actions-demo":
            require("demo")
            from sidecar.actions_demo import run as run_actions_demo

            return run_actions_demo(args)
        parser.print_help()
        return 2
    except (UsageError, MissingExtra) as exc:
        print(f"kv-sidecar: error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kv-sidecar: error: {problem}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kv-sidecar: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
