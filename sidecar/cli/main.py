"""``kv-sidecar``: the command line.

Subcommands:
  demo      run the reference engine under a chat workload with the sidecar attached (testbed)
  faults    list the faults the reference engine can inject (testbed)
  signals   list the exported signals (``--markdown``: as a Markdown table)
  vllm      the sidecar beside a vLLM server (event audit, metrics bridge, probe)
  sglang    the sidecar beside an SGLang server (radix-cache backend tap)
  bench     benchmarks (``bench detection``; testbed)
  config    check a configuration file, show the effective configuration
  evidence  list and open the anomaly evidence records (``evidence show ID --plot out.png``)

The testbed's commands (demo, faults, bench, actions-demo, calibrate) come from
:mod:`kvtestbed.parsers` and :mod:`kvtestbed.commands` when the testbed (``testbed/``,
``pip install ./testbed``) is importable (:mod:`sidecar.cli.testbed_hook`); without it each
says so in one line and exits 2.

Exit codes: 0 success, 1 a run failed, 2 bad usage (unknown fault, bad flag value).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from collections.abc import Sequence
from typing import Any

from sidecar import __version__
from sidecar.cli.arg_types import UsageError
from sidecar.cli.testbed_hook import TESTBED_COMMANDS, TESTBED_MISSING, testbed_parsers
from sidecar.config.layers import ConfigError
from sidecar.core.extras import MissingExtra, require


def _testbed() -> Any:
    """:mod:`kvtestbed.commands` (what runs the testbed's commands) when the testbed is
    importable, else None; its parsers come through :mod:`sidecar.cli.testbed_hook`."""
    if testbed_parsers() is None:
        return None
    from kvtestbed import commands

    return commands


def _add_testbed_parser(sub: Any, name: str) -> None:
    """The testbed's parser for ``name``, or a placeholder that says where the command is."""
    parsers = testbed_parsers()
    if parsers is not None:
        parsers.add_parser(sub, name)
        return
    stub = sub.add_parser(name, add_help=False, help="(in the testbed: `pip install ./testbed`)")
    stub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-sidecar",
        description="Verify that an LLM engine's KV-cache hits hold the right KV: sample 1 in "
                    "N hits, recompute the KV for the prefix, compare, and export the anomaly "
                    "rate next to the hit rate (Prometheus /metrics, OpenTelemetry).")
    p.add_argument("--version", action="version", version=f"kv-sidecar {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    _add_testbed_parser(sub, "demo")
    _add_testbed_parser(sub, "faults")

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
                                   "of truth in sidecar/signals/).")
    s.add_argument("--markdown", action="store_true", help="print the table as Markdown")

    _add_testbed_parser(sub, "bench")

    from sidecar.canary.cli import add_parser as add_canary_parser

    add_canary_parser(sub)

    from sidecar.evidence.cli import add_parser as add_evidence_parser

    add_evidence_parser(sub)

    from sidecar.config.cli import add_config_arguments
    from sidecar.config.cli import add_parser as add_config_parser

    add_config_parser(sub)
    for name in CONFIGURED:
        add_config_arguments(sub.choices[name])
    _add_testbed_parser(sub, "actions-demo")  # background scrub, quarantine + breaker
    from sidecar.protect.cli import add_parser as add_guard_parser

    add_guard_parser(sub)  # the cache-bypass guard (sidecar/protect/)
    add_config_arguments(sub.choices["guard"])
    _add_testbed_parser(sub, "calibrate")  # a calibration profile from a trusted engine
    if testbed_parsers() is None:
        p.epilog = TESTBED_MISSING.format(command=", ".join(TESTBED_COMMANDS))
    return p


CONFIGURED = ("demo", "canary")  # the subcommands that take --config (sidecar/config/cli.py)


def cmd_signals(markdown: bool) -> int:
    from sidecar import signals

    if markdown:
        print(signals.markdown_table())
        return 0
    for sig in signals.ALL_SIGNALS:
        labels = ",".join(signals.BASE_LABELS + sig.labels)
        print(f"{sig.name:<44} {sig.type.value:<9} {{{labels}}}  {sig.help}")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: finally blocks close the server


# 128 + SIGPIPE: what a shell reports for a command whose reader went away (`| head -1`).
EXIT_BROKEN_PIPE = 141


def _stdout_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has closed it: its write end polls
    as an error. Tells a closed stdout apart from a broken pipe to a peer (an engine, a
    server), which stays an ordinary error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno: a test's StringIO, closed
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point. A closed stdout (``kv-sidecar signals | true``) ends the command
    quietly with 141, as a shell reports it, instead of a traceback about a broken pipe
    (Python ignores SIGPIPE, so every write to the pipe raises). SIGPIPE itself is left
    ignored: the sidecar's servers write to sockets whose peers may go away at any time."""
    try:
        try:
            return _main(argv)
        finally:  # argparse's --help exits too: what is buffered fails here, not at teardown
            # The command is over: a SIGTERM now (interpreter shutdown, atexit callbacks)
            # ends the process as the default does, not with a KeyboardInterrupt traceback.
            if signal.getsignal(signal.SIGTERM) is _interrupt:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before a command set its own handler
        return 130
    except BrokenPipeError:
        if not _stdout_gone():
            print("kv-sidecar: error: broken pipe", file=sys.stderr)
            return 1
        # Nothing more can reach the reader; point stdout at /dev/null so the interpreter's
        # last flush of the buffered rest does not report the same broken pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The engine adapters' commands (the two branches below) keep SIGTERM's default until
    # they install their own handler once they serve: the process ends at once (an exception
    # raised into their torch import left a half-imported numpy and a traceback).
    if argv[:1] == ["vllm"]:  # its own parser: every flag after `vllm` is the adapter's
        try:
            require("vllm")
        except MissingExtra as exc:
            print(f"kv-sidecar: error: {exc}", file=sys.stderr)
            return 2
        from sidecar.adapters.vllm.cli import main as vllm_main

        return vllm_main(argv[1:])  # alone: its help, exit 2
    if argv[:1] == ["sglang"]:  # its own parser too; the pipe needs the vllm extra's zmq
        try:
            require("vllm")
        except MissingExtra as exc:
            print(f"kv-sidecar: error: {exc}", file=sys.stderr)
            return 2
        from sidecar.adapters.sglang.cli import main as sglang_main

        return sglang_main(argv[1:])  # alone: its help, exit 2
    # Every other command: SIGTERM unwinds like Ctrl-C, so finally blocks close what it opened.
    signal.signal(signal.SIGTERM, _interrupt)
    if argv[:1] and argv[0] in TESTBED_COMMANDS and testbed_parsers() is None:
        print(f"kv-sidecar: error: {TESTBED_MISSING.format(command=argv[0])}", file=sys.stderr)
        return 2
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
        if args.command in TESTBED_COMMANDS:
            testbed = _testbed()
            assert testbed is not None  # main() answers a missing testbed before parsing
            return int(testbed.run(args))
        if args.command == "signals":
            return cmd_signals(args.markdown)
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
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            raise  # main(): the reader went away
        print(f"kv-sidecar: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
