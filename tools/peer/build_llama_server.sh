#!/usr/bin/env bash
# Build llama.cpp's official `llama-server` (CPU backend) from the llama.cpp vendored
# in the pinned llama-cpp-python sdist, with the same portable flags and static
# linking as build_llama_bench.sh (shared steps in llama_peer_build.sh). It is the
# stock decoder kvbridge writes slot files for: `--slot-save-path DIR` and
# `POST /slots/ID?action=save|restore`. The embedded web UI is left out (no npm, no
# download): the server's HTTP API is all kvbridge uses. No Python is needed to run it.
#
# usage: tools/peer/build_llama_server.sh OUT_DIR [options]
#   --version V, --sdist FILE, --work DIR, --amx, --avx2, --jobs N, --force
#                   as in llama_peer_build.sh
#
# Result: OUT_DIR/llama-server, OUT_DIR/libgomp.so.1, OUT_DIR/BUILD_INFO.txt
set -euo pipefail
# shellcheck source=llama_peer_build.sh
. "$(dirname "$0")/llama_peer_build.sh"
PEER_TARGET=llama-server
PEER_ALSO=()
PEER_EXTRA_CMAKE=(-DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
                  -DLLAMA_USE_PREBUILT_UI=OFF)
peer_main "$@"
