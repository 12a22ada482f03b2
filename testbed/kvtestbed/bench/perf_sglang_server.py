"""Processes of ``kv-sidecar bench perf --engine sglang``: an SGLang server on 127.0.0.1 per
configuration, started as users start it on this CPU (``--device cpu --attention-backend
torch_native --page-size 1``, the tiny random Llama, ``--sleep-on-idle`` so a server that is
not being measured blocks on its sockets instead of spinning, and ``--skip-server-warmup``:
SGLang's own warm-up gives up on a 5 s read timeout and takes the server down when several
start at once on 2 loaded cores; the bench warms every server up alike itself):

* **off**: SGLang's own radix cache, as it ships;
* **tap 1 in N**: ``--radix-cache-backend kv-sidecar`` with the tap sampling 1 hit in N, and
  ``kv-sidecar sglang serve`` beside it (tap receiver, slot census, /metrics audit);
* **--kv-canary**: SGLang's own KV canary (``--kv-canary log --kv-canary-real-data all``:
  per-slot stamps plus a hash of the real KV), for comparison, without the tap.

SGLang runs in its own interpreter (``.venv-sglang``). On this CPU it imports two modules that
cannot exist here (a CUDA-linked ``torchvision``, vLLM's rotary op): the test shims for them
(``tests/sglang/shims``, each named in its docstring) go on its path when the checkout has
them, or ``--sglang-shims DIR``. Nothing here imports SGLang.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from kvtestbed.bench.perf_servers import (
    Server,
    find_engine_python,
    free_port,
    source_root,
    wait_ready,
)

TAP_BLOCK = 16  # the tap's block: 16 token slots (page size 1)
DTYPE = "float32"
CANARY_FLAGS = ("--kv-canary", "log", "--kv-canary-real-data", "all")


def find_sglang_python(explicit: str | None) -> str:
    """``--sglang-python``, this interpreter if it has SGLang, else ``.venv-sglang``."""
    return find_engine_python(explicit, "sglang", ".venv-sglang", "make test-sglang",
                              "SGLang")


def default_shims() -> Path | None:
    """The checkout's test shims for SGLang on CPU, or None outside a checkout."""
    shims = source_root() / "tests" / "sglang" / "shims"
    return shims if shims.is_dir() else None


def _env(shims: Path | None) -> dict[str, str]:
    root = source_root()
    path = [str(p) for p in (shims, root, root / "testbed") if p is not None]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TOKENIZERS_PARALLELISM": "false"}


def start(py: str, model: str, name: str, mode: str, sample_every: int | None,
          shims: Path | None, reference: str = "none", dtype: str = DTYPE) -> Server:
    """Start one configuration (not waiting: :func:`perf_servers.wait_ready`). ``mode``:
    ``off``, ``tap`` (1 in ``sample_every``) or ``canary``."""
    rundir = Path(tempfile.mkdtemp(prefix=f"kvs-perf-sgl-{name}-", dir="/tmp"))
    env = _env(shims)
    srv = Server(name, sample_every, f"http://127.0.0.1:{free_port()}", rundir)
    extra: list[str] = []
    if mode == "tap":
        probe = f"ipc://{rundir}/p.sock"
        sc_port = free_port()
        srv.sidecar_url = f"http://127.0.0.1:{sc_port}"
        srv.spawn("sidecar", [
            py, "-m", "sidecar.adapters.sglang.cli", "serve", "--probe", probe,
            "--model", model, "--dtype", dtype, "--block-size", str(TAP_BLOCK),
            "--metrics-url", f"{srv.url}/metrics", "--reference", reference,
            "--port", str(sc_port)], env)
        # what `kv-sidecar sglang engine-args --probe ... --sample-every N` prints
        env = {**env, "KVSIDECAR_SGLANG_TAP": json.dumps({
            "endpoint": probe, "block_size": TAP_BLOCK, "sample_every": sample_every or 1,
            "blocks_per_sample": 2, "seed": 0})}
        extra = ["--radix-cache-backend", "kv-sidecar"]
    elif mode == "canary":
        extra = list(CANARY_FLAGS)
    elif mode != "off":
        raise ValueError(f"unknown mode {mode!r}")
    srv.spawn("sglang", [
        py, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
        "--attention-backend", "torch_native", "--mem-fraction-static", "0.3",
        "--max-total-tokens", "4096", "--dtype", dtype, "--page-size", "1",
        "--enable-metrics", "--skip-tokenizer-init", "--random-seed", "0", "--sleep-on-idle",
        "--skip-server-warmup",
        "--host", "127.0.0.1", "--port", srv.url.rsplit(":", 1)[1], *extra], env)
    return srv


def failed_to_start(srv: Server, timeout_s: float = 900.0) -> str | None:
    """None once ``srv`` answers /health; else why it did not start: the last line of its
    log that names an error (the server's own words), or that it did not answer in time."""
    try:
        wait_ready([srv], timeout_s)
        return None
    except RuntimeError:
        time.sleep(1.0)  # let the log's last lines land
        lines = [ln.strip() for ln in (srv.rundir / "sglang.log").read_text(
            errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln and not ln.startswith("[")]
        return (errors[-1] if errors else lines[-1] if lines else "no output")[:300]
