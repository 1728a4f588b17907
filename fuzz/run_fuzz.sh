#!/usr/bin/env bash
# fuzz/run_fuzz.sh BUILD_DIR SECONDS — configures BUILD_DIR with clang and -DKVB_FUZZ=ON, builds
# the fuzzers (GGUF reader, tokenizer, wire protocol, HTTP request path, llama.cpp state file) and their seed
# generators, writes fresh seeds, and runs each with libFuzzer for SECONDS (default 60),
# KVB_FUZZ_JOBS of them at once (default 2: each fuzzer is one process on one core, so on CI's two
# cores two at a time give each its full SECONDS in half the wall time). Each fuzzer's output goes
# to BUILD_DIR/fuzz/NAME.log; its final statistics are printed, the whole log when it fails. Exits
# non-zero if a build fails or a fuzzer finds a crash, leak, timeout or sanitizer report (the
# reproducer is left in BUILD_DIR/fuzz/artifacts/). The corpora the runs grow are kept under
# BUILD_DIR/fuzz/ and reused by the next run.
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  echo "usage: $0 BUILD_DIR [SECONDS]" >&2
  exit 2
fi
build=$1
secs=${2:-60}
src=$(cd "$(dirname "$0")/.." && pwd)
jobs=${KVB_FUZZ_JOBS:-2}

cmake -S "$src" -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang -DKVB_FUZZ=ON -DKVB_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "$jobs" --target fuzz_gguf fuzz_gguf_seeds fuzz_tokenize fuzz_wire fuzz_wire_seeds \
  fuzz_http_request fuzz_http_seeds fuzz_llama_state fuzz_llama_state_seeds

work=$build/fuzz
mkdir -p "$work/artifacts"
fresh_seeds() { # fresh_seeds SEEDS_PROGRAM DIR: the seed writer's corpus, written anew
  rm -rf "$2"
  mkdir -p "$2"
  "$work/$1" "$2"
}
fresh_seeds fuzz_gguf_seeds "$work/seeds"
fresh_seeds fuzz_wire_seeds "$work/wireseeds"
fresh_seeds fuzz_http_seeds "$work/httpseeds"
fresh_seeds fuzz_llama_state_seeds "$work/llamaseeds"
mkdir -p "$work/corpus" "$work/tokcorpus" "$work/wirecorpus" "$work/httpcorpus" "$work/llamacorpus"

common=(-max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$work/artifacts/"
  -print_final_stats=1)
# one function per fuzzer: the GGUF reader (with its dictionary), the tokenizer's encoder on
# arbitrary bytes (with the shared vocabularies when present), the wire protocol's receive side and
# the decode node's HTTP request path (raw connection bytes through the head check, and bodies)
fuzz_gguf() { "$work/fuzz_gguf" "${common[@]}" -max_len=16384 -dict="$src/fuzz/gguf.dict" "$work/corpus" "$work/seeds"; }
fuzz_tokenize() {
  KVB_FUZZ_VOCAB_DIR="$src/../shared/vocab" "$work/fuzz_tokenize" "${common[@]}" -max_len=8192 "$work/tokcorpus"
}
fuzz_wire() { "$work/fuzz_wire" "${common[@]}" -max_len=8192 "$work/wirecorpus" "$work/wireseeds"; }
fuzz_http_request() { "$work/fuzz_http_request" "${common[@]}" -max_len=8192 "$work/httpcorpus" "$work/httpseeds"; }
fuzz_llama_state() { "$work/fuzz_llama_state" "${common[@]}" -max_len=4096 "$work/llamacorpus" "$work/llamaseeds"; }

failed=0
finish() { # finish NAME PID: waits for one fuzzer, prints its stats (its whole log if it failed)
  if wait "$2"; then
    echo "$1: passed"
    grep -E '^(stat::|Done )' "$work/$1.log" || true
  else
    echo "$1: FAILED (its log follows; reproducers in $work/artifacts/)"
    cat "$work/$1.log"
    failed=1
  fi
}
names=()
pids=()
for name in fuzz_gguf fuzz_tokenize fuzz_wire fuzz_http_request fuzz_llama_state; do
  echo "$name: running for $secs s (log $work/$name.log)"
  "$name" >"$work/$name.log" 2>&1 &
  names+=("$name")
  pids+=("$!")
  if [ "${#pids[@]}" -ge "$jobs" ]; then
    finish "${names[0]}" "${pids[0]}"
    names=("${names[@]:1}")
    pids=("${pids[@]:1}")
  fi
done
for i in "${!pids[@]}"; do finish "${names[$i]}" "${pids[$i]}"; done
exit "$failed"
