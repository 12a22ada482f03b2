#!/usr/bin/env bash
# The sidecar on a GPU (issue 16; not part of `make test`): the reference engine on CUDA with
# kv-sidecar attached, printing side by side check throughput (GB/s) vs a device-to-device
# copy of the same bytes, capture cost per sampled block, hook overhead (attached vs
# detached) and detection of the core faults on CUDA (testbed/kvtestbed/bench/gpu_check.py).
#
#   scripts/check-gpu.sh            # the table
#   scripts/check-gpu.sh --json     # one JSON object
#
# Needs a Python with a CUDA build of PyTorch, transformers and the sidecar's runtime
# requirements (prometheus-client, opentelemetry-sdk, apscheduler, numpy); downloads
# nothing (the model is a tiny Llama initialised from a config). PYTHON picks the
# interpreter; otherwise the first of python3 and .venv/bin/python that sees a CUDA device.
# Under 5 minutes (killed at 290 s). Without a CUDA device it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

candidates=("${PYTHON:-}" python3 .venv/bin/python)
py=""
for c in "${candidates[@]}"; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
            >/dev/null 2>&1; then
        py=$c
        break
    fi
done
if [ -z "$py" ]; then
    echo "check-gpu: no CUDA device on this machine (no Python here has a CUDA-enabled" \
         "torch that sees a GPU): nothing to measure. The CPU tests cover the device code" \
         "paths that can run without one (tests/test_device_checks.py)."
    exit 0
fi

missing=$("$py" - <<'PYEOF'
import importlib.util
need = ["transformers", "prometheus_client", "opentelemetry.sdk", "apscheduler", "numpy"]
print(" ".join(m for m in need if importlib.util.find_spec(m.split(".")[0]) is None
               or importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then
    echo "check-gpu: $py lacks: $missing (install them, or point PYTHON at a Python that" \
         "has them; this script downloads nothing)" >&2
    exit 2
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 290 "$py" -m kvtestbed.bench.gpu_check --device cuda "$@"
