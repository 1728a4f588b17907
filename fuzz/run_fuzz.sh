#!/bin/sh
# fuzz/run_fuzz.sh BUILD_DIR SECONDS — configures BUILD_DIR with clang and -DKVB_FUZZ=ON, builds
# the fuzzers (GGUF reader, tokenizer, wire protocol, HTTP request parser) and their seed
# generators, writes fresh seeds, and runs each with libFuzzer for SECONDS (default 60). Exits
# non-zero if a build fails or a fuzzer finds a crash, leak, timeout or sanitizer report (the
# reproducer is left in BUILD_DIR/fuzz/artifacts/). The corpora the runs grow are kept under
# BUILD_DIR/fuzz/ and reused by the next run.
set -eu
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
cmake --build "$build" --target fuzz_gguf fuzz_gguf_seeds -j "$jobs"

work=$build/fuzz
rm -rf "$work/seeds"
mkdir -p "$work/seeds" "$work/corpus" "$work/artifacts"
"$work/fuzz_gguf_seeds" "$work/seeds"

echo "fuzz_gguf: running for $secs s (corpus $work/corpus, seeds $work/seeds)"
"$work/fuzz_gguf" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
  -dict="$src/fuzz/gguf.dict" -artifact_prefix="$work/artifacts/" -print_final_stats=1 \
  "$work/corpus" "$work/seeds"

# The tokenizer's encoder on arbitrary bytes (with the shared vocabularies when present).
cmake --build "$build" --target fuzz_tokenize -j "$jobs"
mkdir -p "$work/tokcorpus"
echo "fuzz_tokenize: running for $secs s"
KVB_FUZZ_VOCAB_DIR="$src/../shared/vocab" "$work/fuzz_tokenize" -max_total_time="$secs" -max_len=8192 -timeout=10 \
  -rss_limit_mb=2048 -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$work/tokcorpus"

# A fuzzer with a seed writer: build both, write fresh seeds, run for the same time budget.
run_seeded() { # run_seeded FUZZER SEEDS_PROGRAM NAME (corpus and seeds: $work/NAMEcorpus, $work/NAMEseeds)
  cmake --build "$build" --target "$1" "$2" -j "$jobs"
  rm -rf "$work/$3seeds"
  mkdir -p "$work/$3seeds" "$work/$3corpus"
  "$work/$2" "$work/$3seeds"
  echo "$1: running for $secs s (corpus $work/$3corpus, seeds $work/$3seeds)"
  "$work/$1" -max_total_time="$secs" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$work/$3corpus" "$work/$3seeds"
}

run_seeded fuzz_wire fuzz_wire_seeds wire                 # the wire protocol's receive side
run_seeded fuzz_http_request fuzz_http_seeds http         # the decode node's HTTP request parser
