"""The flags of ``python -m sidecar.adapters.vllm`` (``kv-sidecar vllm``), apart from what runs
them (:mod:`sidecar.adapters.vllm.cli`), so the configuration schema
(:mod:`sidecar.config.schema`) derives its ``[vllm]`` section from them without importing the
command that configures itself from that schema (no import circle)."""

from __future__ import annotations

import argparse
import math

from sidecar.adapters.vllm.hashing import ALGOS
from sidecar.checks import tolerance
from sidecar.cli.arg_types import bounded, port
from sidecar.config.settings import ENGINE_METRICS_EVERY_S, POLL_PERIOD


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"must be 0..86400 seconds, got {text}")
    return value


_fingerprint_every = bounded(int, 0)  # 0: off


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``engine-args`` and ``serve`` (what the config schema's ``[vllm]``
    section derives from); :func:`sidecar.adapters.vllm.cli.parser` adds what runs them."""
    p = argparse.ArgumentParser(prog="kv-sidecar vllm", description=description,
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
            s.add_argument("--fingerprint-every", type=_fingerprint_every, default=1,
                           help="the probe fingerprints 1 full block in N as the engine "
                                "writes it (default: 1, every block; 0: off)")
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
        s.add_argument("--poll-every", type=float, default=ENGINE_METRICS_EVERY_S,
                       help="seconds between reads of vLLM's /metrics, the allocator's view "
                            "of vLLM (each read costs vLLM's HTTP process 5-10 ms of CPU; "
                            "every 2 s tipped a saturated 2-core vLLM into small batches); "
                            f"{POLL_PERIOD.low:g}..{POLL_PERIOD.high:g}, default %(default)s")
        s.add_argument("--host", default="127.0.0.1")
        s.add_argument("--port", type=port, default=9400,
                       help="the sidecar's HTTP port: /metrics, /healthz, /status (0: any "
                            "free port; default: 9400)")
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
        c = s.add_argument_group(
            "calibration profile", "Run beside a vLLM you trust (a known-good build, model "
            "and hardware) with --write-profile FILE and send it traffic with shared "
            "prefixes: the sidecar holds the tolerance at the fixed table, and at exit "
            "(SIGTERM, Ctrl-C or --duration) writes the noise floor its verified blocks showed "
            "to FILE, per reference kind and write path; later runs load it with "
            "--calibration-profile FILE. Nothing is written if anything was flagged or too "
            "few blocks were verified (exit 1). --calibrate and --calibration-multiple do "
            "not apply to such a run.")
        c.add_argument("--write-profile", metavar="FILE",
                       help="measure this trusted engine's noise floor and write it to FILE "
                            "at exit (entries for other models and dtypes in FILE are kept)")
        c.add_argument("--profile-min-blocks", type=bounded(int, 1),
                       default=tolerance.DEFAULT_CALIBRATION_SAMPLES, metavar="N",
                       help="refuse to write an entry measured over fewer clean blocks "
                            f"(default: {tolerance.DEFAULT_CALIBRATION_SAMPLES}; the "
                            "prefill/decode entries need N each)")
        c.add_argument("--profile-multiple", type=bounded(float, 1, 1e6), default=3.0,
                       metavar="X", help="profile tolerance = X x the floor (default: 3, as "
                                         "kv-sidecar calibrate)")
        c.add_argument("--profile-replace", action="store_true",
                       help="write only the new entries (default: keep FILE's other ones; "
                            "a regular file that is not a profile is refused unless this is "
                            "given)")
    return p


