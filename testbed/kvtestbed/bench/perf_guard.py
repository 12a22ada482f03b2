"""``kv-sidecar bench perf --guard``: what the cache-bypass guard costs when closed.

Requests go to the same upstream directly and through a closed guard, interleaved in
alternating rounds (so drift on a shared machine hits both alike), at a fixed concurrency;
the figures are throughput (requests/s; the ratio is the median of per-pair ratios) and
latency P50/P99, guard over direct. The target is throughput >= 0.98 of direct.

The guard runs in its own process, as in production (a proxy sharing the load generator's
interpreter would measure the GIL, not the guard). The upstream is either a real server
(``--guard-upstream http://127.0.0.1:8000``, e.g. vLLM) or, by default, a stand-in in a
third process that answers ``/v1/completions`` after a fixed service time (what an engine
costs per request; without one, the figure would be the proxy's cost relative to nothing).

On a shared machine the wall-clock figures move with the load of other processes; the CPU
seconds the guard (and the stand-in) used per request, read from /proc, do much less: they
are reported beside them (``cpu_ms_per_request``), and are what to compare across changes.
"""

from __future__ import annotations

import functools
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtestbed.bench.proc_cost import process_cpu_s, run_clients

TARGET_THROUGHPUT = 0.98
STAND_IN_SERVICE_S = 0.02

_STAND_IN = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
SERVICE = float(sys.argv[1])
ANSWER = json.dumps({"id": "cmpl", "object": "text_completion", "choices": [
    {"index": 0, "text": " w1 w2 w3 w4 w5 w6 w7 w8", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 120, "completion_tokens": 8, "total_tokens": 128}}).encode()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # no 40 ms delayed-ACK stall between head and body
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(SERVICE)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)
    def log_message(self, *a):
        pass
class S(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # read by listen() in the constructor
s = S(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""

_GUARD = """
import sys, threading
from sidecar.protect.bypass_guard import BypassGuard, GuardConfig
g = BypassGuard(GuardConfig(upstream=("127.0.0.1", int(sys.argv[1])), model="bench",
                            verify_every=0)).start()
print(g.server.address[1], flush=True)
threading.Event().wait()
"""


@contextmanager
def _process(code: str, *args: str) -> Iterator[tuple[int, int]]:
    """Run ``code`` in a fresh interpreter; yields the port it prints first and its pid."""
    # `python -c` puts the working directory first on sys.path: run from the root of the
    # checkout this module came from, so the child imports the same sidecar as the parent.
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            text=True, cwd=root)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"bench helper did not start (exit {proc.poll()})")
        yield int(line), proc.pid
    finally:
        proc.kill()
        proc.wait()


def _body(i: int, model: str | None) -> bytes:
    prompt = [3 + (i * 7 + j) % 400 for j in range(120)]
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    if model:
        body["model"] = model
    return json.dumps(body).encode()


