"""``kv-sidecar guard``: the cache-bypass guard in front of an OpenAI-compatible server.

At start the guard sends a few paired probes (the canary's preflight): they find out
whether the server honours ``cache_salt`` (if not, it says so: it can then only alert, and
``guard_bypass_supported`` is 0) and calibrate the tolerance of its local verdicts.

Exit codes: 0 stopped cleanly, 2 bad input or an unusable server.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from collections.abc import Callable
from typing import Any

from sidecar.canary.endpoint import CanaryError, is_loopback, parse_endpoint

DTYPES = ("float32", "float16", "bfloat16")
DAY_S = 86400.0


def _number(kind: type, low: float, high: float) -> Callable[[str], Any]:
    """A finite ``kind`` within ``low..high`` (NaN and inf refused, unlike a bare float)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low:g}..{high:g}, got {text}")
        return value

    return parse


def _limited(kind: type, key: str) -> Callable[[str], Any]:
    """:func:`_number` with the bounds of ``key`` in :data:`sidecar.config.LIMITS` (the one
    table the config file, the environment and ``config check`` read too)."""
    from sidecar.config.settings import LIMITS

    limit = LIMITS[key]
    assert limit.low is not None and limit.high is not None, key
    return _number(kind, limit.low, limit.high)


def _status_url(text: str) -> str:
    """``--sidecar-status``: an http(s) URL with a host (checked at start, not at each poll)."""
    import urllib.parse

    try:
        url = urllib.parse.urlsplit(text)
        url.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({exc})") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(
            f"not an http(s) URL with a host: {text!r} (e.g. http://127.0.0.1:9400/status)")
    return text


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def add_parser(sub: Any) -> None:
    g = sub.add_parser(
        "guard", help="cache-bypass guard: a proxy that salts requests while the cache lies",
        description="Forward OpenAI-compatible traffic to --upstream unchanged; while the "
                    "breaker is open (a local verdict, a kv-sidecar's /status, an "
                    "Alertmanager page, an operator), add a fresh cache_salt to every "
                    "request so the engine serves misses. Half-open, a few probes go with "
                    "the cache; M clean verdicts close it. See the runbook of "
                    "KVCacheContentAnomaly.")
    g.add_argument("--upstream", required=True, metavar="URL",
                   help="the server's root, e.g. http://127.0.0.1:8000")
    g.add_argument("--listen", type=_hostport, default="127.0.0.1:8100",
                   metavar="HOST:PORT", help="where clients connect (default 127.0.0.1:8100)")
    g.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback upstream (refused by default)")
    g.add_argument("--metrics-port", type=_number(int, 0, 65535), default=9401,
                   help="/metrics, /healthz, /status on --metrics-host (0: any free port; "
                        "default 9401)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address of /metrics (default 127.0.0.1; 0.0.0.0 in a pod that "
                        "Prometheus scrapes: a non-loopback address needs a token)")
    g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument("--instance", default="",
                   help="the `instance` label of the sidecar watching this server: its "
                        "per-replica pages (KVCacheContentAnomaly, "
                        "KVCacheHighHitRateWithAnomalies, KVCacheAnomalyLocalised) open "
                        "this guard")
    g.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="the server's KV dtype (the verdicts' tolerance floor)")
    g.add_argument("--block-size", type=_number(int, 1, 4096), default=16,
                   help="the server's KV block size in tokens")
    g.add_argument("--verify-every", type=_number(int, 0, 1_000_000), default=100,
                   help="replay 1 in N requests with and without the cache (0: no local "
                        "verdicts; half-open probes are always verified)")
    g.add_argument("--calibration", type=_number(int, 2, 1000), default=6,
                   help="clean paired probes at start (salt check and tolerance)")
    g.add_argument("--hold", type=_number(float, 0.001, DAY_S), default=60.0,
                   help="seconds open after the last anomaly before probing (half-open)")
    g.add_argument("--probes", type=_number(int, 1, 10_000), default=5,
                   help="clean probe verdicts in a row that close the breaker")
    g.add_argument("--probe-every", type=_number(int, 1, 10_000), default=4,
                   help="half-open: 1 request in N goes with the cache as a probe")
    g.add_argument("--probe-errors", type=_limited(int, "guard.probe_errors"), default=3,
                   help="half-open: this many probes without a verdict (an error answer, "
                        "one that cannot be replayed) open the breaker again")
    g.add_argument("--sidecar-status", default=None, metavar="URL", type=_status_url,
                   help="a kv-sidecar's /status to poll (its anomalies open the breaker)")
    g.add_argument("--poll-every", type=_number(float, 0.05, 3600), default=5.0,
                   help="seconds between reads of --sidecar-status")
    g.add_argument("--token-file", default=None, metavar="FILE",
                   help="bearer token for /guard/* (default: $KVSIDECAR_TOKEN; none: open, "
                        "loopback only)")
    g.add_argument("--max-connections", type=_number(int, 1, 100_000), default=256)
    g.add_argument("--workers", type=_number(int, 1, 1024), default=32,
                   help="forwarding threads (concurrent upstream requests)")
    g.add_argument("--request-deadline", type=_number(float, 0.01, 3600), default=30.0,
                   help="seconds for a whole request to arrive (408 after)")
    g.add_argument("--max-body-bytes", type=_number(int, 1, 1 << 30), default=8 << 20,
                   help="larger request bodies get a 413")
    g.add_argument("--upstream-timeout", type=_number(float, 0.01, DAY_S), default=120.0,
                   help="seconds the server may stay silent")
    g.add_argument("--response-deadline", type=_number(float, 0.01, DAY_S), default=600.0,
                   help="seconds for the server's whole answer")
    g.add_argument("--duration", type=_number(float, 0, DAY_S), default=0.0,
                   help="stop after this many seconds and print the status (0: run)")


