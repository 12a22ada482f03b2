"""The clients of the real-engine benches (``bench perf --engine vllm|sglang``): send a run's
prompts over keep-alive connections and time them.

A connection the server closed while it sat idle (uvicorn drops keep-alive connections
after 5 s; a loaded 2-core host stalls a client that long) fails the next request before
any answer: ``BrokenPipeError``, a reset, or ``RemoteDisconnected``. Such a request is sent
once more on a new connection, and counted (``reconnects``); any other failure, or the same
one twice, ends the run with a one-line error naming the configuration and phase.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import TYPE_CHECKING, Any

from kvtestbed.bench.proc_cost import run_clients

if TYPE_CHECKING:
    from kvtestbed.bench.perf_servers import Api

# Failures of a request on a connection the server had already closed (nothing answered).
CLOSED = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


def drive(url: str, api: Api, prompts: list[list[int]], concurrency: int,
          max_tokens: int, label: str = "") -> dict[str, Any]:
    """Send ``prompts`` (in order, ``concurrency`` keep-alive clients) and time them: wall
    seconds from the first send to the last answer, per-request latency, the engine's usage.
    ``label`` (e.g. "off, round 3") leads the error of a failed run."""
    host, port = url.removeprefix("http://").split(":")
    lock = threading.Lock()
    queue = list(enumerate(prompts))[::-1]
    latencies: list[float] = [0.0] * len(prompts)
    tokens = {"prompt": 0, "completion": 0}
    errors: list[str] = []
    reconnects = [0]

    def send(conn: http.client.HTTPConnection, body: str) -> bytes:
        conn.request("POST", api.path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}: {data[:200]!r}")
        return data

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        while True:
            with lock:
                if not queue or errors:
                    break
                i, prompt = queue.pop()
            body = json.dumps(api.body(prompt, max_tokens))
            t0 = time.perf_counter()
            try:
                try:
                    data = send(conn, body)
                except CLOSED:
                    conn.close()
                    conn = http.client.HTTPConnection(host, int(port), timeout=120)
                    with lock:
                        reconnects[0] += 1
                    data = send(conn, body)
            except (OSError, http.client.HTTPException) as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}" if not str(e) else str(e))
                break
            latencies[i] = time.perf_counter() - t0
            used = api.usage(json.loads(data))
            with lock:
                tokens["prompt"] += used[0]
                tokens["completion"] += used[1]
        conn.close()

    wall = run_clients([client] * concurrency)
    if errors:
        raise RuntimeError(f"{label + ': ' if label else ''}{url}: {errors[0]}")
    lat = sorted(latencies)
    total = tokens["prompt"] + tokens["completion"]
    return {"requests": len(prompts), "wall_s": wall, "prompt_tokens": tokens["prompt"],
            "completion_tokens": tokens["completion"], "tokens_per_s": total / wall,
            "completion_tokens_per_s": tokens["completion"] / wall,
            "requests_per_s": len(prompts) / wall, "p50_s": _quantile(lat, 0.5),
            "p99_s": _quantile(lat, 0.99), "reconnects": reconnects[0]}


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]
