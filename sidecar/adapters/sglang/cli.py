"""``kv-sidecar sglang``: the sidecar beside ``python -m sglang.launch_server``.

* ``engine-args``: prints the environment variable and the flags that make an SGLang server
  load the kv-sidecar radix-cache backend and connect its tap to this sidecar;
* ``serve``: runs the sidecar (tap receiver, Monitor with the HF reference, slot census,
  SGLang's /metrics audited) and serves ``/metrics``, ``/healthz`` and ``/status`` on
  127.0.0.1.

See docs/guides/sglang.md (the docs site's SGLang guide).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import signal
import sys
import threading

from sidecar.adapters.peer_settings import check_settings
from sidecar.adapters.sglang.backend import BACKEND_NAME, CONFIG_ENV, TAP_KEYS
from sidecar.checks import tolerance
from sidecar.cli.arg_types import bounded, listening, port, started
from sidecar.config.settings import ENGINE_METRICS_EVERY_S, POLL_PERIOD


def _engine_args(a: argparse.Namespace) -> int:
    tap = {"endpoint": a.probe, "block_size": a.block_size, "sample_every": a.sample_every,
           "blocks_per_sample": a.blocks_per_sample, "seed": a.seed}
    try:  # what the tap will check at SGLang's start, checked before it is printed
        check_settings(tap, TAP_KEYS, "settings")
    except ValueError as exc:
        print(f"kv-sidecar sglang engine-args: error: {exc}", file=sys.stderr)
        return 2
    print(f"export {CONFIG_ENV}={shlex.quote(json.dumps(tap))}")
    print(f"# then: python -m sglang.launch_server ... --radix-cache-backend {BACKEND_NAME} "
          "--page-size 1 --enable-metrics")
    return 0


def _serve(a: argparse.Namespace) -> int:
    from sidecar.adapters.sglang.service import SglangSidecar, SglangSidecarConfig
    from sidecar.core.monitor import SidecarConfig
    from sidecar.export.server import SidecarServer, load_token

    cfg = SglangSidecarConfig(
        model_dir=a.model, dtype=a.dtype, block_size=a.block_size, probe_endpoint=a.probe,
        metrics_url=a.metrics_url, reference=a.reference, allocator_every_s=a.poll_every,
        metrics_every_s=a.metrics_every,
        # the tap samples in the engine, so 1 in 1 here
        sidecar=SidecarConfig(sample_every=1, blocks_per_sample=a.blocks_per_sample,
                              adapter_timeout_s=a.adapter_timeout,
                              recompute_tokens_per_s=a.recompute_budget,
                              **tolerance.config_fields(a)))
    try:
        token = load_token()  # before anything starts: an empty token is an error
        sc = SglangSidecar(cfg)  # describe() from --model: nothing is running yet
    except ValueError as exc:  # CheckpointError, a bad --reference, the token: one line
        print(f"kv-sidecar sglang serve: error: {exc}", file=sys.stderr)
        return 2
    if not started(sc, "kv-sidecar sglang serve"):
        return 1
    server = listening(lambda: SidecarServer(sc.metrics.registry, sc.summary, a.host, a.port,
                                             token=token).start(),
                       sc, "kv-sidecar sglang serve")
    if server is None:
        return 1
    print(f"kv-sidecar for SGLang: metrics on {server.url}/metrics", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait(a.duration if a.duration > 0 else None)
    sc.monitor.drain(10.0)
    summary = sc.summary()
    server.stop()
    sc.stop()
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-sidecar sglang", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    helps = {"engine-args": "print the flags that load the tap into SGLang's launch_server",
             "serve": "run the sidecar beside a SGLang server started with those flags"}
    for name in ("engine-args", "serve"):
        s = sub.add_parser(name, help=helps[name], description=helps[name] + ".")
        s.add_argument("--probe", required=True,
                       help="the tap's socket (the sidecar binds it), e.g. "
                            "ipc:///tmp/kvsidecar-sglang.sock")
        s.add_argument("--block-size", type=int, default=16,
                       help="tokens per verified block (the sidecar's unit on SGLang's slots)")
        s.add_argument("--blocks-per-sample", type=int, default=2)
        if name == "engine-args":
            s.add_argument("--sample-every", type=int, default=100,
                           help="the tap samples 1 prefix hit in N")
            s.add_argument("--seed", type=int, default=0)
            s.set_defaults(fn=_engine_args)
            continue
        s.add_argument("--model", required=True, help="the checkpoint directory SGLang serves")
        s.add_argument("--dtype", required=True, choices=("float32", "float16", "bfloat16"))
        s.add_argument("--metrics-url", help="SGLang's /metrics (--enable-metrics), e.g. "
                                             "http://127.0.0.1:30000/metrics")
        s.add_argument("--reference", default="hf", choices=("hf", "none"))
        s.add_argument("--adapter-timeout", type=float, default=10.0)
        s.add_argument("--recompute-budget", type=float, default=100_000.0,
                       help="recomputed tokens per second at most (<= 0: unlimited)")
        low, high = POLL_PERIOD.low or 0, POLL_PERIOD.high
        period = bounded(float, low, high)
        span = f"{low:g}..{high:g}" if high is not None else f">= {low:g}"
        s.add_argument("--poll-every", type=period, default=2.0,
                       help="seconds between publications of the allocator state (from "
                            "the tap's latest slot census, sent about once a second); "
                            f"{span}, default %(default)s")
        s.add_argument("--metrics-every", type=period, default=ENGINE_METRICS_EVERY_S,
                       help="seconds between reads of --metrics-url (each read costs "
                            f"SGLang's HTTP process ~8 ms of CPU); {span}, default "
                            "%(default)s")
        s.add_argument("--host", default="127.0.0.1")
        s.add_argument("--port", type=port, default=9400,
                       help="the sidecar's HTTP port: /metrics, /healthz, /status (0: any "
                            "free port; default: 9400)")
        s.add_argument("--duration", type=float, default=0.0,
                       help="stop after this many seconds and print the summary (0: run)")
        tolerance.add_arguments(s)
        s.set_defaults(fn=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    for noisy in ("apscheduler", "torch"):  # torch logs cache stats at INFO on exit
        logging.getLogger(noisy).setLevel(logging.WARNING)
    p = parser()
    if not argv and argv is not None:  # `kv-sidecar sglang` alone: which subcommand?
        p.print_help()
        return 2
    a = p.parse_args(argv)
    return int(a.fn(a))


if __name__ == "__main__":
    sys.exit(main())
