#!/usr/bin/env bash
# End-to-end test with the real Prometheus and Alertmanager (Debian packages).
#
# Installs prometheus + prometheus-alertmanager when missing (as root), without letting the
# packages' own services start (they would take the default ports; our test uses its own
# loopback ports either way), runs the promtool/amtool unit tests with those binaries
# required, then the e2e test. Exit 5 from pytest (nothing collected) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

# The testbed (testbed/: reference engines, tiny model configs, demo) the tests use, also in a
# venv built before it was a distribution of its own.
"$PY" -c "import kvtestbed" 2>/dev/null || "$PY" -m pip install -q --no-deps -e ./testbed

have_all() { command -v prometheus && command -v promtool && command -v amtool &&
             { command -v prometheus-alertmanager || command -v alertmanager; }; } >/dev/null

if ! have_all; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "test-e2e: prometheus/alertmanager missing and not root;" \
             "run: sudo apt-get install -y prometheus prometheus-alertmanager" >&2
        exit 1
    fi
    # policy-rc.d exit 101 = "do not start services" for invoke-rc.d during the install.
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    install_ok=0
    apt-get update -q && apt-get install -y -q --no-install-recommends \
        prometheus prometheus-alertmanager && install_ok=1
    [ "$created_policy" = 1 ] && rm -f "$policy"
    [ "$install_ok" = 1 ] || { echo "test-e2e: apt-get install failed" >&2; exit 1; }
    have_all || { echo "test-e2e: binaries still missing after install" >&2; exit 1; }
fi

export KVSIDECAR_REQUIRE_PROMETHEUS=1

run_pytest() {
    local rc=0
    "$PY" -m pytest "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "test-e2e: pytest collected no tests for: $*" >&2
        return 1
    fi
    return "$rc"
}

# promtool check/test rules and amtool routing (skipped in the unit stage without binaries).
run_pytest -q tests/test_alerts.py tests/test_dashboards.py
# tests/e2e: test_stack.py (2 demos, ~90 s), test_fleet.py (4 replicas, one faulty, ~100 s),
# test_fleet_example.py (the fleet script up and down, ~20 s), test_guard_webhook.py (pages
# through Prometheus and Alertmanager open the cache-bypass guards they concern, ~90 s).
run_pytest -m e2e -rA tests/e2e
