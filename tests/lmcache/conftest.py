"""Tests against a real LMCache 0.5.6 (``pytest -m lmcache``, in .venv-lmcache).

LMCache's process-wide side effects are pointed at the test session: its Prometheus
multiprocess directory, and usage tracking (off: nothing leaves the machine).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="kvs-lmcache-prom-"))

from tests.lmcache.harness import Rig, build  # noqa: E402


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = build(tmp_path)
    yield r
    r.close()
