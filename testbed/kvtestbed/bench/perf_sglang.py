"""``kv-sidecar bench perf --engine sglang``: what the kv-sidecar radix-cache backend (the tap)
costs a real SGLang server (0.5.23 on CPU, the tiny random Llama), as tokens/s and request
P50/P99 with the tap on against off, in interleaved pairs, next to SGLang's own
``--kv-canary`` on the same workload.

Configurations (:mod:`kvtestbed.bench.perf_sglang_server`): **off** (SGLang as it ships), **tap
1 in N** for each N (``--radix-cache-backend kv-sidecar`` and ``kv-sidecar sglang serve``
beside it; ``--sglang-reference none`` by default, i.e. no recompute in the sidecar, which on
this 2-core box would take CPU from the engine, not cost it inside), and **--kv-canary**
(``log``, real data ``all``) where it starts: SGLang 0.5.23's canary does not start on CPU (its
copy stream is made with ``torch.cpu.Stream(device=...)``, which torch 2.13 refuses; with that
worked around, its phase checker is a Triton kernel and Triton has no CPU driver), so on CPU
the bench reports why it did not run and measures the rest. One server per configuration for
the whole run, all started at once and warmed up alike; rounds rotate the order and draw fresh
shared prefixes (:func:`kvtestbed.bench.perf_servers.interleaved_rounds`). Each ratio is
configuration / off of the same round (one pair); the table shows the median over pairs and
min..max. Throughput is SGLang's own token counts (prompt + completion) per second of wall
time; CPU seconds per run from /proc, per process group.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from kvtestbed.bench.perf_row import Row, format_table

TARGETS = {1000: 0.98}  # issue 24: throughput by wall, tap on / off
CANARY = "--kv-canary"
CONTROL = "off again"  # --sglang-control: a second off server, the A/A resolution


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sglang-python", default=None, metavar="PATH",
                   help="with --engine sglang: the interpreter that has SGLang (default: "
                        "this one if it imports sglang, else .venv-sglang/bin/python)")
    p.add_argument("--sglang-shims", default=None, metavar="DIR",
                   help="with --engine sglang: modules SGLang imports that this CPU cannot "
                        "have (default: the checkout's tests/sglang/shims)")
    p.add_argument("--sglang-sample-every", type=int, nargs="+", default=None, metavar="N",
                   help="with --engine sglang: the tap's 1-in-N settings to compare with off "
                        "(default: 1000 100; --quick: 100)")
    p.add_argument("--sglang-requests", type=int, default=None, metavar="N",
                   help="with --engine sglang: requests per timed run (default: 1200, "
                        "about 10 s a run; --quick: 60)")
    p.add_argument("--sglang-concurrency", type=int, default=8, metavar="N",
                   help="with --engine sglang: concurrent clients (default: 8)")
    p.add_argument("--sglang-reference", default="none", choices=("none", "hf"),
                   help="with --engine sglang: the sidecar's recompute reference (default: "
                        "none; hf: recompute sampled hits in the sidecar's process)")
    p.add_argument("--sglang-control", action="store_true",
                   help="with --engine sglang: also run a second off server (an A/A control: "
                        "how far two identical servers differ on this host, the resolution "
                        "of every ratio)")
    p.add_argument("--sglang-no-canary", action="store_true",
                   help="with --engine sglang: leave out the --kv-canary configuration")


def config_name(n: int) -> str:
    return f"tap N={n}"


def rows(res: dict[str, Any], names: list[str]) -> list[Row]:
    from kvtestbed.bench.perf_pair_rows import pair_rows

    out: list[Row] = []
    for name in sorted(names, key=lambda x: x != CONTROL):  # the control's rows first
        n = int(name.split("=")[1]) if name.startswith("tap") else None
        what = f"tap 1 in {n}" if n else ("off again (A/A control, no sidecar)"
                                          if name == CONTROL else
                                          "--kv-canary (log, real data all)")
        out += pair_rows(res, name, res["ratios"][name], f"SGLang {what}", "sglang", "SGLang",
                         TARGETS.get(n) if n else None, sidecar=n is not None)
        if n:
            out += _tap_time_row(res, name, what)
    return out


def _tap_time_row(res: dict[str, Any], name: str, what: str) -> list[Row]:
    """The tap's own time in SGLang's process over the timed rounds, as the tap measures it
    (``kvsidecar_sglang_tap_seconds_total``: wall time inside its hooks on the scheduler
    thread, an upper bound of their CPU, plus its shipper thread's CPU), per request,
    against SGLang's whole CPU per request when off: a figure the machine's noise does not
    blur the way it blurs a throughput ratio of two runs."""
    import statistics

    st = (res.get("sidecar_status") or {}).get(name) or {}
    before, after = st.get("after_warmup") or {}, st.get("end") or {}
    if "tap_seconds" not in before or "tap_seconds" not in after:
        return []
    requests = sum(rd["runs"][name]["requests"] for rd in res["rounds"])
    tap = (after["tap_seconds"] - before["tap_seconds"]) / max(requests, 1)
    off = statistics.median(rd["runs"]["off"]["cpu_s"]["sglang"] / rd["runs"]["off"]["requests"]
                            for rd in res["rounds"])
    return [Row(f"SGLang {what}: the tap's own time in SGLang's process per request, vs "
                "SGLang's CPU per request (off)", tap * 1e6, off * 1e6, "us",
                tap / off if off > 0 else float("nan"), "-", None, "")]


def run(args: argparse.Namespace) -> int:
    """``bench perf --engine sglang``: exit 2 (one line) without SGLang, 1 if a server fails."""
    import json
    import tempfile
    from dataclasses import asdict
    from pathlib import Path

    from kvtestbed.bench import perf_servers as P
    from kvtestbed.bench import perf_sglang_server as S
    from kvtestbed.bench.perf_drive import sglang_api

    def fail(msg: str, code: int) -> int:
        print(f"kv-sidecar bench perf --engine sglang: {msg}", file=sys.stderr)
        return code

    ns = list(args.sglang_sample_every or ([100] if args.quick else [1000, 100]))
    pairs = 2 if args.quick else args.repeats
    requests = args.sglang_requests if args.sglang_requests is not None else (
        60 if args.quick else 1200)
    bad = [f"{flag} must be {lo}..{hi:,}, got {v}" for flag, v, lo, hi in (
        *(("--sglang-sample-every", n, 1, 10**11) for n in ns),  # the sidecar's own bound
        ("--sglang-requests", requests, 1, 1_000_000),
        ("--sglang-concurrency", args.sglang_concurrency, 1, 1024)) if not lo <= v <= hi]
    if bad:  # before looking for SGLang or starting anything
        return fail(bad[0], 2)
    try:
        py = S.find_sglang_python(args.sglang_python)
    except (P.EngineMissing, OSError) as e:
        return fail(str(e), 2)
    shims = Path(args.sglang_shims) if args.sglang_shims else S.default_shims()
    if shims is not None and not shims.is_dir():
        return fail(f"--sglang-shims {shims}: not a directory", 2)
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    configs = [("off", "off", None)] + [(config_name(n), "tap", n) for n in ns]
    if not args.sglang_no_canary:
        configs.append((CANARY, "canary", None))
    if args.sglang_control:
        configs.append((CONTROL, "off", None))
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvs-perf-model-") as d:
        model = str(write_tiny_llama(f"{d}/model"))
        servers = {}
        canary_failed: str | None = None
        t_start = time.monotonic()
        try:
            for name, mode, n in configs:
                tag = name.strip("-").replace(" ", "").replace("=", "")
                servers[name] = S.start(py, model, tag, mode, n, shims, args.sglang_reference)
            if CANARY in servers:  # may not start (on CPU it cannot): measure the rest
                canary_failed = S.failed_to_start(servers[CANARY])
                if canary_failed is not None:
                    P.stop([servers.pop(CANARY)])
                    configs = [c for c in configs if c[0] != CANARY]
                    print(f"kv-sidecar bench perf --engine sglang: {CANARY} did not start, "
                          f"measured without it: {canary_failed}", file=sys.stderr)
            res = P.interleaved_rounds("sglang", servers, sglang_api(), pairs, requests,
                                       args.sglang_concurrency, max_tokens=8,
                                       ready_timeout_s=900.0, started=t_start)
        except RuntimeError as e:
            P.stop(list(servers.values()))
            return fail(str(e), 1)
    table = rows(res, [c[0] for c in configs[1:]])
    settings = {"engine": "sglang", "quick": args.quick, "pairs": pairs, "sample_every": ns,
                "requests_per_run": requests, "concurrency": args.sglang_concurrency,
                "reference": args.sglang_reference, "canary": not args.sglang_no_canary,
                "control": args.sglang_control,
                "canary_failed": canary_failed,
                "model": "tiny random Llama (tests/sglang)", "dtype": S.DTYPE,
                "tap_block": S.TAP_BLOCK, "sglang_python": py,
                "shims": str(shims) if shims else None,
                "python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_average_start": round(load_start, 2),
                "load_average_end": round(os.getloadavg()[0], 2),
                "seconds": round(time.monotonic() - started, 1)}
    if args.json:
        from sidecar.export.server import finite  # NaN/inf as null: JSON has none

        print(json.dumps(finite({"rows": [asdict(r) for r in table], "raw": {"sglang": res},
                                 "settings": settings}), indent=2, default=str,
                         allow_nan=False))
    else:
        print(format_table(table))
        print(f"\n{settings['seconds']}s; medians of {pairs} interleaved pair(s) of "
              f"{requests} requests; spread = min..max over pairs; load average "
              f"{settings['load_average_start']} at start")
        if canary_failed:
            print(f"{CANARY} not measured: it did not start ({canary_failed})")
    return 0
