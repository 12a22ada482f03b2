"""The clients of the real-engine benches (``bench perf --engine vllm|sglang``): how each
engine's server takes a prompt (:class:`Api`), and sending a run's prompts over keep-alive
connections, timed (:func:`drive`).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtestbed.bench.proc_cost import run_clients


@dataclass(frozen=True)
class Api:
    """How one engine's server takes a prompt of token ids and says what it used: the path,
    the JSON body, and (prompt, completion) token counts from the answer."""

    path: str
    body: Callable[[list[int], int], dict[str, Any]]
    usage: Callable[[dict[str, Any]], tuple[int, int]]


def openai_api(model: str) -> Api:
    """``/v1/completions`` (vLLM): exactly ``max_tokens`` tokens, greedy; usage from the
    answer's ``usage``."""
    def usage(answer: dict[str, Any]) -> tuple[int, int]:
        u = answer.get("usage") or {}
        return int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))

    return Api("/v1/completions", lambda prompt, n: {
        "model": model, "prompt": prompt, "max_tokens": n, "min_tokens": n,
        "temperature": 0.0}, usage)


def sglang_api() -> Api:
    """SGLang's native ``/generate`` with ``input_ids`` (its server runs without a tokenizer
    here, which refuses ``min_new_tokens``): exactly ``max_new_tokens`` by ``ignore_eos``,
    greedy; usage from ``meta_info``."""
    def usage(answer: dict[str, Any]) -> tuple[int, int]:
        m = answer.get("meta_info") or {}
        return int(m.get("prompt_tokens", 0)), int(m.get("completion_tokens", 0))

    return Api("/generate", lambda prompt, n: {
        "input_ids": prompt, "sampling_params": {
            "max_new_tokens": n, "ignore_eos": True, "temperature": 0.0}}, usage)


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
