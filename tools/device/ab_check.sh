#!/usr/bin/env bash
# tools/device/ab_check.sh — one build against another on the GPU host, in one call: every GPU
# test and `kvbridge verify --device cuda` of each, then (stage "ladder") the CUDA ladder of each,
# alternated, so a change that should keep behaviour and speed is judged in the same call. From the
# repo root there, with both builds packed here by `tools/device/gpu_check.sh --pack BUILD_DIR DIR`:
#
#   A=DIR_OLD B=DIR_NEW tools/device/ab_check.sh
#
# Stages (STAGES, default "tests verify ladder", run in the order given):
#   tests   every test_cuda_* binary of each build in TEST_BUILDS (default "A B"; a test a build
#           lacks is listed as absent),
#           with the qwen3-0.6b and llama3.2-1b bf16 presets for the real-shape cases
#   verify  kvbridge verify --device cuda on tiny .. llama3.2-1b (every row N/N), each build
#   ladder  bench ladder --device cuda on the llama3.2-1b shape (Q8_0, f16 cache) at LENGTHS,
#           decoder alone not run, SEEDS prompts per length, ROUNDS rounds alternating A then B
# Logs under $OUT (default /tmp/kvb-ab-check): tests.txt, verify.txt, ladder.txt, each build's
# lines side by side. DEADLINE (seconds, default 570) bounds the whole; a step that cannot finish
# in time is skipped and said so.
set -u
A=${A:?set A to the packed old build}
B=${B:?set B to the packed new build}
OUT=${OUT:-/tmp/kvb-ab-check}
MD=${MODELS_DIR:-/tmp/kvb-models}
STAGES=${STAGES:-"tests verify ladder"}
LENGTHS=${LENGTHS:-8192,32768,131072}
SEEDS=${SEEDS:-2}
ROUNDS=${ROUNDS:-2}
DEADLINE=${DEADLINE:-570}
TEST_BUILDS=${TEST_BUILDS:-"A B"}
VERIFY_PRESETS=${VERIFY_PRESETS:-"tiny tiny-qwen2 tiny-qwen3 tiny-llama3 tiny-gemma3 qwen3-0.6b llama3.2-1b"}
T0=$(date +%s)
mkdir -p "$OUT" "$MD"
left() { echo $((DEADLINE - ($(date +%s) - T0) - 5)); }
say() { echo "[$(($(date +%s) - T0))s] $*"; }
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
A=$(abs "$A")
B=$(abs "$B")
# cuBLAS 13 from the toolkit or PyTorch's wheels, cuDNN for the fused attention (dlopen)
. "$(dirname "$0")/cublas_env.sh"
. "$(dirname "$0")/cudnn_env.sh"
with() { LD_LIBRARY_PATH="$1/lib:$LD_LIBRARY_PATH" "${@:2}"; } # with BUILD CMD...: its own libraries
say "ab_check on $(hostname): $(nproc) CPUs; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
gen() { # gen PRESET TYPE -> path (made by build B)
  local f=$MD/$1-$2.gguf
  [ -s "$f" ] || with "$B" "$B/kvbridge" gen-model --preset "$1" --type "$2" --out "$f" --quiet --threads "$(nproc)" >&2
  echo "$f"
}
stage_tests() {
  models="$(gen qwen3-0.6b bf16),$(gen llama3.2-1b bf16)"
  for t in $(cd "$B" && ls test_cuda_*; cd "$A" && ls test_cuda_*); do echo "$t"; done | sort -u >"$OUT/test_list"
  while read -r t; do
    for w in $TEST_BUILDS; do
      d=${!w}
      if [ ! -x "$d/$t" ]; then echo "$w $t: absent in this build" | tee -a "$OUT/tests.txt"; continue; fi
      [ "$(left)" -gt 20 ] || { echo "$w $t: skipped (out of time)" | tee -a "$OUT/tests.txt"; continue; }
      KVB_BIN=$d/kvbridge KVB_CUDA_TEST_MODELS=$models with "$d" timeout "$(left)" "$d/$t" >"$OUT/$w.$t.log" 2>&1
      rc=$?
      echo "$w $t: exit $rc; $(grep -E '^kvbt:|PASSED|FAILED' "$OUT/$w.$t.log" | tr '\n' ' ')" | tee -a "$OUT/tests.txt"
    done
  done <"$OUT/test_list"
  cat "$OUT"/A.test_cuda_*.log "$OUT"/B.test_cuda_*.log 2>/dev/null | grep -E 'rel-L2|FAILED|ERROR' | head -40 >>"$OUT/tests.txt"
  rm -f "$OUT"/A.test_cuda_*.log "$OUT"/B.test_cuda_*.log
}
stage_verify() {
  vp=""
  for p in $VERIFY_PRESETS; do vp="$vp --preset $p"; done
  for w in A B; do
    d=${!w}
    say "== $w: verify --device cuda"
    # shellcheck disable=SC2086 # one word per preset flag
    (cd "$MD" && with "$d" timeout "$(left)" "$d/kvbridge" verify --device cuda $vp) >"$OUT/$w.verify" 2>&1
    echo "$w verify rc=$?" | tee -a "$OUT/verify.txt"
    grep -vE '^\s*$' "$OUT/$w.verify" | tail -25 >>"$OUT/verify.txt"
  done
  rm -f "$OUT"/A.verify "$OUT"/B.verify
  tail -60 "$OUT/verify.txt"
}
stage_ladder() {
  f=$(gen llama3.2-1b q8_0)
  for r in $(seq 1 "$ROUNDS"); do
    for w in A B; do
      d=${!w}
      [ "$(left)" -gt 60 ] || { echo "round $r $w: skipped (out of time)" | tee -a "$OUT/ladder.txt"; continue; }
      say "== round $r, $w: CUDA ladder at $LENGTHS"
      with "$d" timeout "$(left)" "$d/kvbridge" bench ladder --device cuda -m "$f" --lengths "$LENGTHS" --seeds "$SEEDS" \
        --alone-max 0 --cache-type f16 >"$OUT/$w.ladder" 2>&1
      echo "-- round $r, $w (rc $?)" >>"$OUT/ladder.txt"
      grep -E '^ +[0-9]+ |bridged phases|floor|verdict' "$OUT/$w.ladder" >>"$OUT/ladder.txt"
    done
  done
  rm -f "$OUT"/A.ladder "$OUT"/B.ladder
  cat "$OUT/ladder.txt"
}
for st in $STAGES; do
  case $st in tests | verify | ladder) "stage_$st" ;; *) say "unknown stage $st" ;; esac
done
say "done"
