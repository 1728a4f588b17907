#!/usr/bin/env bash
# Create a venv with llama-cpp-python (the Python bindings of llama.cpp) built from
# source for a PORTABLE x86-64 target: GGML_NATIVE=OFF with AVX, AVX2, FMA, F16C,
# BMI2, AVX-512 (F/CD/VL/DQ/BW), AVX512-VBMI, AVX512-VNNI, AVX512-BF16 -- runs on
# Zen 4/5 and on Sapphire Rapids (and newer) Xeons. Also installs `gguf` (used by
# tools/peer/make_test_gguf.py). Idempotent: does nothing if the venv already holds
# the same version built with the same flags.
#
# usage: tools/peer/setup_llamacpp.sh [VENV_DIR] [options]
#   VENV_DIR            default /work/main/.venv-peer
#   --version V         llama-cpp-python version (default $PEER_LLAMA_CPP_PYTHON_VERSION or 0.3.36)
#   --python PY         interpreter for the venv (default python3)
#   --amx               also enable AMX-TILE/INT8/BF16 (Sapphire Rapids+; off by default)
#   --native            build for THIS machine's CPU instead (GGML_NATIVE=ON): the portable
#                       build above dies of SIGILL on a CPU without AVX-512 (an AVX2-only
#                       development machine); not for carrying to another host
#   --force             reinstall even if already installed at that version/flags
#   --wheel-dir DIR     also build a wheel to carry to the (offline) benchmark host:
#                       DIR gets llama_cpp_python-V-py3-none-linux_x86_64.whl (the package
#                       loads libllama.so through ctypes, so the wheel is not tied to a
#                       CPython version) plus CPython 3.12 manylinux wheels of all its
#                       dependencies, and INSTALL.txt with the offline install command.
#   --wheel-python PY   interpreter for the dependency wheels (default: a python3.12 found
#                       on PATH or under pyenv; else they are fetched with
#                       pip download --python-version 3.12 --only-binary :all:)
#   --no-install        with --wheel-dir: only build the wheels, no venv
set -euo pipefail

# keep in sync with llama_peer_build.sh (build_llama_bench.sh, build_llama_server.sh)
DEFAULT_VERSION="${PEER_LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PORTABLE_FLAGS="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
AMX_FLAGS="-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON"
# llama-cpp-python's own CMakeLists forces BUILD_SHARED_LIBS=ON (libllama.so, libggml*.so
# with RUNPATH $ORIGIN inside the package); the rest keeps the build lean and offline.
EXTRA_FLAGS="-DCMAKE_BUILD_TYPE=Release -DGGML_OPENMP=ON -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF"
DEPS_312=(numpy diskcache jinja2 typing-extensions)   # llama-cpp-python's runtime deps

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }

VENV=""; VERSION="$DEFAULT_VERSION"; PY="python3"; AMX=0; NATIVE=0; FORCE=0
WHEEL_DIR=""; WHEEL_PY=""; INSTALL=1
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage 0 ;;
    --version) VERSION="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --amx) AMX=1; shift ;;
    --native) NATIVE=1; shift ;;
    --force) FORCE=1; shift ;;
    --wheel-dir) WHEEL_DIR="$2"; shift 2 ;;
    --wheel-python) WHEEL_PY="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    -*) echo "unknown option $1" >&2; usage 2 ;;
    *) if [ -z "$VENV" ]; then VENV="$1"; shift; else echo "extra argument $1" >&2; usage 2; fi ;;
  esac
done
VENV="${VENV:-/work/main/.venv-peer}"
FLAGS="$PORTABLE_FLAGS"; [ "$AMX" = 1 ] && FLAGS="$FLAGS $AMX_FLAGS"
[ "$NATIVE" = 1 ] && FLAGS="-DGGML_NATIVE=ON"
[ "$NATIVE" = 1 ] && [ -n "$WHEEL_DIR" ] && { echo "--native builds for this CPU: not for a wheel to carry" >&2; exit 2; }
export CMAKE_ARGS="$FLAGS $EXTRA_FLAGS"
export CMAKE_BUILD_PARALLEL_LEVEL=2
export FORCE_CMAKE=1
STAMP="llama-cpp-python=$VERSION flags=$FLAGS"

ggml_info() {  # what the installed libggml-base.so reports about itself
  "$1" - <<'PY'
import ctypes, pathlib, llama_cpp
lib = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
for f in ("ggml_commit", "ggml_version"):
    getattr(lib, f).restype = ctypes.c_char_p
print(f"commit {lib.ggml_commit().decode()}, ggml {lib.ggml_version().decode()}")
PY
}

if [ "$INSTALL" = 1 ] && [ ! -x "$VENV/bin/python" ]; then
  echo "== creating venv $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# the venv must never be committed: ignore everything inside it
