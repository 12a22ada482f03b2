#!/usr/bin/env bash
# Tests against real LMCache storage backends (lmcache 0.5.6 on PyPI), in a venv of its own.
#
# LMCache needs its own environment: it pins numpy<=2.2.6 and prometheus_client<=0.24.1 and
# pulls cupy/cuda-python wheels (ENGINES.md). The sidecar is installed into it with --no-deps
# (editable), so LMCache's pins stay as they are. LMCache runs on CPU through its local CPU and
# local disk backends; only lmcache.cuda_ops fails to import, and nothing here needs it.
#
# Builds .venv-lmcache when missing (~1.5 min), then runs `pytest -m lmcache tests/lmcache`.
# Exit 5 from pytest (nothing collected) is a failure, not a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV_LMCACHE:-.venv-lmcache}
PY="$VENV/bin/python"
STAMP="$VENV/.kvsidecar-installed"
# shellcheck source=scripts/engine-venv.sh
source scripts/engine-venv.sh

if [ ! -f "$STAMP" ]; then
    started=$(date +%s)
    echo "test-lmcache: building $VENV (lmcache 0.5.6)"
    engine_venv_room test-lmcache "$VENV" 2600
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # torch first and pinned: the local CPU wheel (an unpinned torch pulls CUDA builds).
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q lmcache==0.5.6 "transformers>=5.0" pytest pytest-timeout opentelemetry-sdk \
        "apscheduler>=3.10,<4"
    "$PY" -m pip install -q --no-deps -e . -e ./testbed
    "$PY" -c "import lmcache.v1.cache_engine, sidecar.adapters.lmcache" 2>/dev/null \
        || { echo "test-lmcache: lmcache or the adapter does not import in $VENV" >&2; exit 1; }
    touch "$STAMP"
    echo "test-lmcache: $VENV built in $(( $(date +%s) - started ))s"
fi

# The testbed (testbed/: reference engines, tiny model configs, demo) the tests use, also in a
# venv built before it was a distribution of its own.
"$PY" -c "import kvtestbed" 2>/dev/null || "$PY" -m pip install -q --no-deps -e ./testbed
# pytest-timeout (the per-test limit in pyproject.toml), also in a venv built before it.
"$PY" -c "import pytest_timeout" 2>/dev/null || "$PY" -m pip install -q pytest-timeout

# LMCache hashes token chunks with Python's hash() unless told otherwise: fix the seed so the
# chunk keys (and the disk file names) are the same in every process.
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}
engine_pytest test-lmcache LMCache -m lmcache tests/lmcache "$@"