def run_guard(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (CanaryError, ValueError) as exc:
        print(f"kv-sidecar guard: error: {exc}", file=sys.stderr, flush=True)
        return 2


def preflight(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The guard's start-up checks, before it binds or calls anything: the upstream (a
    non-loopback one needs --allow-remote) and the token (a non-loopback --listen or
    --metrics-host needs one). Returns the endpoint and the token; raises CanaryError or
    ValueError with a one-line reason. Deployment tests call it on a manifest's flags."""
    from sidecar.export.server import load_token

    if args.upstream.rstrip("/").lower().endswith("/v1"):
        raise ValueError(f"--upstream {args.upstream}: give the server's root (the guard "
                         "forwards every path as the client sent it), e.g. "
                         f"{args.upstream.rstrip('/')[:-3]}")
    endpoint = parse_endpoint(args.upstream.rstrip("/") + "/v1", args.allow_remote,
                              "the guard forwards users' traffic to it and replays probes")
    token = load_token(args.token_file)
    for flag, host in (("--listen", args.listen[0]), ("--metrics-host", args.metrics_host)):
        if token is None and not is_loopback(host):
            raise CanaryError(f"{flag} {host} is not a loopback address: set a token "
                              "(--token-file or KVSIDECAR_TOKEN) for /guard/* and /status")
    return endpoint, token


def _run(args: argparse.Namespace) -> int:
    from sidecar.canary.client import OpenAIClient
    from sidecar.canary.exporter import CanaryExporter
    from sidecar.canary.load import RateLimit
    from sidecar.canary.replay import ReplayVerifier
    from sidecar.canary.runner import CanaryConfig, make_canary
    from sidecar.export.metrics import Metrics
    from sidecar.export.server import SidecarServer
    from sidecar.protect.breaker import BreakerSettings
    from sidecar.protect.bypass_guard import ENGINE, BypassGuard, GuardConfig
    from sidecar.protect.forward import ForwardLimits

    endpoint, token = preflight(args)
    client = OpenAIClient(endpoint, args.model, 60.0)
    canary = make_canary(client, CanaryConfig(
        dtype=args.dtype, block_size=args.block_size, mode="auto", pairs=args.calibration,
        calibration=args.calibration, rate=RateLimit(1.0, 100.0, 100.0)))
    canary.run()  # its own signals (engine="canary"); the guard's verdicts get the guard's
    exporter = CanaryExporter(canary.model, Metrics(ENGINE, canary.model))
    supported = canary.mode == "salt"
    if not supported:
        print(f"kv-sidecar guard: {endpoint.root} ignores cache_salt: the guard cannot bypass "
              "its cache and will only alert (guard_bypass_supported 0)", file=sys.stderr,
              flush=True)

    def verifier(on_verdict: Any) -> ReplayVerifier:
        return ReplayVerifier(client, exporter, canary.tolerance,
                              on_verdict=on_verdict)

    cfg = GuardConfig(
        upstream=(endpoint.host, endpoint.port), listen=args.listen, model=canary.model,
        instance=args.instance, verify_every=args.verify_every, token=token,
        sidecar_status=args.sidecar_status, sidecar_token=token,
        poll_every_s=args.poll_every,
        limits=ForwardLimits(max_connections=args.max_connections, workers=args.workers,
                             request_deadline_s=args.request_deadline,
                             max_body_bytes=args.max_body_bytes,
                             buffer_budget_bytes=max(64 << 20, args.max_body_bytes),
                             upstream_timeout_s=args.upstream_timeout,
                             response_deadline_s=args.response_deadline),
        breaker=BreakerSettings(args.hold, args.probes, args.probe_every, args.probe_errors))
    guard = BypassGuard(cfg, verifier if supported else None, supported,
                        exporter.metrics).start()
    try:
        http = SidecarServer(guard.metrics.registry, guard.status, host=args.metrics_host,
                             port=args.metrics_port, token=token).start()
    except OSError as exc:  # the metrics port in use: one line, as for --listen
        guard.stop()
        print(f"kv-sidecar guard: error: cannot serve metrics on {args.metrics_host}:"
              f"{args.metrics_port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"kv-sidecar guard on {guard.url} -> {endpoint.root} (metrics on "
          f"{http.url}/metrics, tolerance {canary.tolerance.value:.3g})", file=sys.stderr,
          flush=True)
    done = threading.Event()
    try:
        done.wait(args.duration if args.duration > 0 else None)
    except KeyboardInterrupt:
        pass
    finally:
        status = guard.status()
        guard.stop()
        http.stop()
    print(json.dumps(status, indent=1, sort_keys=True), flush=True)
    return 0
