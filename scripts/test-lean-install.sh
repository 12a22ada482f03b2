#!/usr/bin/env bash
# The lean runtime, installed as a user would: `pip install .` into a fresh venv (torch pinned
# first, the local CPU wheel) must bring only the runtime dependencies, and the CLI must work
# there: `--help` exits 0; `demo`, `faults`, `bench` (the testbed, testbed/) exit 2 saying so,
# the extras exit 2 naming the extra to install, with
# no traceback; every runtime module imports (none pulls transformers, grafanalib, pytest or
# yaml at import time).
#
# Not --system-site-packages: that would see the dev venv's packages and prove nothing. The
# venv lives in a temp dir removed on exit; pip's wheel cache keeps reruns cheap (~35-45 s on
# 2 cores, most of it unpacking torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
started=$(date +%s)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvsidecar-lean.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
VENV="$tmp/venv"
PY="$VENV/bin/python"
fail() { echo "test-lean-install: FAIL: $*" >&2; exit 1; }

"$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q torch==2.13.0
# A copy of the tree, so the build leaves no build/ or egg-info in the checkout.
mkdir "$tmp/src"
# testbed/ comes along so the check below sees that the root wheel leaves it out
cp -r pyproject.toml README.md sidecar testbed "$tmp/src/"
cp tests/toy.py "$tmp/toy.py"  # a tiny in-memory engine + adapter (sidecar and torch only)
"$PY" -m pip install -q "$tmp/src"

installed=$("$PY" -m pip list --format=freeze | cut -d= -f1 | tr '[:upper:]_' '[:lower:]-')
for pkg in pytest grafanalib transformers pyyaml ruff mypy pyzmq msgpack matplotlib mkdocs; do
    if grep -qx "$pkg" <<<"$installed"; then fail "the lean runtime installed $pkg"; fi
done
for pkg in torch numpy prometheus-client opentelemetry-sdk apscheduler kv-sidecar; do
    grep -qx "$pkg" <<<"$installed" || fail "the lean runtime lacks $pkg"
done

CLI="$VENV/bin/kv-sidecar"
"$CLI" --help >/dev/null || fail "kv-sidecar --help exited $?"
"$CLI" signals >/dev/null || fail "kv-sidecar signals exited $?"
expect_extra() {  # expect_extra EXTRA ARGS...: exit 2, names the extra, no traceback
    local extra=$1 rc=0 err
    shift
    err=$("$CLI" "$@" 2>&1 >/dev/null) || rc=$?
    [ "$rc" -eq 2 ] || fail "kv-sidecar $* exited $rc, expected 2: $err"
    grep -q "kv-sidecar\[$extra\]" <<<"$err" || fail "kv-sidecar $* did not name [$extra]: $err"
    if grep -q Traceback <<<"$err"; then fail "kv-sidecar $* printed a traceback: $err"; fi
}
# The testbed's commands say in one line where they are (exit 2, no traceback).
expect_testbed() {  # expect_testbed ARGS...
    local rc=0 err
    err=$("$CLI" "$@" 2>&1 >/dev/null) || rc=$?
    [ "$rc" -eq 2 ] || fail "kv-sidecar $* exited $rc, expected 2: $err"
    [ "$(wc -l <<<"$err")" -eq 1 ] || fail "kv-sidecar $* printed more than one line: $err"
    grep -q "testbed" <<<"$err" || fail "kv-sidecar $* did not name the testbed: $err"
}
expect_testbed demo
expect_testbed demo --fault zero-block
expect_testbed faults
expect_testbed bench detection
expect_testbed calibrate
expect_testbed actions-demo
"$CLI" --help | grep -q "testbed" || fail "kv-sidecar --help does not say where demo/bench are"
# No testbed module in the installed runtime: reference engines, faults, bench, demo.
"$PY" -m pip show -f kv-sidecar >"$tmp/files.txt" || fail "pip show -f kv-sidecar exited $?"
grep -q "sidecar/core/monitor.py" "$tmp/files.txt" || fail "pip show -f lists no sidecar files"
if grep -E "kvtestbed|sidecar/(engines|bench)/|demo|faults|calibration\.json" "$tmp/files.txt"; then
    fail "testbed modules in the installed runtime package (above)"
fi
if (cd "$tmp" && "$PY" -c "import kvtestbed" 2>/dev/null); then
    fail "kvtestbed is importable from the runtime install"
fi
expect_extra events vllm --help
# The configuration works without the extras ([vllm] is skipped: its flags need [events]).
"$CLI" config check examples/kv-sidecar.toml >/dev/null || fail "kv-sidecar config check exited $?"

# Every runtime module imports; the extra-gated ones are listed (and must fail only for
# the missing extra, i.e. they really need it).
(cd "$tmp" && "$PY" - <<'PYEOF'
import importlib
import pkgutil
import sys

import sidecar

# the probe pipe's users: vLLM's probe, SGLang's tap, dispatch = "process" (the events extra)
GATED = ("sidecar.adapters.vllm", "sidecar.adapters.sglang", "sidecar.adapters.remote")
EXTRA_MODULES = {"transformers", "zmq", "msgpack", "vllm", "sglang"}
runtime = gated = 0
for info in pkgutil.walk_packages(sidecar.__path__, "sidecar."):
    name = info.name
    if name.endswith("__main__"):
        continue
    is_gated = name.startswith(GATED)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if is_gated and root in EXTRA_MODULES:
            gated += 1
            continue
        sys.exit(f"test-lean-install: FAIL: {name} needs {exc.name} in the lean runtime")
    runtime += 1
# The runtime does its job: a Monitor verifies a toy engine's hits and catches a zeroed block.
import torch
from toy import ToyAdapter, ToyEngine

from sidecar.checks.fingerprint import kv_digest
from sidecar.core.monitor import Monitor, SidecarConfig

# No xxhash in the lean runtime: fingerprints fall back to stdlib BLAKE2b, and say so.
algo, _, hex_digest = kv_digest(torch.ones(2, 3), torch.zeros(2, 3)).partition(":")
assert algo == "blake2b" and len(hex_digest) == 32, (algo, hex_digest)
engine = ToyEngine(sink=None)
monitor = Monitor(ToyAdapter(engine), SidecarConfig(sample_every=1))
engine.sink = monitor
prompt = list(range(12))
engine.serve(prompt)
clean = monitor.verify(engine.serve(prompt + [1]))
for tensor in engine.kv[engine.index[tuple(prompt)]]:
    tensor.zero_()
bad = monitor.verify(engine.serve(prompt + [2]))
monitor.stop()
if clean.kinds() or not bad.kinds():
    sys.exit(f"test-lean-install: FAIL: clean {clean.kinds()}, zeroed {bad.kinds()}")
leaked = sorted(m for m in ("transformers", "grafanalib", "pytest", "yaml") if m in sys.modules)
if leaked:
    sys.exit(f"test-lean-install: FAIL: runtime imports pulled in {leaked}")
print(f"test-lean-install: {runtime} modules import in the lean runtime, "
      f"{gated} need an extra")
PYEOF
) || exit 1
echo "test-lean-install: ok ($(du -sm "$VENV" | cut -f1) MB venv, $(( $(date +%s) - started ))s)"