[ "$INSTALL" = 1 ] && { [ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"; }

# 1. the wheel (when asked for): built once, then also used for the local install
WHL=""; WHEEL_SECS=""
if [ -n "$WHEEL_DIR" ]; then
  mkdir -p "$WHEEL_DIR"; WHEEL_DIR="$(cd "$WHEEL_DIR" && pwd)"
  BUILD_PY="$PY"; [ "$INSTALL" = 1 ] && BUILD_PY="$VENV/bin/python"
  WHL="$(ls "$WHEEL_DIR"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)"
  if [ "$FORCE" = 1 ] || [ -z "$WHL" ] || ! grep -qxF "stamp: $STAMP" "$WHEEL_DIR/BUILD_STAMP.txt" 2>/dev/null; then
    rm -f "$WHEEL_DIR"/llama_cpp_python-*.whl "$WHEEL_DIR/BUILD_STAMP.txt"
    echo "== pip wheel llama-cpp-python $VERSION -> $WHEEL_DIR (2 jobs), CMAKE_ARGS=$CMAKE_ARGS"
    T0=$(date +%s)
    "$BUILD_PY" -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
      -w "$WHEEL_DIR" "llama-cpp-python==$VERSION"
    T1=$(date +%s); WHEEL_SECS=$((T1 - T0))
    WHL="$(ls "$WHEEL_DIR"/llama_cpp_python-"$VERSION"-*.whl | head -1)"
    printf 'stamp: %s\nwheel: %s\nbuild time: %s s (pip wheel, CMAKE_BUILD_PARALLEL_LEVEL=2)\n' \
      "$STAMP" "$(basename "$WHL")" "$WHEEL_SECS" > "$WHEEL_DIR/BUILD_STAMP.txt"
  else
    echo "wheel $(basename "$WHL") already built with these flags"
  fi
fi

# 2. the venv
if [ "$INSTALL" = 1 ]; then
  INSTALLED="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
  if [ "$FORCE" = 0 ] && [ "$INSTALLED" = "$VERSION" ] && [ -f "$VENV/LLAMACPP_PEER.txt" ] \
     && grep -qxF "stamp: $STAMP" "$VENV/LLAMACPP_PEER.txt"; then
    echo "llama-cpp-python $VERSION already installed in $VENV with these flags; --force to rebuild"
  else
    T0=$(date +%s)
    if [ -n "$WHL" ]; then
      echo "== installing $(basename "$WHL")"
      "$VENV/bin/python" -m pip install --force-reinstall "$WHL"
      HOW="from $(basename "$WHL"), wheel build ${WHEEL_SECS:-?} s"
    else
      echo "== building llama-cpp-python $VERSION from source (2 jobs), CMAKE_ARGS=$CMAKE_ARGS"
      "$VENV/bin/python" -m pip install --no-cache-dir --force-reinstall --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION"
      HOW="pip install from source"
    fi
    T1=$(date +%s)
    "$VENV/bin/python" -m pip install -q gguf
    LIBDIR="$("$VENV/bin/python" -c 'import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))')"
    SYSINFO="$("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())')"
    cat > "$VENV/LLAMACPP_PEER.txt" <<INFO
stamp: $STAMP
llama-cpp-python: $VERSION
llama.cpp: $(ggml_info "$VENV/bin/python")
python: $("$VENV/bin/python" --version 2>&1)
CMAKE_ARGS: $CMAKE_ARGS
build time: $((T1 - T0)) s ($HOW, CMAKE_BUILD_PARALLEL_LEVEL=2)
libs: $(ls "$LIBDIR" | tr '\n' ' ')
system_info: $SYSINFO
INFO
  fi
  cat "$VENV/LLAMACPP_PEER.txt"
fi

# 3. dependency wheels for CPython 3.12 / x86_64 (the benchmark host has no internet)
if [ -n "$WHEEL_DIR" ]; then
  if [ -z "$WHEEL_PY" ]; then
    for c in python3.12 "$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"; do
      [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { WHEEL_PY="$c"; break; }
    done
  fi
  if [ -n "$WHEEL_PY" ]; then
    echo "== dependency wheels with $("$WHEEL_PY" --version 2>&1) ($WHEEL_PY)"
    "$WHEEL_PY" -m pip download --only-binary :all: -d "$WHEEL_DIR" "${DEPS_312[@]}" gguf
  else
    echo "== no CPython 3.12 here: cross-downloading cp312 manylinux dependency wheels"
    # pip does not widen an explicit --platform to older manylinux tags: list them all
    PLATS=(); for g in 39 35 34 31 28 27 24 17 12 5; do PLATS+=(--platform "manylinux_2_${g}_x86_64"); done
    "$BUILD_PY" -m pip download --only-binary :all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none "${PLATS[@]}" --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform any -d "$WHEEL_DIR" "${DEPS_312[@]}" gguf
  fi
  cat > "$WHEEL_DIR/INSTALL.txt" <<INFO
$(cat "$WHEEL_DIR/BUILD_STAMP.txt")
CMAKE_ARGS: $CMAKE_ARGS
Offline install on the benchmark host (Python 3.12, x86_64, glibc >= 2.36), from the
folder that holds these wheels -- either into a fresh venv:
  /opt/torch/.venv/bin/python3 -m venv /tmp/peer-venv
  /tmp/peer-venv/bin/python -m pip install --no-index --find-links $(basename "$WHEEL_DIR") llama-cpp-python==$VERSION gguf
or, where that venv has no pip/ensurepip, with any pip into a folder put on PYTHONPATH:
  python3 -m pip install --no-index --find-links $(basename "$WHEEL_DIR") --target /tmp/peer-site \\
    --python-version 3.12 --only-binary :all: llama-cpp-python==$VERSION gguf
  PYTHONPATH=/tmp/peer-site /opt/torch/.venv/bin/python3 tools/peer/bench_llamacpp.py --backend python ...
(the wheel set holds every dependency as a cp312 manylinux wheel; nothing is fetched)
INFO
  ls -la "$WHEEL_DIR"
fi
