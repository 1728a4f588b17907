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
# run the result. The build steps are shared with build_llama_server.sh
# (llama_peer_build.sh).
#
# usage: tools/peer/build_llama_bench.sh OUT_DIR [options]
#   --version V     llama-cpp-python version whose vendored llama.cpp is built
#                   (default: $PEER_LLAMA_CPP_PYTHON_VERSION or 0.3.36)
#   --sdist FILE    use this llama_cpp_python-*.tar.gz instead of the cached/downloaded one
#   --work DIR      extract/build directory (default $PEER_WORK, else build-peer/llama.cpp
#                   under the repository root)
#   --amx           also enable AMX-TILE/INT8/BF16 (Sapphire Rapids+). ggml only uses
#                   AMX after a runtime check, but the default build leaves it off.
#   --avx2          AVX2 baseline only, no AVX-512 (hosts without it, e.g. the development machine)
#   --jobs N        parallel build jobs (default 2; the dev machine has 2 shared cores)
#   --force         clean rebuild even if OUT_DIR already holds this exact build
#   --batched       also build llama-batched-bench (B sequences decoded together: the peer of
#                   `kvbridge bench decode --batch B`; same libraries, one more small target)
#
# Result: OUT_DIR/llama-bench (and with --batched OUT_DIR/llama-batched-bench), OUT_DIR/libgomp.so.1,
# OUT_DIR/BUILD_INFO.txt
# Copy the whole OUT_DIR to the benchmark host.
set -euo pipefail
# shellcheck source=llama_peer_build.sh
. "$(dirname "$0")/llama_peer_build.sh"
PEER_TARGET=llama-bench
PEER_ALSO=()
PEER_EXTRA_CMAKE=(-DLLAMA_BUILD_SERVER=OFF)
args=()
for a in "$@"; do
  if [ "$a" = --batched ]; then PEER_ALSO=(llama-batched-bench); else args+=("$a"); fi
done
peer_main "${args[@]}"
