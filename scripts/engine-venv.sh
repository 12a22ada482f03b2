# Sourced by the engine test scripts (test-vllm.sh, test-lmcache.sh, test-sglang.sh): each
# engine lives in a venv of its own (their pins conflict), 2-5 GB apiece, so a full `make
# test` needs ~12 GB of free disk if every venv is kept. A CI machine may have less: one run
# ran out of space building the third. These helpers make room before a build and read
# pytest's "no tests ran" as the failure it is.

# A directory's physical path ("" if it cannot be entered). CDPATH would make cd print;
# a bare "-" would be $OLDPWD, so relative names go as ./name.
_physical() {
    local path=$1
    case $path in /*) ;; *) path=./$path ;; esac
    (CDPATH='' cd -P -- "$path" 2>/dev/null && pwd -P) || true
}

# A path this script may delete: nothing at all, or a venv (a directory, not a link, with
# pyvenv.cfg: even a half-built one has it) that is neither the dev venv (.venv, $DEV_VENV)
# nor holds it, this checkout or /. VENV_* can name any path: a typo must not rm -rf it.
_removable_venv() {
    local path=$1 real here dev
    while [ "${path%/}" != "$path" ] && [ "$path" != / ]; do path=${path%/}; done  # link/
    [ -n "$path" ] || return 1
    [ -e "$path" ] || [ -L "$path" ] || return 0
    [ -d "$path" ] && [ ! -L "$path" ] && [ -f "$path/pyvenv.cfg" ] || return 1
    real=$(_physical "$path")
    [ -n "$real" ] && [ "$real" != / ] || return 1
    here=$(pwd -P)
    for dev in "$here" "$(_physical .venv)" "$(_physical "${DEV_VENV:-.venv}")"; do
        [ -n "$dev" ] || continue
        [ "$dev" = "$real" ] || [ "${dev#"$real"/}" != "$dev" ] && return 1
    done
    return 0
}

_df_failed() {
    echo "$1: cannot read the free disk here (df failed)" >&2
    exit 1
}

_free_mib() {
    local free
    free=$(df -m --output=avail . 2>/dev/null | tail -n 1 | tr -d ' ') || true
    case $free in
        '' | *[!0-9]*) return 1 ;;
    esac
    echo "$free"
}

# engine_venv_room NAME VENV NEED_MIB: before building VENV, say how much disk is free; if
# less than NEED_MIB, remove the other engine venvs ($VENV_VLLM, $VENV_LMCACHE,
# $VENV_SGLANG: rebuildable, each test script builds its own when missing; never the dev
# venv) until there is room; if there still is not, stop with the numbers. The build keeps
# no pip cache (it would only help a rebuild, and costs ~1 GB per venv) and starts from an
# empty directory (a build that died half-way, out of disk say, leaves no half venv).
engine_venv_room() {
    local name=$1 venv=$2 need=$3 free other
    case $need in
        '' | *[!0-9]*) echo "$name: NEED_MIB must be a whole number of MiB, not '$need'" >&2
                       exit 1 ;;
    esac
    if [ "${#need}" -gt 9 ]; then
        echo "$name: NEED_MIB '$need' is more than any disk: at most 9 digits" >&2
        exit 1
    fi
    if ! _removable_venv "$venv"; then
        echo "$name: '$venv' exists and is not a venv this script may replace (no" \
            "pyvenv.cfg, a link, the dev venv or a directory holding it); remove it or" \
            "point the VENV_* variable elsewhere" >&2
        exit 1
    fi
    free=$(_free_mib) || _df_failed "$name"  # before anything is removed
    rm -rf -- "$venv"
    free=$(_free_mib) || _df_failed "$name"
    echo "$name: ${free} MiB free here; $venv needs ~${need} MiB"
    if [ "$free" -lt "$need" ]; then
        for other in "${VENV_VLLM:-.venv-vllm}" "${VENV_LMCACHE:-.venv-lmcache}" \
                "${VENV_SGLANG:-.venv-sglang}"; do
            [ "$other" = "$venv" ] || [ ! -d "$other" ] && continue
            if ! _removable_venv "$other"; then
                echo "$name: not removing '$other' (not a venv this script may delete)"
                continue
            fi
            echo "$name: removing '$other' to make room (its test script rebuilds it when run)"
            rm -rf -- "$other"
            free=$(_free_mib) || _df_failed "$name"
            [ "$free" -ge "$need" ] && break
        done
    fi
    if [ "$free" -lt "$need" ]; then
        echo "$name: only ${free} MiB free on $(df --output=target . | tail -n 1);" \
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
