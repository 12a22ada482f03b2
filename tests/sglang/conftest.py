"""Shared set-up for the tests against a real SGLang server (``pytest -m sglang``).

One server per dtype for the whole session (start-up is ~1.5-3 min on 2 loaded cores), the
sidecar beside it in this process; both are stopped at the end, and the socket directory
removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sglang.harness import BLOCK, Server, start_server

MEASUREMENTS: dict[str, Any] = {}


@dataclass
class Stack:
    server: Server
    sidecar: Any
    dtype: str


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


DTYPES = os.environ.get("KVSIDECAR_SGLANG_DTYPES", "float32,bfloat16").split(",")


@pytest.fixture(scope="module", params=DTYPES)
def stack(request: pytest.FixtureRequest, tiny_model: str) -> Iterator[Stack]:
    from sidecar.adapters.sglang.service import SglangSidecar, SglangSidecarConfig
    from sidecar.core.monitor import SidecarConfig

    dtype = request.param
    sockdir = Path(tempfile.mkdtemp(prefix="kvs-sgl-", dir="/tmp"))
    sc = SglangSidecar(SglangSidecarConfig(
        tiny_model, dtype, BLOCK, f"ipc://{sockdir}/probe.sock", deferred=True,
        sidecar=SidecarConfig(sample_every=1, blocks_per_sample=8, adapter_timeout_s=60.0,
                              recompute_tokens_per_s=0, queue_size=512))).start()
    server = None
    try:
        server = start_server(tiny_model, dtype, sockdir)
        if sc.adapter.bridge is None:
            from sidecar.adapters.sglang.metrics_bridge import SglangMetricsBridge

            sc.adapter.bridge = SglangMetricsBridge(sc.metrics, f"{server.url}/metrics",
                                                    lambda: sc.counted_hit_tokens)
        yield Stack(server, sc, dtype)
    finally:
        if server is not None:
            server.stop()
        sc.stop()
        shutil.rmtree(sockdir, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MEASUREMENTS:
        return
    terminalreporter.section("kv-sidecar SGLang measurements")
    for key in sorted(MEASUREMENTS):
        terminalreporter.write_line(f"{key}: {MEASUREMENTS[key]}")
