#!/usr/bin/env bash
# Offline checks of the Kubernetes deployment (deploy/, mixin/): every kustomization rendered
# with `kubectl kustomize`, core objects validated with kubernetes-validate (oldest supported
# and newest schemas), operator objects with check-jsonschema against deploy/schemas/,
# promtool/amtool on the rendered rules and Alertmanager config, the mixin built with jsonnet,
# and the generated files checked for staleness. No cluster is needed or contacted.
#
# Installs what is missing: jsonnet (Debian, as root), prometheus + prometheus-alertmanager
# (Debian, as root, services not started), kubernetes-validate + check-jsonschema (into the
# venv). kubectl is not in Debian's archive: it must already be on PATH (it is on this
# project's machines); without it the stage fails and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

command -v kubectl >/dev/null || {
    echo "test-deploy: kubectl (with kustomize) not on PATH; install kubectl >= 1.27" >&2
    exit 1; }

need_apt=()
command -v jsonnet >/dev/null || need_apt+=(jsonnet)
{ command -v promtool && command -v amtool; } >/dev/null || \
    need_apt+=(prometheus prometheus-alertmanager)
if [ "${#need_apt[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "test-deploy: missing ${need_apt[*]}; run: sudo apt-get install -y ${need_apt[*]}" >&2
        exit 1
    fi
    policy=/usr/sbin/policy-rc.d  # exit 101: invoke-rc.d starts no service during install
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    install_ok=0
    { apt-get install -y -q --no-install-recommends "${need_apt[@]}" ||
      { apt-get update -q && apt-get install -y -q --no-install-recommends "${need_apt[@]}"; }
    } && install_ok=1
    [ "$created_policy" = 1 ] && rm -f "$policy"
    [ "$install_ok" = 1 ] || { echo "test-deploy: apt-get install failed" >&2; exit 1; }
fi

# The testbed (testbed/: reference engines, tiny model configs, demo) the tests use, also in a
# venv built before it was a distribution of its own.
"$PY" -c "import kvtestbed" 2>/dev/null || "$PY" -m pip install -q --no-deps -e ./testbed

"$PY" -c 'import kubernetes_validate' 2>/dev/null && [ -x "$(dirname "$PY")/check-jsonschema" ] ||
    "$PY" -m pip install -q 'kubernetes-validate>=1.31' 'check-jsonschema>=0.29'

export KVSIDECAR_REQUIRE_DEPLOY_TOOLS=1 KVSIDECAR_REQUIRE_PROMETHEUS=1
rc=0
"$PY" -m pytest -q -m deploy tests/deploy || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test-deploy: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
