#!/usr/bin/env bash
# tools/device/mla_gpu_check.sh — DeepSeek's latent attention and routing in the CUDA engine on the
# GPU host, in one call: test_cuda_moe (DeepSeek's router kernel against its twin, the twin against
# the float64 reference's routing, the MLA kernels against their twins, one MLA layer against a
# float64 twin, tiny-mla end to end against the CPU engine and
# chunked == one-shot; the qwen3moe cases too, since the router kernel is shared) and
# test_cuda_kernels' attention cases (the tensor-core kernel at head size 192, which the expanded
# latent attention runs on); `kvbridge demo --device cuda` on tiny-mla (a CUDA prefill node on this
# engine, the CUDA bridge's latent rows, a CPU decode node; its replies against the native ones are
# reported, not held: the decoder's rows come from the GPU's attention inputs); then the
# deepseek-v2-lite shape (gen-model --type TYPE, written meanwhile on all cores): `bench prefill
# --device cuda` at SIZES, printing tok/s; then, while time
# is left, a DeepSeek-V3 layer subset (gen-model --layers V3_LAYERS: 3 dense + 1 MoE layer with the
# defaults) at V3_SIZES, and the real-shape case of test_cuda_moe on the V2-Lite file (32 tokens,
# GPU vs CPU engine). From the repo root there, with a build packed here by
# `tools/device/gpu_check.sh --pack BUILD_DIR DIR`:
#
#   B=DIR tools/device/mla_gpu_check.sh
#
# STAGES (default "tests demo bench v3 real"), SIZES (default 8192,32768), TYPE (default q8_0),
# V3_LAYERS (default 4), V3_SIZES (default 8192), DEADLINE (seconds, default 420). Logs under $OUT
# (default /tmp/kvb-mla-check): mla.txt is the summary.
set -u
B=${B:?set B to the packed build}
OUT=${OUT:-/tmp/kvb-mla-check}
MD=${MODELS_DIR:-/tmp/kvb-models}
STAGES=${STAGES:-"tests demo bench v3 real"}
SIZES=${SIZES:-8192,32768}
TYPE=${TYPE:-q8_0}
V3_LAYERS=${V3_LAYERS:-4}
V3_SIZES=${V3_SIZES:-8192}
DEADLINE=${DEADLINE:-420}
mkdir -p "$OUT" "$MD"
LOG=$OUT/mla.txt
. "$(dirname "$0")/stages.sh" # T0, left, want, say
case $B in /*) ;; *) B=$PWD/$B ;; esac
. "$(dirname "$0")/cublas_env.sh"
. "$(dirname "$0")/cudnn_env.sh"
export LD_LIBRARY_PATH="$B/lib:$LD_LIBRARY_PATH"
say "mla_gpu_check on $(hostname): $(nproc) CPUs; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
LITE=$MD/deepseek-v2-lite-$TYPE.gguf
V3=$MD/deepseek-v3-${V3_LAYERS}l-$TYPE.gguf
GEN=""
if want bench || want real; then # the V2-Lite file is written meanwhile (all cores), then the V3 subset;
  # FILE.ok marks a file written whole
  ( [ -e "$LITE.ok" ] || { "$B/kvbridge" gen-model --preset deepseek-v2-lite --type "$TYPE" --out "$LITE" --quiet \
      --threads "$(nproc)" >"$OUT/gen.log" 2>&1 && touch "$LITE.ok"; }
    if want v3 && [ ! -e "$V3.ok" ]; then
      "$B/kvbridge" gen-model --preset deepseek-v3 --layers "$V3_LAYERS" --type "$TYPE" --out "$V3" --quiet \
        --threads "$(nproc)" >"$OUT/gen_v3.log" 2>&1 && touch "$V3.ok"
    fi ) &
  GEN=$!
fi
if want tests; then
  say "test_cuda_moe (DeepSeek routing, MLA kernels, tiny-mla end to end; qwen3moe)"
  KVB_BIN=$B/kvbridge KVB_TEST_EXCLUDE=test_moe_real_shapes timeout "$(left)" "$B/test_cuda_moe" \
    >"$OUT/test_cuda_moe.log" 2>&1
  say "test_cuda_moe: exit $?; $(grep -E '^kvbt:' "$OUT/test_cuda_moe.log" | tr '\n' ' ')"
  grep -E 'router|latent|query rope|expansion|tiny-mla|packed|rel-L2|max abs|FAILED|ERROR|failed' \
    "$OUT/test_cuda_moe.log" | head -40 >>"$LOG"
  say "test_cuda_kernels attention (head size 192 among them)"
  KVB_TEST_FILTER=test_attention timeout "$(left)" "$B/test_cuda_kernels" >"$OUT/test_cuda_kernels.log" 2>&1
  say "test_cuda_kernels: exit $?; $(grep -E '^kvbt:' "$OUT/test_cuda_kernels.log" | tr '\n' ' ')"
  grep -E 'D192|FAILED|ERROR|failed' "$OUT/test_cuda_kernels.log" | head -10 >>"$LOG"
fi
if want demo; then
  say "demo --device cuda on tiny-mla (CUDA prefill node -> CPU decode node)"
  ( cd "$OUT" && "$B/kvbridge" gen-model --preset tiny-mla --type q8_0 --out tiny-mla-q8_0.gguf --quiet &&
    timeout "$(left)" "$B/kvbridge" demo --device cuda -m tiny-mla-q8_0.gguf --turns 3 ) >"$OUT/demo.log" 2>&1
  say "demo: exit $?; $(grep -E 'replies identical|Error|error' "$OUT/demo.log" | head -3 | tr '\n' ' ')"
fi
bench() { # FILE SIZES TAG
  say "bench prefill --device cuda, $3 at $2"
  timeout "$(left)" "$B/kvbridge" bench prefill --device cuda -m "$1" --tokens "$2" --reps 2 --ceiling-reps 5 \
    --json "$OUT/bench_$3.json" >"$OUT/bench_$3.txt" 2>&1
  say "bench $3: exit $?"
  cat "$OUT/bench_$3.txt" >>"$LOG"
}
if want bench; then
  while [ ! -e "$LITE.ok" ] && kill -0 "$GEN" 2>/dev/null && [ "$(left)" -gt 60 ]; do sleep 2; done
  if [ -e "$LITE.ok" ]; then
    say "V2-Lite file: $(du -h "$LITE" | cut -f1)"
    bench "$LITE" "$SIZES" v2lite
  else
    say "V2-Lite file not written in time:"
    tail -5 "$OUT/gen.log" >>"$LOG" 2>/dev/null
  fi
fi
if want v3 && [ -n "$GEN" ]; then
  while [ ! -e "$V3.ok" ] && kill -0 "$GEN" 2>/dev/null && [ "$(left)" -gt 90 ]; do sleep 2; done
  if [ -e "$V3.ok" ] && [ "$(left)" -gt 60 ]; then
    say "V3 subset ($V3_LAYERS layers) file: $(du -h "$V3" | cut -f1)"
    bench "$V3" "$V3_SIZES" v3_${V3_LAYERS}l
  else
    say "V3 subset: skipped (file not ready or out of time)"
  fi
fi
if want real && [ -e "$LITE.ok" ] && [ "$(left)" -gt 90 ]; then
  say "test_cuda_moe real shape on $LITE"
  KVB_BIN=$B/kvbridge KVB_CUDA_TEST_MOE_MODELS=$LITE KVB_TEST_FILTER='test_moe_real_shapes' timeout "$(left)" \
    "$B/test_cuda_moe" >"$OUT/real.log" 2>&1
  say "real shape: exit $?"
  grep -E 'rel|median|top-1|FAILED|ERROR|PASSED' "$OUT/real.log" | tail -8 >>"$LOG"
fi
say "done"
