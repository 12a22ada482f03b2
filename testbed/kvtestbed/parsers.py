"""The testbed's ``kv-sidecar`` subcommands' parsers: demo, faults, bench, actions-demo,
calibrate.

Apart from what runs them (:mod:`kvtestbed.commands`): the core CLI and the configuration
schema (:mod:`sidecar.config.schema`, whose ``[demo]`` section derives from the demo's flags)
reach them through :mod:`sidecar.cli.testbed_hook` without importing the benchmarks, some of
which check the configuration surface themselves (no import circle). Heavy imports stay out,
so ``kv-sidecar --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from sidecar.checks import tolerance
from sidecar.cli.arg_types import DTYPES, device_name, nonneg_float, port, positive_int


def fault_name(text: str) -> str:
    """An argparse type: a fault ``kv-sidecar faults`` lists, so ``config check`` refuses a
    ``[demo] fault`` the demo would (the engines, and torch, load only when it is checked)."""
    try:
        from kvtestbed.engines import FAULTS  # the package registers the hybrid faults too
    except ImportError:  # torch/transformers missing: the command names the extra (exit 2)
        return text

    if text not in FAULTS:
        raise argparse.ArgumentTypeError(f"unknown fault {text!r}; known: {', '.join(FAULTS)} "
                                         "(see `kv-sidecar faults`)")
    return text


def _add_demo(sub: Any) -> None:
    d = sub.add_parser(
        "demo", help="reference engine + sidecar under a chat workload, optionally with a fault",
        description="Run the reference paged engine (a tiny random-init Llama) under a seeded "
                    "multi-turn chat workload with kv-sidecar attached, serve /metrics, "
                    "/healthz and /status on 127.0.0.1 while it runs, and print a summary. "
                    "With --fault, the engine corrupts its cache in the named way from a "
                    "request index on, and the summary shows what the sidecar caught.")
    d.add_argument("--fault", default="none", metavar="NAME", type=fault_name,
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
                   help="verify 1 hit in every N (default for the demo: 4; a Monitor's "
                        "default: 1000)")
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
    d.add_argument("--device", default="cpu", metavar="DEVICE", type=device_name,
                   help="where the engine's model and KV live: cpu or cuda[:N] (default: cpu; "
                        "cuda without a CUDA device is an error)")
    tolerance.add_arguments(d)


def _add_faults(sub: Any) -> None:
    sub.add_parser("faults", help="list the injectable faults",
                   description="List the faults the reference engine can inject by name.")


def _add_bench(sub: Any) -> None:
    from kvtestbed.bench.args import add_parser as add_bench_parser

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


