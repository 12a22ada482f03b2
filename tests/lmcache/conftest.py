"""Tests against a real LMCache 0.5.6 (``pytest -m lmcache``, in .venv-lmcache).

LMCache's process-wide side effects are pointed at the test session before it is imported:
its Prometheus multiprocess directory (removed when the session ends), usage tracking
(off: nothing leaves the machine) and its log level (warnings: its INFO lines would bury a
failure's output).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
_PROM_DIR = tempfile.mkdtemp(prefix="kvs-lmcache-prom-")
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", _PROM_DIR)


@pytest.fixture(scope="session", autouse=True)
def _lmcache_prometheus_dir() -> Iterator[None]:
    yield
    shutil.rmtree(_PROM_DIR, ignore_errors=True)
