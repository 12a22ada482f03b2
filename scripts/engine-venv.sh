# Sourced by the engine test scripts (test-vllm.sh, test-lmcache.sh, test-sglang.sh): each
# engine lives in a venv of its own (their pins conflict), 2-5 GB apiece, so a full `make
# test` needs ~12 GB of free disk if every venv is kept. A CI machine may have less: one run
# ran out of space building the third. These helpers make room before a build and read
# pytest's "no tests ran" as the failure it is.

# The engine venvs a build may remove to make room: rebuildable, each script builds its own
# when missing. The dev venv (.venv) is never touched.
_engine_venvs() {
    printf '%s\n' "${VENV_VLLM:-.venv-vllm}" "${VENV_LMCACHE:-.venv-lmcache}" "${VENV_SGLANG:-.venv-sglang}"
}

# A path this script may delete: a venv (pyvenv.cfg, even a half-built one has it) or
# nothing at all, never the dev venv. VENV_* can name any path; a typo must not rm -rf it.
_removable_venv() {
    local path=$1
    [ -n "$path" ] || return 1
    [ ! -e "$path" ] && return 0
    [ -d "$path" ] && [ ! -L "$path" ] && [ -f "$path/pyvenv.cfg" ] || return 1
    [ "$(cd "$path" && pwd -P)" != "$(cd "${DEV_VENV:-.venv}" 2>/dev/null && pwd -P)" ]
}

_free_mib() {
    df -Pm . | awk 'NR == 2 { print $4 }'
}

# engine_venv_room NAME VENV NEED_MIB: before building VENV, say how much disk is free; if
# less than NEED_MIB, remove the other engine venvs (saying which) until there is room; if
# there still is not, stop with the numbers. The build itself keeps no pip cache (it would
# only help a rebuild, and costs ~1 GB per venv) and starts from an empty directory (a build
# that died half-way, out of disk say, leaves no half venv behind to trip over).
engine_venv_room() {
    local name=$1 venv=$2 need=$3 free other
    if ! _removable_venv "$venv"; then
        echo "$name: $venv exists and is not a venv this script may replace (no" \
            "pyvenv.cfg, a link, or the dev venv); remove it or point the VENV_* variable" \
            "elsewhere" >&2
        exit 1
    fi
    rm -rf "$venv"
    free=$(_free_mib)
    echo "$name: ${free} MiB free here; $venv needs ~${need} MiB"
    if [ "$free" -lt "$need" ]; then
        while read -r other; do
            [ "$other" = "$venv" ] || [ ! -d "$other" ] && continue
            _removable_venv "$other" || continue
            echo "$name: removing $other to make room (its test script rebuilds it when run)"
            rm -rf "$other"
            free=$(_free_mib)
            [ "$free" -ge "$need" ] && break
        done < <(_engine_venvs)
    fi
    if [ "$free" -lt "$need" ]; then
        echo "$name: only ${free} MiB free on $(df -P . | awk 'NR == 2 { print $6 }');" \
            "building $venv needs ~${need} MiB. Free some disk and run again." >&2
        exit 1
    fi
    export PIP_NO_CACHE_DIR=1
}

# engine_pytest NAME WHAT PYTEST_ARGS...: run the engine's tests; exit 5 (nothing collected)
# is a failure, not a pass.
engine_pytest() {
    local name=$1 what=$2 rc=0 started
    shift 2
    started=$(date +%s)
    "$PY" -m pytest -q -p no:cacheprovider "$@" || rc=$?
    echo "$name: tests ran in $(( $(date +%s) - started ))s"
    if [ "$rc" -eq 5 ]; then
        echo "$name: pytest collected no $what tests" >&2
        exit 1
    fi
    exit "$rc"
}
