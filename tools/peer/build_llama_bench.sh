#!/usr/bin/env bash
# Build llama.cpp's official `llama-bench` from the llama.cpp sources vendored in
# the PyPI sdist of llama-cpp-python, for a PORTABLE x86-64 target (no -march=native):
# AVX, AVX2, FMA, F16C, BMI2, AVX-512 F/CD/VL/DQ/BW, AVX512-VBMI, AVX512-VNNI,
# AVX512-BF16 -- runs on Zen 4/5 and on Sapphire Rapids (and newer) Xeons.
#
# llama/ggml are linked statically into the binary, libstdc++/libgcc too; the only
# non-glibc runtime dependency, libgomp.so.1 (OpenMP thread pool), is copied next
# to the binary and found through RUNPATH=$ORIGIN. Needs glibc >= the build host's
# (Debian 12: 2.36), so an Ubuntu 24.04-class host is fine. No Python is needed to
# run the result.
#
# usage: tools/peer/build_llama_bench.sh OUT_DIR [options]
#   --version V     llama-cpp-python version whose vendored llama.cpp is built
#                   (default: $PEER_LLAMA_CPP_PYTHON_VERSION or 0.3.36)
#   --sdist FILE    use this llama_cpp_python-*.tar.gz instead of downloading it
#   --work DIR      download/extract/build directory (default /work/main/build-peer/llama.cpp)
#   --amx           also enable AMX-TILE/INT8/BF16 (Sapphire Rapids+). ggml only uses
#                   AMX after a runtime check, but the default build leaves it off.
#   --jobs N        parallel build jobs (default 2; the dev machine has 2 shared cores)
#   --force         clean rebuild even if OUT_DIR already holds this exact build
#   --batched       also build llama-batched-bench (B sequences decoded together: the peer of
#                   `kvbridge bench decode --batch B`; same libraries, one more small target)
#
# Result: OUT_DIR/llama-bench (and with --batched OUT_DIR/llama-batched-bench), OUT_DIR/libgomp.so.1,
# OUT_DIR/BUILD_INFO.txt
# Copy the whole OUT_DIR to the benchmark host.
set -euo pipefail

# keep in sync with setup_llamacpp.sh
DEFAULT_VERSION="${PEER_LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PORTABLE_FLAGS=(
  -DGGML_NATIVE=OFF
  -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
)

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }

OUT_DIR=""; VERSION="$DEFAULT_VERSION"; SDIST=""; WORK="/work/main/build-peer/llama.cpp"
AMX=0; JOBS=2; FORCE=0; BATCHED=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage 0 ;;
    --version) VERSION="$2"; shift 2 ;;
    --sdist) SDIST="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --amx) AMX=1; shift ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    --batched) BATCHED=1; shift ;;
    -*) echo "unknown option $1" >&2; usage 2 ;;
    *) if [ -z "$OUT_DIR" ]; then OUT_DIR="$1"; shift; else echo "extra argument $1" >&2; usage 2; fi ;;
  esac
done
[ -n "$OUT_DIR" ] || usage 2

FLAGS=("${PORTABLE_FLAGS[@]}")
if [ "$AMX" = 1 ]; then FLAGS+=(-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON); fi
FLAGS_STR="${FLAGS[*]}"

mkdir -p "$OUT_DIR" "$WORK"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"; WORK="$(cd "$WORK" && pwd)"
STAMP="llama-cpp-python=$VERSION flags=$FLAGS_STR"
if [ "$FORCE" = 0 ] && [ -x "$OUT_DIR/llama-bench" ] && [ -f "$OUT_DIR/BUILD_INFO.txt" ] \
   && grep -qxF "stamp: $STAMP" "$OUT_DIR/BUILD_INFO.txt" \
   && { [ "$BATCHED" = 0 ] || [ -x "$OUT_DIR/llama-batched-bench" ]; }; then
  echo "llama-bench already built in $OUT_DIR ($STAMP); use --force to rebuild"
  exit 0
fi

