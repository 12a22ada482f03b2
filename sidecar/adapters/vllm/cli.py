"""``python -m sidecar.adapters.vllm``: the sidecar beside a vLLM OpenAI server.

Two subcommands:

* ``engine-args``: prints the ``--kv-transfer-config`` / ``--kv-events-config`` flags that
  connect a ``python -m vllm.entrypoints.openai.api_server`` to this sidecar;
* ``serve``: runs the sidecar (probe receiver, event audit, metrics bridge, Monitor) and
  serves ``/metrics``, ``/healthz`` and ``/status`` on 127.0.0.1.

See docs/guides/vllm.md (the docs site's vLLM guide) for a walk-through.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shlex
import signal
import sys
import threading
import time
from typing import Any

from sidecar.adapters.vllm.engine_config import events_config, probe_transfer_config
from sidecar.adapters.vllm.hashing import ALGOS
from sidecar.checks import tolerance
from sidecar.config.cli import add_config_arguments, configure
from sidecar.config.layers import ConfigError


def _engine_args(a: argparse.Namespace) -> int:
    flags = []
    if a.probe:
        from sidecar.core.monitor import SidecarConfig

        # The probe samples in the engine: it takes the start burst of [sidecar] (or the
        # default), the sidecar mirrors it (sidecar/export/outlook.py).
        burst = SidecarConfig(**{k: v for k, v in getattr(a, "sidecar_overrides", {}).items()
                                 if k in ("burst_hits", "burst_every")})
        flags += ["--kv-transfer-config", json.dumps(probe_transfer_config(
            a.probe, a.sample_every, a.blocks_per_sample, a.seed, burst.burst_hits,
            burst.burst_every))]
    if a.events:
        flags += ["--kv-events-config", json.dumps(events_config(a.events, a.replay))]
    print(" ".join(shlex.quote(f) for f in flags))
    return 0


def _serve(a: argparse.Namespace) -> int:
    from sidecar.adapters.vllm.service import VllmSidecar, VllmSidecarConfig
    from sidecar.core.monitor import SidecarConfig
    from sidecar.export.server import SidecarServer

    cfg = VllmSidecarConfig(
        model_dir=a.model, dtype=a.dtype, block_size=a.block_size,
        model_name=a.served_model_name, probe_endpoint=a.probe, events_endpoint=a.events,
        replay_endpoint=a.replay, events_bind=a.events_bind, hash_algo=a.hash_algo,
        hash_seed=a.hash_seed, metrics_url=a.metrics_url, engine_url=a.engine_url,
        reference=a.reference, allocator_every_s=a.poll_every,
        # [sidecar] keys from --config/KVSIDECAR_* first; the probe samples, so 1 in 1 here
        sidecar=SidecarConfig(**{**a.sidecar_overrides,
                                 **dict(sample_every=1, blocks_per_sample=a.blocks_per_sample,
                                        adapter_timeout_s=a.adapter_timeout,
                                        recompute_tokens_per_s=a.recompute_budget,
                                        **tolerance.config_fields(a))}))
    from sidecar.export.otel_push import check_arguments as check_otlp
    from sidecar.export.server import load_token

    try:
        check_otlp(a)
        token = load_token()  # before anything starts: an empty token is an error
    except ValueError as exc:
        print(f"kv-sidecar vllm serve: error: {exc}", file=sys.stderr)
        return 2
    sc = VllmSidecar(cfg).start()
    reset = _prefix_reset(a, sc)
    push = None
    if a.otlp_endpoint:
        from sidecar.export.otel_push import start_otlp_push

        push = start_otlp_push(sc.monitor, a.otlp_endpoint, a.otlp_interval, a.otlp_protocol)
    server = SidecarServer(sc.metrics.registry, sc.summary, a.host, a.port,
                           health=sc.health, token=token).start()
    print(f"kv-sidecar for vLLM: metrics on {server.url}/metrics", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait(a.duration if a.duration > 0 else None)
    sc.monitor.drain(10.0)
    summary = sc.summary()
    if reset is not None:
        reset.stop()
        summary["prefix_cache_resets"] = list(reset.history)
    if push is not None:
        push.shutdown()  # the last metrics and spans go out
    server.stop()
    sc.stop()
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return 0


def _prefix_reset(a: argparse.Namespace, sc: Any) -> Any:
    """``--reset-prefix-cache``: on every anomalous verdict, ask for a
    ``POST /reset_prefix_cache`` (sidecar/adapters/vllm/prefix_reset.py); None when off."""
    if not a.reset_prefix_cache:
        return None
    from sidecar.adapters.vllm.prefix_reset import PrefixCacheReset, ResetSettings

    base = a.engine_url or (a.metrics_url or "").removesuffix("/metrics")
    if not base:
        raise SystemExit("kv-sidecar vllm serve: error: --reset-prefix-cache needs "
                         "--engine-url (vLLM's server, started with VLLM_SERVER_DEV_MODE=1)")
    reset = PrefixCacheReset(base, ResetSettings(min_interval_s=a.reset_min_interval),
                             sc.metrics)
    sc.monitor.verdict_listeners.append(
        lambda verdict: reset.request("anomaly") if verdict.findings else None)
    print(f"kv-sidecar for vLLM: resets {reset.url} on an anomaly (at most every "
          f"{a.reset_min_interval:g}s)", flush=True)
    return reset


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"must be 0..86400 seconds, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sidecar.adapters.vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("engine-args", "serve"):
        s = sub.add_parser(name)
        s.add_argument("--probe", help="probe socket (the sidecar binds it), e.g. "
                                       "ipc:///tmp/kvsidecar-probe.sock")
        s.add_argument("--events", help="vLLM's KV event endpoint, e.g. "
                                        "ipc:///tmp/vllm-kv-events.sock")
        s.add_argument("--replay", help="vLLM's KV event replay endpoint")
        s.add_argument("--blocks-per-sample", type=int, default=2)
        if name == "engine-args":
            s.add_argument("--sample-every", type=int, default=100,
                           help="the probe samples 1 prefix hit in N")
            s.add_argument("--seed", type=int, default=0)
            s.set_defaults(fn=_engine_args)
            continue
        s.add_argument("--model", required=True, help="the checkpoint directory vLLM serves")
        s.add_argument("--served-model-name", help="defaults to --model, like vLLM")
        s.add_argument("--dtype", required=True, choices=("float32", "float16", "bfloat16"))
        s.add_argument("--block-size", type=int, required=True)
        s.add_argument("--events-bind", action="store_true",
                       help="bind --events (for a tcp://127.0.0.1:PORT endpoint)")
        s.add_argument("--hash-algo", default="sha256", choices=ALGOS)
        s.add_argument("--hash-seed", help="the engine's PYTHONHASHSEED, when it sets one")
        s.add_argument("--metrics-url", help="vLLM's /metrics, e.g. http://127.0.0.1:8000/metrics")
        s.add_argument("--engine-url", help="vLLM's server for engine-side recompute")
        s.add_argument("--reference", default="engine", choices=("engine", "hf", "none"))
        s.add_argument("--adapter-timeout", type=float, default=10.0)
        s.add_argument("--recompute-budget", type=float, default=100_000.0,
                       help="recomputed tokens per second at most (<= 0: unlimited)")
        s.add_argument("--poll-every", type=float, default=2.0,
                       help="seconds between reads of vLLM's /metrics")
        s.add_argument("--host", default="127.0.0.1")
        s.add_argument("--port", type=int, default=9400)
        from sidecar.export.otel_push import add_arguments as add_otlp_arguments

        add_otlp_arguments(s)
        s.add_argument("--reset-prefix-cache", action="store_true",
                       help="on an anomaly, POST vLLM's /reset_prefix_cache once no request "
                            "holds blocks (retried with backoff; needs --engine-url and vLLM "
                            "started with VLLM_SERVER_DEV_MODE=1; off by default)")
        s.add_argument("--reset-min-interval", type=_interval, default=300.0,
                       help="seconds between two resets at most (rate limit; default 300)")
        s.add_argument("--duration", type=float, default=0.0,
                       help="stop after this many seconds and print the summary (0: run)")
        tolerance.add_arguments(s)
        s.set_defaults(fn=_serve)
    for name in ("engine-args", "serve"):  # --config FILE, --set (sidecar/config/cli.py)
        add_config_arguments(sub.choices[name])
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    p = parser()
    a = p.parse_args(argv)
    try:  # fill what the flags did not give from KVSIDECAR_* and --config FILE
        configure("vllm", a.cmd, p, argv if argv is not None else sys.argv[1:], a)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kv-sidecar vllm: error: {problem}", file=sys.stderr)
        return 2
    if a.cmd == "serve" and a.served_model_name is None:
        a.served_model_name = a.model
    started = time.monotonic()
    rc = int(a.fn(a))
    logging.getLogger(__name__).debug("ran %.1fs", time.monotonic() - started)
    return rc


if __name__ == "__main__":
    sys.exit(main())
