#!/usr/bin/env bash
# The black-box canary against vLLM's OpenAI server: paired probes, the hit-rate audit and the
# signals on the canary's own /metrics.
#
#   MODEL=/tmp/kvsidecar-tiny DTYPE=float32 PY=.venv-vllm/bin/python bash examples/canary/canary.sh
#   ENDPOINT=http://127.0.0.1:8000/v1 bash examples/canary/canary.sh   # a server already running
#
# Settings (environment): ENDPOINT (a running server; otherwise one is started from MODEL),
# MODEL (checkpoint dir: examples/vllm/make_tiny_model.py), DTYPE (bfloat16), BLOCK (32),
# VLLM_PORT (8000), CANARY_PORT (9470: the canary's /metrics), PAIRS (12), RUN (logs),
# MIN_RATE (5 requests/s: an idle demo server would otherwise pace one pair per minute),
# PY (the python of the vLLM environment), SIDECAR_PY (the canary's python; defaults to PY).
set -euo pipefail
DTYPE="${DTYPE:-bfloat16}" BLOCK="${BLOCK:-32}" PAIRS="${PAIRS:-12}" MIN_RATE="${MIN_RATE:-5}"
VLLM_PORT="${VLLM_PORT:-8000}" CANARY_PORT="${CANARY_PORT:-9470}"
PY="${PY:-python}" SIDECAR_PY="${SIDECAR_PY:-$PY}"
RUN="${RUN:-$(mktemp -d /tmp/kvsidecar-canary-XXXXXX)}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
mkdir -p "$RUN"

pid=""
cleanup() { if [[ -n "$pid" ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; }
trap cleanup EXIT INT TERM

if [[ -z "${ENDPOINT:-}" ]]; then
    MODEL="${MODEL:?set MODEL to a checkpoint directory, or ENDPOINT to a running server}"
    # Prompt-token details on: usage.prompt_tokens_details.cached_tokens is what the audit reads.
    "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype "$DTYPE" \
        --block-size "$BLOCK" --enable-prefix-caching --enable-prompt-tokens-details \
        --max-model-len 1024 --enforce-eager --host 127.0.0.1 --port "$VLLM_PORT" \
        > "$RUN/vllm.log" 2>&1 &
    pid=$!
    ENDPOINT="http://127.0.0.1:$VLLM_PORT/v1"
    "$SIDECAR_PY" - "http://127.0.0.1:$VLLM_PORT/health" <<'PYEOF'
import sys, time, urllib.request
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2).read()
        sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(f"{sys.argv[1]} did not answer (log: see RUN)")
PYEOF
fi

# The canary: PAIRS paired probes, /metrics on 127.0.0.1:CANARY_PORT while it runs, then the
# report (exit 1 if it found anomalies or hit-audit mismatches, 2 for an unusable server).
"$SIDECAR_PY" -m sidecar.cli canary --endpoint "$ENDPOINT" --dtype "$DTYPE" --block-size "$BLOCK" \
    --pairs "$PAIRS" --port "$CANARY_PORT" --min-rate "$MIN_RATE" --max-rate 20 --json | tee "$RUN/report.json"
