"""Helpers for the real-SGLang tests: a server with the fault-hooked kv-sidecar backend, the
sidecar beside it, traffic with shared prefixes, and the fault channel.

Nothing here imports SGLang: the server is a subprocess (``python -m
sglang.launch_server``), the sidecar runs in the test process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[2]
SHIMS = Path(__file__).resolve().parent / "shims"
BLOCK = 16
MAX_TOTAL_TOKENS = 4096


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    faults: str
    dtype: str

    def generate(self, tokens: list[int], extra_key: str | None = None,
                 max_new_tokens: int = 1, timeout_s: float = 120.0) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": tokens, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0.0}}
        if extra_key is not None:
            body["extra_key"] = extra_key
        req = urllib.request.Request(f"{self.url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return dict(json.loads(resp.read()))

    def fault(self, op: str, timeout_s: float = 120.0, **args: Any) -> dict[str, Any]:
        """Queue a fault; it is applied at the tree's next match, which the tiny requests
        sent here trigger (until the fault hook has replied)."""
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.faults)
        try:
            sock.send(json.dumps({"op": op, **args}).encode())
            deadline = time.monotonic() + timeout_s
            while True:  # a match on the scheduler's thread applies it, once it has arrived
                try:
                    self.generate([5, 6])
                except OSError:  # a fault SGLang exits on (a premature free) can take the
                    if sock.poll(5000):  # request's connection down with it: applied
                        break
                    raise
                if sock.poll(200):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fault {op} not applied")
            reply = dict(json.loads(sock.recv()))
        finally:
            sock.close(0)
        if "error" in reply:
            raise RuntimeError(f"fault {op}: {reply['error']}")
        return reply

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, dtype: str, sockdir: Path, sample_every: int = 1,
                 ready_timeout_s: float = 900.0, max_total_tokens: int = MAX_TOTAL_TOKENS,
                 census_every_s: float = 0.0) -> Server:
    port = free_port()
    faults = f"ipc://{sockdir}/faults.sock"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIMS), str(ROOT), env.get("PYTHONPATH", "")])
    env["KVSIDECAR_SGLANG_TAP"] = json.dumps({
        "endpoint": f"ipc://{sockdir}/probe.sock", "block_size": BLOCK,
        "sample_every": sample_every, "blocks_per_sample": 8, "seed": 0,
        "census_every_s": census_every_s, "census_share": 0.0})
    env["KVSIDECAR_SGLANG_FAULTS"] = faults
    log = sockdir / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
           "--device", "cpu", "--attention-backend", "torch_native",
           "--mem-fraction-static", "0.3", "--max-total-tokens", str(max_total_tokens),
           "--dtype", dtype, "--page-size", "1", "--enable-metrics", "--skip-tokenizer-init",
           "--radix-cache-backend", "kv-sidecar-faults", "--random-seed", "0",
           "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=str(ROOT), start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log, faults, dtype)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"SGLang not ready:\n{log.read_text()[-4000:]}")


@dataclass
class Workload:
    """Prefixes of a few full blocks, each followed by fresh suffixes: every request after a
    prefix's first one hits it."""

    seed: int = 0
    lengths: tuple[int, ...] = (40, 70, 100, 130)
    prefixes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.prefixes = [self.tokens(n) for n in self.lengths]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 500) for _ in range(n)]

    def round(self, suffix: int = 9) -> list[list[int]]:
        return [p + self.tokens(suffix) for p in self.prefixes]