# 1. the sdist (llama-cpp-python ships llama.cpp under vendor/llama.cpp)
if [ -z "$SDIST" ]; then
  SDIST="$WORK/sdist/llama_cpp_python-$VERSION.tar.gz"
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

# 2. configure + build only the llama-bench target
SUFFIX=""; [ "$AMX" = 1 ] && SUFFIX="-amx"
BUILD="$WORK/build-$VERSION$SUFFIX"
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
echo "== configuring llama.cpp@$COMMIT (llama-cpp-python $VERSION) in $BUILD"
echo "   flags: $FLAGS_STR"
cmake -S "$LLAMA_SRC" -B "$BUILD" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_OPENMP=ON -DGGML_CCACHE=OFF -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF \
  -DLLAMA_BUILD_COMMIT="$COMMIT" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_EXE_LINKER_FLAGS="-static-libgcc -static-libstdc++" \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
  "${FLAGS[@]}"
T0=$(date +%s)
[ "$FORCE" = 1 ] && cmake --build "$BUILD" --target clean >/dev/null
TARGETS=(llama-bench); [ "$BATCHED" = 1 ] && TARGETS+=(llama-batched-bench)
CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" cmake --build "$BUILD" --target "${TARGETS[@]}" -j "$JOBS"
T1=$(date +%s)

# 3. collect the binary + libgomp, check that nothing else non-system is needed
BIN="$(find "$BUILD" -type f -name llama-bench -perm -u+x | head -1)"
[ -n "$BIN" ] || { echo "llama-bench not produced" >&2; exit 1; }
install -m 0755 "$BIN" "$OUT_DIR/llama-bench"
if [ "$BATCHED" = 1 ]; then
  BBIN="$(find "$BUILD" -type f -name llama-batched-bench -perm -u+x | head -1)"
  [ -n "$BBIN" ] || { echo "llama-batched-bench not produced" >&2; exit 1; }
  install -m 0755 "$BBIN" "$OUT_DIR/llama-batched-bench"
fi
GOMP="$(ldd "$BIN" | awk '$1=="libgomp.so.1"{print $3}')"
if [ -n "$GOMP" ]; then install -m 0644 "$(readlink -f "$GOMP")" "$OUT_DIR/libgomp.so.1"; fi
RUNPATH="$(readelf -d "$OUT_DIR/llama-bench" | grep -E 'RUNPATH|RPATH' || true)"
NEEDED="$(readelf -d "$OUT_DIR/llama-bench" | awk '/NEEDED/{gsub(/[\[\]]/,"",$5); printf "%s ", $5}')"
GLIBC_MAX="$(objdump -T "$OUT_DIR/llama-bench" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"

cat > "$OUT_DIR/BUILD_INFO.txt" <<INFO
stamp: $STAMP
llama-cpp-python: $VERSION
llama.cpp commit: $COMMIT
sdist: $(basename "$SDIST") sha256=$(sha256sum "$SDIST" | cut -d' ' -f1)
compiler: $(${CXX:-c++} --version | head -1)
build host: $(uname -m) glibc $(ldd --version | head -1 | awk '{print $NF}'), $(date -u +%Y-%m-%dT%H:%M:%SZ)
build time: $((T1 - T0)) s with $JOBS jobs
cmake flags: $FLAGS_STR -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=ON -static-libgcc -static-libstdc++
needed: $NEEDED
${RUNPATH:+dynamic: $(echo "$RUNPATH" | awk '{print $2, $NF}')}
max glibc symbol version: $GLIBC_MAX
INFO
echo "== built in $((T1 - T0)) s"
cat "$OUT_DIR/BUILD_INFO.txt"
# sanity: the binary starts and resolves libgomp from $ORIGIN
env -u LD_LIBRARY_PATH "$OUT_DIR/llama-bench" --help >/dev/null
[ "$BATCHED" = 0 ] || env -u LD_LIBRARY_PATH "$OUT_DIR/llama-batched-bench" --help >/dev/null
ldd "$OUT_DIR/llama-bench"
echo "OK: $OUT_DIR/llama-bench"
