#!/usr/bin/env bash
# tools/device/moe_gpu_check.sh — the CUDA engine's mixture of experts on the GPU host, in one call:
# test_cuda_moe (kernels against their CPU twins, tiny-moe end to end), `kvbridge verify --device
# cuda --preset tiny-moe`, then the qwen3-30b-a3b shape: `bench prefill --device cuda` at SIZES with
# the per-expert GEMM loop and with the grouped GEMM (KVB_CUDA_MOE_GEMM), beside PyTorch +
# transformers' Qwen3MoeForCausalLM (tools/peer/torch_moe_prefill.py) on the same card and sizes,
# and the real-shape case of test_cuda_moe against the CPU engine. From the repo root there, with
# a build packed here by `tools/device/gpu_check.sh --pack BUILD_DIR DIR`:
#
#   B=DIR tools/device/moe_gpu_check.sh
#
# GEMMS (default "loop grouped": the bench stage's MoE GEMM ways), STAGES (default "tests verify bench peer real"; "verify30" adds `kvbridge verify --device cuda -m` on the
# 30B file: the CUDA bridge's rows against the CPU decoder's on the real shape), SIZES (default 8192,32768), TYPE of the 30B file
# (default q8_0: 32 GB on disk, expanded to bf16 on the GPU), DEADLINE (seconds, default 570).
# Logs under $OUT (default /tmp/kvb-moe-check): moe.txt is the summary.
set -u
B=${B:?set B to the packed build}
OUT=${OUT:-/tmp/kvb-moe-check}
MD=${MODELS_DIR:-/tmp/kvb-models}
STAGES=${STAGES:-"tests verify bench peer real"}
SIZES=${SIZES:-8192,32768}
TYPE=${TYPE:-q8_0}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT" "$MD"
LOG=$OUT/moe.txt
. "$(dirname "$0")/stages.sh" # T0, left, want, say
case $B in /*) ;; *) B=$PWD/$B ;; esac
. "$(dirname "$0")/cublas_env.sh"
. "$(dirname "$0")/cudnn_env.sh"
export LD_LIBRARY_PATH="$B/lib:$LD_LIBRARY_PATH"
say "moe_gpu_check on $(hostname): $(nproc) CPUs; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
BIG=$MD/qwen3-30b-a3b-$TYPE.gguf
GEN=""
if want bench || want real || want verify30; then # the 30B file is written meanwhile (all cores)
  if [ ! -s "$BIG" ]; then
    "$B/kvbridge" gen-model --preset qwen3-30b-a3b --type "$TYPE" --out "$BIG" --quiet --threads "$(nproc)" \
      >"$OUT/gen.log" 2>&1 &
    GEN=$!
  fi
fi
if want tests; then
  say "test_cuda_moe"
  KVB_BIN=$B/kvbridge timeout "$(left)" "$B/test_cuda_moe" >"$OUT/test_cuda_moe.log" 2>&1
  say "test_cuda_moe: exit $?; $(grep -E '^kvbt:|PASSED|FAILED' "$OUT/test_cuda_moe.log" | tr '\n' ' ')"
  grep -E 'rel|max|FAILED|ERROR|margin' "$OUT/test_cuda_moe.log" | head -30 >>"$LOG"
fi
if want verify; then
  say "verify --device cuda --preset tiny-moe"
  (cd "$MD" && timeout "$(left)" "$B/kvbridge" verify --device cuda --preset tiny-moe) >"$OUT/verify.log" 2>&1
  say "verify: exit $?"
  grep -vE '^\s*$' "$OUT/verify.log" | tail -15 >>"$LOG"
fi
if [ -n "$GEN" ]; then
  say "waiting for the 30B file"
  wait "$GEN" || { say "gen qwen3-30b-a3b failed:"; tail -5 "$OUT/gen.log" >>"$LOG"; }
  say "30B file: $(du -h "$BIG" | cut -f1)"
fi
if want bench && [ -s "$BIG" ]; then
  for g in ${GEMMS:-loop grouped}; do
    [ "$(left)" -gt 60 ] || { say "bench $g: skipped (out of time)"; continue; }
    say "bench prefill --device cuda, qwen3-30b-a3b $TYPE at $SIZES, KVB_CUDA_MOE_GEMM=$g"
    KVB_CUDA_MOE_GEMM=$g timeout "$(left)" "$B/kvbridge" bench prefill --device cuda -m "$BIG" --tokens "$SIZES" \
      --reps 2 --ceiling-reps 5 --json "$OUT/bench_$g.json" >"$OUT/bench_$g.txt" 2>&1
    say "bench $g: exit $?"
    cat "$OUT/bench_$g.txt" >>"$LOG"
  done
fi
if want peer && [ "$(left)" -gt 90 ]; then
  say "PyTorch peer (Qwen3MoeForCausalLM, 30B-A3B shape, random bf16) at $SIZES"
  PYTHONUNBUFFERED=1 timeout "$(left)" python3 tools/peer/torch_moe_prefill.py --tokens "$SIZES" --reps 2 \
    --out "$OUT/peer.json" >"$OUT/peer.txt" 2>"$OUT/peer.log"
  say "peer: exit $?"
  cat "$OUT/peer.txt" >>"$LOG"
  tail -5 "$OUT/peer.log" >>"$LOG"
fi
if want real && [ -s "$BIG" ] && [ "$(left)" -gt 60 ]; then
  say "test_cuda_moe real shapes on $BIG"
  KVB_BIN=$B/kvbridge KVB_CUDA_TEST_MOE_MODELS=$BIG KVB_TEST_FILTER='test_moe_real_shapes' timeout "$(left)" \
    "$B/test_cuda_moe" >"$OUT/real.log" 2>&1
  say "real shapes: exit $?"
  grep -E 'rel|median|top-1|FAILED|ERROR|PASSED' "$OUT/real.log" | head -20 >>"$LOG"
fi
if want verify30 && [ -s "$BIG" ] && [ "$(left)" -gt 60 ]; then
  say "verify --device cuda -m $BIG (--bytes-at none)"
  (cd "$MD" && timeout "$(left)" "$B/kvbridge" verify --device cuda -m "$BIG" --bytes-at none) >"$OUT/verify30.log" 2>&1
  say "verify30: exit $?"
  grep -vE '^\s*$' "$OUT/verify30.log" | tail -15 >>"$LOG"
fi
say "done"
