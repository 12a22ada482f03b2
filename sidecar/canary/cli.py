"""``kv-sidecar canary``: paired probes against an OpenAI-compatible server, and
``kv-sidecar canary --replay-port P``: the replay proxy as well.

Exit codes: 0 when the run is quiet, 1 when it found anomalies or hit-audit mismatches
(``--pairs`` runs only; a long-running canary reports through /metrics), 2 for bad input
or an unusable server (bad endpoint, refused connection, no logprobs, or a ``--pairs`` run
in which a probe failed: a malformed, oversized or late answer; the reason is printed).
A long-running canary (``--pairs 0``) counts each failed probe in
``kvsidecar_canary_errors_total{reason}`` and keeps going.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sidecar.canary.endpoint import CanaryError, parse_endpoint
from sidecar.canary.probes import MODES

if TYPE_CHECKING:  # the runner pulls in the exporter's dependencies: only when run
    from sidecar.canary.runner import CanaryConfig, Report

log = logging.getLogger(__name__)
DTYPES = ("float32", "float16", "bfloat16")


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "canary", help="black-box canary: cached vs uncached answers of an OpenAI server",
        description="Send paired probes (a fresh prompt twice: miss then hit, or against a "
                    "cache_salt request) at temperature 0 with logprobs, compare the top-k "
                    "logprobs with a calibrated tolerance, audit the server's reported "
                    "cached tokens, and export the sidecar's signals with engine=canary.")
    c.add_argument("--endpoint", required=True, metavar="URL",
                   help="the server's API root, e.g. http://127.0.0.1:8000/v1")
    c.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback endpoint (refused by default)")
    c.add_argument("--model", default=None, help="model name (default: the server's first)")
    c.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="the server's KV dtype: picks the tolerance's hard floor")
    c.add_argument("--block-size", type=_positive, default=16,
                   help="the server's KV block size in tokens (vLLM default 16)")
    c.add_argument("--mode", default="auto", choices=MODES,
                   help="pair: prompt twice; salt: against a cache_salt request; auto: salt "
                        "where the server honours it")
    c.add_argument("--pairs", type=_nonneg, default=0,
                   help="paired probes to run, then exit (0: run until stopped)")
    c.add_argument("--max-tokens", type=_positive, default=4, help="tokens per answer")
    c.add_argument("--logprobs", type=_positive, default=5, help="top-k logprobs compared")
    c.add_argument("--token-range", type=token_range, default="3:500", metavar="LO:HI",
                   help="token ids random prompts are drawn from, 0 <= LO < HI "
                        "(default 3:500)")
    c.add_argument("--calibration", type=_positive, default=8,
                   help="clean pairs that set the noise floor")
    c.add_argument("--fraction", type=float, default=0.01,
                   help="canary requests as a fraction of the server's request rate")
    c.add_argument("--min-rate", type=float, default=0.05, help="requests/s always allowed")
    c.add_argument("--max-rate", type=float, default=2.0,
                   help="requests/s never exceeded (used when the server has no /metrics)")
    c.add_argument("--timeout", type=float, default=30.0,
                   help="seconds per request, for the whole exchange (not per read)")
    c.add_argument("--seed", type=int, default=None,
                   help="seed the probe prompts (default: fresh ones every run; a fixed seed "
                        "resends prompts the server may have cached since)")
    c.add_argument("--port", type=_port, default=None,
                   help="serve the canary's /metrics on this 127.0.0.1 port (0: any)")
    c.add_argument("--host", default="127.0.0.1",
                   help="address the /metrics server binds (default 127.0.0.1; 0.0.0.0 in a "
                        "pod, so Prometheus can scrape it: deploy/kubernetes)")
    c.add_argument("--replay-port", type=_port, default=None,
                   help="also run the replay proxy on this 127.0.0.1 port (0: any)")
    c.add_argument("--replay-every", type=_positive, default=100,
                   help="the proxy replays 1 in N completions requests")
    c.add_argument("--json", action="store_true", help="print the report as JSON")


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {v}")
    return v


def _nonneg(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def parse_token_range(text: str) -> tuple[int, int]:
    """``LO:HI`` with ``0 <= LO < HI``; else ``argparse.ArgumentTypeError``."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        lo, hi = -1, -1
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"must be LO:HI with 0 <= LO < HI, got "
                                         f"{text[:40]!r}{'...' if len(text) > 40 else ''}")
    return lo, hi


def token_range(text: str) -> str:
    """``--token-range``'s type: the text, once :func:`parse_token_range` accepts it. As the
    flag's type it is also what ``config check``, ``KVSIDECAR_CANARY_TOKEN_RANGE`` and
    ``--set canary.token_range`` are checked by (sidecar/config/key_table.py FlagKey)."""
    parse_token_range(text)
    return text


def settings_problem(values: Mapping[str, Any]) -> str | None:
    """What the canary refuses across its settings (flag dests -> values) that no one flag's
    type or limit can see; ``None``: fine. The one rule: ``config check`` and ``configure``
    apply it to the ``[canary]`` section (sidecar/config/schema.py ``Command.check``), and
    :func:`config_from_args` to its flags."""
    low, high = values["min_rate"], values["max_rate"]
    if low > high:
        return f"min_rate must not exceed max_rate, got {low:g} > {high:g}"
    return None


