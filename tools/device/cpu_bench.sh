#!/usr/bin/env bash
# CPU engine benchmarks on the H200 host's 16 Xeon cores (run from the repo root there), beside
# llama.cpp's llama-bench on the same files and threads. Expects the carried folder .devcarry/
# with kvbridge, its shared libraries (lib/) and llama-bench (built portable here: see
# tools/peer/build_llama_bench.sh). Writes logs under $OUT and prints a summary last.
set -uo pipefail
D=.devcarry
export LD_LIBRARY_PATH="$PWD/$D/lib:$PWD/$D/llama"
K=$D/kvbridge
LB=$D/llama/llama-bench
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T=${THREADS:-16}
{
  echo "== machine"; nproc; lscpu | grep -E 'Model name|Flags' | cut -c1-200
  echo "== generate models"
  MODELS=${MODELS:-"tiny llama3.2-1b llama3.1-8b"}
  for p in $MODELS; do spec="$p q8_0"
    set -- $spec
    /usr/bin/time -f "gen $1: %e s wall, %M KB max RSS" $K gen-model --preset $1 --type $2 --out /tmp/$1-$2.gguf --quiet --threads $T
  done
  ls -la /tmp/*.gguf
  for m in $MODELS; do
    f=/tmp/$m-q8_0.gguf
    echo "== $m decode ($T threads)"
    $K bench decode -m $f --threads $T --gen 64 --reps 3 --llama-bench $LB --json $OUT/$m-decode.json
    echo "== $m prefill ($T threads)"
    $K bench prefill -m $f --threads $T --tokens 512 --reps 3 --llama-bench $LB --json $OUT/$m-prefill.json
  done
  for t in ${FEW_THREADS-4 8}; do
    echo "== llama3.1-8b decode ($t threads)"
    $K bench decode -m /tmp/llama3.1-8b-q8_0.gguf --threads $t --gen 32 --reps 3 --llama-bench $LB --json $OUT/8b-decode-t$t.json
  done
} 2>&1 | tee $OUT/cpu_bench.log
echo "== summary"
cat $OUT/*.json