def _load(port: int, concurrency: int, per_client: int,
          model: str | None = None) -> tuple[float, list[float]]:
    """``concurrency`` clients, ``per_client`` requests each: (requests/s, latencies)."""
    latencies: list[float] = []
    lock = threading.Lock()
    errors: list[str] = []

    def client(c: int) -> None:
        mine = []
        for i in range(per_client):
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            try:
                conn.request("POST", "/v1/completions", _body(c * per_client + i, model),
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    errors.append(f"HTTP {r.status}")
            except OSError as exc:
                errors.append(str(exc))
            finally:
                conn.close()
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    wall = run_clients([functools.partial(client, c) for c in range(concurrency)])
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, e.g. {errors[0]}")
    return len(latencies) / wall, latencies


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(upstream_port: int, guard_port: int, concurrency: int, per_client: int,
            rounds: int, model: str | None = None, guard_pid: int | None = None,
            upstream_pid: int | None = None) -> dict[str, Any]:
    """``rounds`` pairs of back-to-back loads (direct then guard, or the other way round):
    the throughput ratio is the median of the per-pair ratios, so the shared machine's
    drift between pairs cancels out."""
    out: dict[str, Any] = {"concurrency": concurrency, "requests_per_round":
                           concurrency * per_client, "rounds": rounds}
    rates: dict[str, list[float]] = {"direct": [], "guard": []}
    lats: dict[str, list[float]] = {"direct": [], "guard": []}
    ratios: list[float] = []
    cpu = {(who, path): 0.0 for who in ("guard", "upstream") for path in ("direct", "guard")}
    _load(guard_port, concurrency, 2, model)  # warm both paths
    _load(upstream_port, concurrency, 2, model)
    for r in range(rounds):
        order = ("direct", "guard") if r % 2 == 0 else ("guard", "direct")
        pair = {}
        for path in order:
            before = process_cpu_s(guard_pid), process_cpu_s(upstream_pid)
            rate, lat = _load(upstream_port if path == "direct" else guard_port,
                              concurrency, per_client, model)
            cpu["guard", path] += process_cpu_s(guard_pid) - before[0]
            cpu["upstream", path] += process_cpu_s(upstream_pid) - before[1]
            pair[path] = rate
            rates[path].append(rate)
            lats[path].extend(lat)
        ratios.append(pair["guard"] / pair["direct"])
    for path in ("direct", "guard"):
        out[path] = {"throughput_rps": statistics.median(rates[path]),
                     "p50_ms": 1000 * _q(lats[path], 0.5), "p99_ms": 1000 * _q(lats[path], 0.99)}
    out["throughput_ratio"] = statistics.median(ratios)
    out["pair_ratios"] = [round(x, 4) for x in ratios]
    n = rounds * concurrency * per_client
    out["cpu_ms_per_request"] = {f"{who}_via_{path}": round(1000 * v / n, 4)
                                 for (who, path), v in cpu.items()
                                 if (who, path) != ("guard", "direct")}
    return out


def guard_rows(quick: bool, repeats: int, raw: dict[str, Any],
               upstream: str | None = None) -> list[Any]:
    from kvtestbed.bench.perf_row import Row
    from sidecar.canary.endpoint import parse_endpoint

    concurrency, per_client = (4, 5) if quick else (8, 40)
    rounds = 2 if quick else max(10, 2 * repeats)
    with _standin_or(upstream) as (up_port, up_pid), \
            _process(_GUARD, str(up_port)) as (guard_port, guard_pid):
        m = measure(up_port, guard_port, concurrency, per_client, rounds,
                    guard_pid=guard_pid, upstream_pid=up_pid)
    m["upstream"] = upstream or f"stand-in ({STAND_IN_SERVICE_S * 1000:g} ms per request)"
    if upstream:
        parse_endpoint(upstream.rstrip("/") + "/v1")  # loopback only, checked
    raw["guard"] = m
    d, g = m["direct"], m["guard"]
    lo, hi = min(m["pair_ratios"]), max(m["pair_ratios"])
    rows = [
        Row(f"guard closed: throughput at concurrency {concurrency}", g["throughput_rps"],
            d["throughput_rps"], "req/s", m["throughput_ratio"],
            f">= {TARGET_THROUGHPUT:g} x direct", m["throughput_ratio"] >= TARGET_THROUGHPUT,
            f"{lo:.3g}..{hi:.3g}"),
        Row("guard closed: latency P50", g["p50_ms"], d["p50_ms"], "ms",
            g["p50_ms"] / d["p50_ms"], "-", None),
        Row("guard closed: latency P99", g["p99_ms"], d["p99_ms"], "ms",
            g["p99_ms"] / d["p99_ms"], "-", None),
    ]
    cpu = m["cpu_ms_per_request"]
    served = cpu["guard_via_guard"] + cpu["upstream_via_guard"]
    # Both sides measured (CPU time moves in clock ticks: a short run may see none on one
    # side, and a ratio against an unmeasured side says nothing).
    if cpu["upstream_via_direct"] > 0 and served > 0:
        rows.append(Row("guard closed: server CPU per request (guard + upstream)", served,
                        cpu["upstream_via_direct"], "ms", served / cpu["upstream_via_direct"],
                        "-", None, f"guard {cpu['guard_via_guard']:.3g} ms"))
    return rows


@contextmanager
def _standin_or(upstream: str | None) -> Iterator[tuple[int, int | None]]:
    if upstream:
        from sidecar.canary.endpoint import parse_endpoint

        yield parse_endpoint(upstream.rstrip("/") + "/v1").port, None
        return
    with _process(_STAND_IN, str(STAND_IN_SERVICE_S)) as (port, pid):
        yield port, pid