def config_from_args(args: argparse.Namespace) -> CanaryConfig:
    """The run's settings; each flag was checked by its type and by the one table of limits
    (``canary.*`` in sidecar/config/settings.py LIMITS: rates and fraction > 0) when
    ``configure`` filled ``args``."""
    from sidecar.canary.load import RateLimit
    from sidecar.canary.runner import CanaryConfig

    try:
        lo, hi = parse_token_range(args.token_range)
    except argparse.ArgumentTypeError as exc:
        raise CanaryError(f"--token-range: {exc}") from None
    problem = settings_problem(vars(args))
    if problem:
        raise CanaryError(problem)
    return CanaryConfig(
        dtype=args.dtype, block_size=args.block_size, mode=args.mode, pairs=args.pairs,
        max_tokens=args.max_tokens, logprobs=args.logprobs, token_low=lo, token_high=hi,
        seed=args.seed, calibration=args.calibration,
        rate=RateLimit(args.fraction, args.min_rate, args.max_rate))


def format_report(r: Report) -> str:
    rows = [("mode", r.mode), ("model", r.model), ("dtype", r.dtype), ("pairs", r.pairs),
            ("requests", r.requests), ("anomalies", r.anomalies),
            ("max divergence", f"{r.max_divergence:.3g}"),
            ("tolerance", f"{r.tolerance:.3g} (noise floor {r.noise_floor:.3g}"
                          f"{'' if r.calibrated else ', not calibrated'})"),
            ("hit audit", ", ".join(f"{k}={v}" for k, v in sorted(r.audit.items())) or "ok"),
            ("errors", ", ".join(f"{k}={v}" for k, v in sorted(r.errors.items())) or "none"),
            ("allowed rate", f"{r.allowed_rate:.3g} req/s")]
    if r.replay:
        rows.append(("replay", ", ".join(f"{k}={v:g}" for k, v in sorted(r.replay.items()))))
    return "\n".join(f"{k:<16}{v}" for k, v in rows)


def run_canary(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except CanaryError as exc:
        print(f"kv-sidecar canary: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace) -> int:
    from sidecar.canary.client import OpenAIClient
    from sidecar.canary.runner import make_canary
    from sidecar.signals import AUDIT_ALARM_KINDS

    endpoint = parse_endpoint(args.endpoint, args.allow_remote)
    cfg = config_from_args(args)
    token = None
    if args.port is not None:  # its /status is the control surface the token guards
        from sidecar.export.server import load_token

        try:
            token = load_token()  # an empty one is an error, never "auth off"
        except ValueError as exc:
            raise CanaryError(str(exc)) from None
    client = OpenAIClient(endpoint, args.model, args.timeout)
    canary = make_canary(client, cfg)
    servers: list[Any] = []
    proxy: Any = None
    stop = threading.Event()
    try:
        if args.port is not None:
            from sidecar.export.server import SidecarServer

            srv = SidecarServer(canary.exporter.metrics.registry,
                                lambda: canary.report.as_dict(), host=args.host,
                                port=args.port, token=token).start()
            servers.append(srv)
            print(f"canary /metrics on {srv.url}/metrics", file=sys.stderr, flush=True)
        if args.replay_port is not None:
            from sidecar.canary.replay import ReplayProxy

            if canary.mode != "salt":
                raise CanaryError("the replay proxy bypasses the cache with cache_salt, and "
                                  "this server does not honour it (see --mode)")

            proxy = ReplayProxy(client, canary.exporter, canary.tolerance, args.replay_every,
                                port=args.replay_port).start()
            servers.append(proxy)
            print(f"replay proxy on {proxy.url} -> {endpoint.root}", file=sys.stderr,
                  flush=True)
        try:
            report = canary.run(stop)
        except KeyboardInterrupt:
            stop.set()
            report = canary.report
    finally:
        for s in servers:
            s.stop()
    if proxy is not None:
        report.replay = dict(proxy.stats)
    print(json.dumps(report.as_dict(), indent=1, sort_keys=True) if args.json
          else format_report(report), flush=True)
    alarms = (report.anomalies + int(report.replay.get("anomalies", 0))
              + sum(report.audit.get(k.value, 0) for k in AUDIT_ALARM_KINDS))
    if cfg.pairs and not report.divergences:  # every pair failed: nothing was checked
        print("kv-sidecar canary: error: no paired probe completed (errors: "
              f"{report.errors}; last: {report.last_error})", file=sys.stderr, flush=True)
        return 2
    if cfg.pairs and alarms:
        return 1
    if cfg.pairs and report.errors:  # a one-shot run that could not check every pair
        failed = sum(report.errors.values())
        print(f"kv-sidecar canary: error: {failed} of {report.pairs} paired probes failed "
              f"({report.errors}); last: {report.last_error}", file=sys.stderr, flush=True)
        return 2
    return 0
