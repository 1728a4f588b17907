#!/usr/bin/env bash
# Shared build steps for the llama.cpp peer binaries (llama-bench, llama-server):
# sourced by build_llama_bench.sh and build_llama_server.sh, never run on its own.
# It takes the llama.cpp vendored in the pinned PyPI sdist of llama-cpp-python,
# configures it for a PORTABLE x86-64 target (no -march=native: AVX, AVX2, FMA, F16C,
# BMI2, AVX-512 F/CD/VL/DQ/BW, AVX512-VBMI, AVX512-VNNI, AVX512-BF16; runs on Zen 4/5
# and Sapphire Rapids+), links llama/ggml and libstdc++/libgcc statically, copies the
# only other runtime dependency (libgomp.so.1) next to the binary (RUNPATH=$ORIGIN) and
# records what was built in OUT_DIR/BUILD_INFO.txt. The caller sets PEER_TARGET (the
# CMake target and binary name), PEER_ALSO (an array of further targets built and copied beside
# it; may be empty) and PEER_EXTRA_CMAKE (an array of extra -D flags), then calls peer_main "$@".
#
# options understood by every caller:
#   --version V     llama-cpp-python version whose vendored llama.cpp is built
#                   (default: $PEER_LLAMA_CPP_PYTHON_VERSION or 0.3.36)
#   --sdist FILE    use this llama_cpp_python-*.tar.gz (default: the project's cached
#                   ~/.cache/kvbridge/wheels copy, else pip download)
#   --work DIR      extract/build directory (default $PEER_WORK, else build-peer/llama.cpp
#                   under the repository root)
#   --amx           also enable AMX-TILE/INT8/BF16 (Sapphire Rapids+; ggml checks at run time)
#   --avx2          AVX2 baseline only (AVX, AVX2, FMA, F16C, BMI2; no AVX-512): for hosts without
#                   AVX-512 such as the 2-core development machine; same build tree (only ggml-cpu
#                   is recompiled when switching)
#   --quick         C++ at -O1 (ggml's C kernels, its matrix products and quantised dot products
#                   among them, stay -O3): 1,050 CPU-seconds against ~1,470 (-O0: 874, but its
#                   llama-server runs Gemma 3 270M several times slower); for CI, never for timing
#   --jobs N        parallel build jobs (default 2; the dev machine has 2 shared cores)
#   --force         clean rebuild even if OUT_DIR already holds this exact build

# keep in sync with setup_llamacpp.sh
PEER_DEFAULT_VERSION="${PEER_LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEER_PORTABLE_FLAGS=(
  -DGGML_NATIVE=OFF
  -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
)

PEER_AVX2_FLAGS=(
  -DGGML_NATIVE=OFF
  -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
)

peer_usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }

# parse the common options into OUT_DIR VERSION SDIST WORK AMX JOBS FORCE
peer_parse() {
  OUT_DIR=""; VERSION="$PEER_DEFAULT_VERSION"; SDIST=""
  WORK="${PEER_WORK:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/build-peer/llama.cpp}"; AMX=0; JOBS=2; FORCE=0
  AVX2=0; QUICK=0
  while [ $# -gt 0 ]; do
    case "$1" in
      -h|--help) peer_usage 0 ;;
      --version) VERSION="$2"; shift 2 ;;
      --sdist) SDIST="$2"; shift 2 ;;
      --work) WORK="$2"; shift 2 ;;
      --amx) AMX=1; shift ;;
      --avx2) AVX2=1; shift ;;
      --quick) QUICK=1; shift ;;
      --jobs) JOBS="$2"; shift 2 ;;
      --force) FORCE=1; shift ;;
      -*) echo "unknown option $1" >&2; peer_usage 2 ;;
      *) if [ -z "$OUT_DIR" ]; then OUT_DIR="$1"; shift; else echo "extra argument $1" >&2; peer_usage 2; fi ;;
    esac
  done
  [ -n "$OUT_DIR" ] || peer_usage 2
}

# the sdist (llama-cpp-python ships llama.cpp under vendor/llama.cpp), extracted once
peer_sources() {
  if [ -z "$SDIST" ]; then
    SDIST="$HOME/.cache/kvbridge/wheels/llama_cpp_python-$VERSION.tar.gz"
    [ -f "$SDIST" ] || SDIST="$WORK/sdist/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$SDIST" ]; then
      mkdir -p "$WORK/sdist"
      PY="$(command -v python3 || command -v python)"
      "$PY" -m pip download --no-binary :all: --no-deps -d "$WORK/sdist" "llama-cpp-python==$VERSION"
    fi
  fi
  [ -f "$SDIST" ] || { echo "sdist not found: $SDIST" >&2; exit 1; }
  SRC="$WORK/src-$VERSION"
  if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
    rm -rf "$SRC" "$SRC.tmp"; mkdir -p "$SRC.tmp"
    tar -xzf "$SDIST" -C "$SRC.tmp" --strip-components=1
    mv "$SRC.tmp" "$SRC"
  fi
  LLAMA_SRC="$SRC/vendor/llama.cpp"
  # llama.cpp commit the release vendors: "feat: update llama.cpp to ggml-org/llama.cpp@<sha>"
  COMMIT="$(awk -v v="## [$VERSION]" 'index($0,v)==1{f=1;next} f&&/^## \[/{exit} f' "$SRC/CHANGELOG.md" \
            | grep -o 'llama\.cpp@[0-9a-f]\{7,40\}' | head -1 | cut -d@ -f2 || true)"
  COMMIT="${COMMIT:-unknown}"
}

