#!/usr/bin/env bash
# Tests against a real SGLang server (sglang 0.5.23 on PyPI) on CPU, in a venv of its own.
#
# A normal `pip install sglang` pins a CUDA torch 2.14.1, flashinfer and ~30 CUDA wheels, so
# the venv is built as ENGINES.md measured: torch 2.13.0 (the local CPU wheel) first, then
# sglang with --no-deps, then its pure-Python requirements (a constraint keeps torch at
# 2.13.0; the CUDA-only ones are left out; a few with --no-deps, as their own pins would pull
# torch). The sidecar is installed into it with --no-deps (editable), which also registers
# its SGLang plugin entry point (the `kv-sidecar` radix-cache backend).
#
# Builds .venv-sglang when missing (~10 min on 2 loaded cores, most of it pip resolving),
# then runs `pytest -m sglang tests/sglang`. Exit 5 from pytest (nothing collected) is a
# failure, not a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV_SGLANG:-.venv-sglang}
PY="$VENV/bin/python"
STAMP="$VENV/.kvsidecar-installed"
# shellcheck source=scripts/engine-venv.sh
source scripts/engine-venv.sh

if [ ! -f "$STAMP" ]; then
    started=$(date +%s)
    echo "test-sglang: building $VENV (sglang 0.5.23, CPU)"
    engine_venv_room test-sglang "$VENV" 4400
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # torch first and pinned: the local CPU wheel (an unpinned torch pulls CUDA builds).
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q --no-deps sglang==0.5.23
    constraints=$(mktemp)
    echo "torch==2.13.0" > "$constraints"
    "$PY" -m pip install -q -c "$constraints" aiohttp "anthropic>=0.20.0" blobfile==3.0.0 \
        build datasets distro easydict einops fastapi gguf interegular IPython \
        "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" modelscope msgspec ninja numba==0.65.1 \
        numpy nvidia-ml-py openai==2.8.0 openai-harmony==0.0.4 orjson packaging \
        partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic \
        "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy \
        sentencepiece==0.2.1 setproctitle "smg-grpc-servicer>=0.9.0" soundfile==0.13.1 \
        tiktoken tokenizers==0.23.2 tqdm transformers==5.19.0 "uvicorn>=0.51" uvloop \
        watchfiles xxhash zstandard triton apache-tvm-ffi==0.1.11 \
        airportsdata cloudpickle diskcache jsonschema "kernels-data>=0.14.0.dev1" lark \
        loguru nest_asyncio outlines_core==0.1.26 pycountry referencing safetensors \
        "tomlkit>=0.13.3" \
        pytest pytest-timeout msgpack opentelemetry-sdk "apscheduler>=3.10,<4" grafanalib pyyaml cbor2
    "$PY" -m pip install -q --no-deps compressed-tensors==0.18.0 xgrammar==0.2.7 \
        timm==1.0.25 outlines==0.1.11 "torch_memory_saver>=0.0.9.post1" \
        "kernels>=0.14.1,<0.15"
    rm -f "$constraints"
    "$PY" -m pip install -q --no-deps -e . -e ./testbed
    PYTHONPATH="tests/sglang/shims" "$PY" -c \
        "import sglang.srt.mem_cache.registry, sidecar.adapters.sglang.backend" \
        || { echo "test-sglang: sglang or the backend does not import in $VENV" >&2; exit 1; }
    touch "$STAMP"
    echo "test-sglang: $VENV built in $(( $(date +%s) - started ))s"
fi

# The testbed (testbed/: reference engines, tiny model configs, demo) the tests use, also in a
# venv built before it was a distribution of its own.
"$PY" -c "import kvtestbed" 2>/dev/null || "$PY" -m pip install -q --no-deps -e ./testbed
# pytest-timeout (the per-test limit in pyproject.toml), also in a venv built before it.
"$PY" -c "import pytest_timeout" 2>/dev/null || "$PY" -m pip install -q pytest-timeout

engine_pytest test-sglang SGLang -m sglang tests/sglang "$@"
