"""Shared set-up for the tests against a real SGLang server (``pytest -m sglang``).

One server per dtype and test module (start-up is ~0.5-3 min on 2 loaded cores), the
sidecar beside it in this process; both are stopped at the end, and the socket directory
removed. ``stack``: the tiny Llama (full attention); ``swa_stack``: the tiny Mellum (hybrid
SWA: sliding-window and full layers in two pools).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sglang.harness import BLOCK, MAX_TOTAL_TOKENS, Server, Workload, start_server

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


@pytest.fixture(scope="session")
def tiny_mellum(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A hybrid SWA checkpoint (sliding and full layers): SGLang serves it from two pools."""
    from kvtestbed.tiny_models.tiny_hybrid import write_tiny_mellum

    return str(write_tiny_mellum(tmp_path_factory.mktemp("tiny") / "mellum"))


@contextmanager
def serving(model: str, dtype: str, max_total_tokens: int = MAX_TOTAL_TOKENS) -> Iterator[Stack]:
    """A real SGLang server on ``model`` with the fault-hooked backend, the sidecar beside
    it (deferred verification, every hit sampled, HF reference), both stopped after."""
    from sidecar.adapters.sglang.service import SglangSidecar, SglangSidecarConfig
    from sidecar.core.monitor import SidecarConfig

    sockdir = Path(tempfile.mkdtemp(prefix="kvs-sgl-", dir="/tmp"))
    sc = SglangSidecar(SglangSidecarConfig(
        model, dtype, BLOCK, f"ipc://{sockdir}/probe.sock", deferred=True,
        sidecar=SidecarConfig(sample_every=1, blocks_per_sample=8, adapter_timeout_s=60.0,
                              recompute_tokens_per_s=0, queue_size=512))).start()
    server = None
    try:
        server = start_server(model, dtype, sockdir, max_total_tokens=max_total_tokens)
        if sc.adapter.bridge is None:
            from sidecar.adapters.sglang.metrics_bridge import SglangMetricsBridge

            sc.adapter.bridge = SglangMetricsBridge(sc.metrics, f"{server.url}/metrics",
                                                    lambda: sc.counted_hit_tokens)
        yield Stack(server, sc, dtype)
    finally:
        if server is not None:
            if server.proc.poll() is not None:  # it died under a test: say why, in the log
                sys.stderr.write(f"SGLang exited ({server.proc.returncode}); its log ends:\n"
                                 f"{server.log.read_text(errors='replace')[-6000:]}\n")
            server.stop()
        sc.stop()
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module", params=DTYPES)
def stack(request: pytest.FixtureRequest, tiny_model: str) -> Iterator[Stack]:
    with serving(tiny_model, request.param) as s:
        yield s


@pytest.fixture(scope="module", params=DTYPES)
def swa_stack(request: pytest.FixtureRequest, tiny_mellum: str) -> Iterator[Stack]:
    # Pools large enough that this module's traffic never makes SGLang evict or tombstone
    # (see tests/sglang/test_swa.py: its CPU attention path breaks once it does).
    with serving(tiny_mellum, request.param, max_total_tokens=4 * MAX_TOTAL_TOKENS) as s:
        yield s


def dropped(stack: Stack) -> int:
    """Sampled hits the sidecar counted as dropped, whatever the reason."""
    from sidecar import signals as S

    return int(stack.sidecar.metrics.value_sum(S.SAMPLES_DROPPED.name))


def clean_traffic(stack: Stack, workload: Workload, rounds: int) -> list[Any]:
    """``rounds`` rounds of ``workload`` (every request after the first round hits), then
    the verdicts of every sampled hit: waits (at most 120 s) until each is verified or was
    counted as dropped (under load the tap's pipe drops captures its queue cannot hold)."""
    verdicts: list[Any] = []
    for r in range(rounds):
        for tokens in workload.round():
            stack.server.generate(tokens)
        if r % 4 == 3:
            verdicts += stack.sidecar.verify_pending()
    hits = (rounds - 1) * len(workload.prefixes)
    deadline = time.monotonic() + 120
    while len(verdicts) + dropped(stack) < hits and time.monotonic() < deadline:
        verdicts += stack.sidecar.verify_pending()
    return verdicts


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MEASUREMENTS:
        return
    terminalreporter.section("kv-sidecar SGLang measurements")
    for key in sorted(MEASUREMENTS):
        terminalreporter.write_line(f"{key}: {MEASUREMENTS[key]}")