# configure one build tree (shared by all targets of the same flags) and build PEER_TARGET
peer_build() {
  local suffix="" gen=()
  [ "$AMX" = 1 ] && suffix="-amx"
  BUILD="$WORK/build-$VERSION$suffix"
  command -v ninja >/dev/null && gen=(-G Ninja)
  echo "== configuring llama.cpp@$COMMIT (llama-cpp-python $VERSION) in $BUILD"
  echo "   flags: $FLAGS_STR"
  cmake -S "$LLAMA_SRC" -B "$BUILD" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_OPENMP=ON -DGGML_CCACHE=OFF -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF \
    -DLLAMA_BUILD_COMMIT="$COMMIT" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_EXE_LINKER_FLAGS="-static-libgcc -static-libstdc++" \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
    "${FLAGS[@]}" "${PEER_EXTRA_CMAKE[@]}"
  T0=$(date +%s)
  [ "$FORCE" = 1 ] && cmake --build "$BUILD" --target clean >/dev/null
  CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" cmake --build "$BUILD" --target "$PEER_TARGET" "${PEER_ALSO[@]}" -j "$JOBS"
  T1=$(date +%s)
}

# copy the binary and libgomp, check that nothing else non-system is needed, record it
peer_collect() {
  local bin gomp runpath needed glibc_max
  bin="$(find "$BUILD" -type f -name "$PEER_TARGET" -perm -u+x | head -1)"
  [ -n "$bin" ] || { echo "$PEER_TARGET not produced" >&2; exit 1; }
  install -m 0755 "$bin" "$OUT_DIR/$PEER_TARGET"
  local t tb
  for t in "${PEER_ALSO[@]}"; do
    tb="$(find "$BUILD" -type f -name "$t" -perm -u+x | head -1)"
    [ -n "$tb" ] || { echo "$t not produced" >&2; exit 1; }
    install -m 0755 "$tb" "$OUT_DIR/$t"
  done
  gomp="$(ldd "$bin" | awk '$1=="libgomp.so.1"{print $3}')"
  if [ -n "$gomp" ]; then install -m 0644 "$(readlink -f "$gomp")" "$OUT_DIR/libgomp.so.1"; fi
  runpath="$(readelf -d "$OUT_DIR/$PEER_TARGET" | grep -E 'RUNPATH|RPATH' || true)"
  needed="$(readelf -d "$OUT_DIR/$PEER_TARGET" | awk '/NEEDED/{gsub(/[\[\]]/,"",$5); printf "%s ", $5}')"
  glibc_max="$(objdump -T "$OUT_DIR/$PEER_TARGET" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
  cat > "$OUT_DIR/BUILD_INFO.txt" <<INFO
stamp: $STAMP
llama-cpp-python: $VERSION
llama.cpp commit: $COMMIT
sdist: $(basename "$SDIST") sha256=$(sha256sum "$SDIST" | cut -d' ' -f1)
compiler: $(${CXX:-c++} --version | head -1)
build host: $(uname -m) glibc $(ldd --version | head -1 | awk '{print $NF}'), $(date -u +%Y-%m-%dT%H:%M:%SZ)
build time: $((T1 - T0)) s with $JOBS jobs
cmake flags: $FLAGS_STR ${PEER_EXTRA_CMAKE[*]} -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=ON -static-libgcc -static-libstdc++
needed: $needed
${runpath:+dynamic: $(echo "$runpath" | awk '{print $2, $NF}')}
max glibc symbol version: $glibc_max
INFO
  echo "== built in $((T1 - T0)) s"
  cat "$OUT_DIR/BUILD_INFO.txt"
  # sanity: the binary starts and resolves libgomp from $ORIGIN
  env -u LD_LIBRARY_PATH "$OUT_DIR/$PEER_TARGET" --help >/dev/null
  ldd "$OUT_DIR/$PEER_TARGET"
  echo "OK: $OUT_DIR/$PEER_TARGET"
}

peer_main() {
  peer_parse "$@"
  FLAGS=("${PEER_PORTABLE_FLAGS[@]}")
  if [ "$AVX2" = 1 ]; then FLAGS=("${PEER_AVX2_FLAGS[@]}"); fi
  if [ "$AMX" = 1 ]; then FLAGS+=(-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON); fi
  if [ "$QUICK" = 1 ]; then FLAGS+=("-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG"); fi
  FLAGS_STR="${FLAGS[*]}"
  mkdir -p "$OUT_DIR" "$WORK"
  OUT_DIR="$(cd "$OUT_DIR" && pwd)"; WORK="$(cd "$WORK" && pwd)"
  STAMP="$PEER_TARGET ${PEER_ALSO[*]} llama-cpp-python=$VERSION flags=$FLAGS_STR"
  if [ "$FORCE" = 0 ] && [ -x "$OUT_DIR/$PEER_TARGET" ] && [ -f "$OUT_DIR/BUILD_INFO.txt" ] \
     && grep -qxF "stamp: $STAMP" "$OUT_DIR/BUILD_INFO.txt"; then
    echo "$PEER_TARGET already built in $OUT_DIR ($STAMP); use --force to rebuild"
    exit 0
  fi
  peer_sources
  peer_build
  peer_collect
}
