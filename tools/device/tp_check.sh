#!/usr/bin/env bash
# tools/device/tp_check.sh — tensor-parallel prefill on the GPU host, in one call. From the repo
# root, with binaries packed by `tools/device/gpu_check.sh --pack BUILD_DIR DIR`:
#
#   KVB_PREBUILT=DIR tools/device/tp_check.sh
#
# 1. the GPU tests that cover it: test_cuda_tp_comm (the all-reduce: the engine's own with 2-4
#    ranks on one device, NCCL with one rank, and two when the host has two GPUs), test_cuda_tp
#    (TP 2 and 4 vs TP 1 on the tiny presets), test_cuda_kernels, test_cuda_engine;
# 2. the Llama-3.1-8B shape (bf16, generated): `bench prefill --device cuda` at $SIZES with one
#    GPU and with --gpus $GPUS (on one device unless the host has $GPUS GPUs: then NCCL), again
#    with the all-reduces overlapped (KVB_TP_OVERLAP=1), and the
#    last prompt token's logits of both (`run --logits-out`) compared (rel-L2, top-1);
# 3. a bridged conversation over the tensor-parallel prefill node (`demo --device cuda --gpus`),
#    `kvbridge verify --device cuda --gpus $GPUS`, and `bench ladder` on the llama3.2-1b shape
#    (Q8_0) at $LADDER_LENGTHS with --gpus;
# 4. stage "big" (not in the default list; ~45 GB of free disk): the
#    Llama-3.1-70B shape generated in Q4_0 (~40 GB; 141 GB as bf16, which one H200 holds only with
#    an 8K-token cache — a single GPU runs it with packed weights, --gpu-weights) prefilled at 8K
#    and 32K tokens with --gpus $GPUS, or on one GPU when the host has fewer.
# Logs under $OUT (default /tmp/kvb-tp-check); the summary is printed last. Knobs: SIZES
# (8192,32768) REPS (2) GPUS (2) STAGES ("tests bench logits loop"; add "big") MODELS_DIR (/tmp/kvb-models)
# LADDER_LENGTHS (8192,32768) DEADLINE (seconds for the whole script, default 570).
set -u
export NCCL_NVLS_ENABLE=0 # NVLink multicast stays off on these hosts (the engine sets it too)
OUT=${OUT:-/tmp/kvb-tp-check}
MD=${MODELS_DIR:-/tmp/kvb-models}
SIZES=${SIZES:-8192,32768}
REPS=${REPS:-2}
GPUS=${GPUS:-2}
STAGES=${STAGES:-"tests bench logits loop"}
LADDER_LENGTHS=${LADDER_LENGTHS:-8192,32768}
DEADLINE=${DEADLINE:-570}
BIN=${KVB_PREBUILT:?set KVB_PREBUILT to the packed binaries}
K="$BIN/kvbridge"
export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
. "$(dirname "$0")/cudnn_env.sh" # cuDNN for the engine's fused attention (dlopen), when the host has it
mkdir -p "$OUT" "$MD"
LOG="$OUT/run.log"
T0=$(date +%s)
SUMMARY=()
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
add() { SUMMARY+=("$1"); }
want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
tmo() { local left=$((DEADLINE - ($(date +%s) - T0) - 5)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
NDEV=$(nvidia-smi -L 2>/dev/null | wc -l)
ONE=""
[ "$NDEV" -lt "$GPUS" ] && ONE="--tp-one-device"
if [ "$GPUS" = 1 ]; then say "host: $NDEV GPU(s); --gpus 1 (one GPU)"
else say "host: $NDEV GPU(s); --gpus $GPUS ${ONE:-(NCCL over $GPUS devices)}"; fi

gen() { # gen PRESET TYPE -> path
  local f="$MD/$1-$2.gguf"
  [ -f "$f" ] || "$K" gen-model --preset "$1" --type "$2" --out "$f.tmp" --quiet --threads "$(nproc)" >>"$LOG" 2>&1 &&
    mv "$f.tmp" "$f"
  echo "$f"
}
if want bench || want logits; then (gen llama3.1-8b bf16 >/dev/null) & GEN8=$!; fi

if want tests; then
  for t in test_cuda_tp_comm test_cuda_tp test_cuda_kernels test_cuda_engine; do
    [ -x "$BIN/$t" ] || { add "$t: not packed"; continue; }
    say "$t"
    if timeout "$(tmo 240)" "$BIN/$t" >"$OUT/$t.log" 2>&1; then add "$t: PASS"; else add "$t: FAIL (rc $?)"; fi
    grep -E "worst rel-L2|skipp|NCCL|in-engine|PASSED|FAILED" "$OUT/$t.log" | head -40 >>"$LOG"
  done
fi

if want bench || want logits; then wait "$GEN8"; fi
M8="$MD/llama3.1-8b-bf16.gguf"
if want bench && [ -f "$M8" ]; then
  for g in 1 "$GPUS"; do
    extra=""
    [ "$g" != 1 ] && extra="--gpus $g $ONE"
    say "bench prefill 8B, gpus $g $extra"
    timeout "$(tmo 200)" "$K" bench prefill -m "$M8" --device cuda --tokens "$SIZES" --reps "$REPS" --ceiling-reps 5 \
      $extra >"$OUT/bench-tp$g.log" 2>&1 || add "bench prefill gpus $g: rc $?"
    grep -E "^device|tok/s|^ceiling|^ *[0-9]+ " "$OUT/bench-tp$g.log" | head -12 | sed "s/^/  [tp$g] /" | tee -a "$LOG"
  done
  # the same with the all-reduces beside the GEMMs (kvb_cuda_opts.tp_overlap, off by default)
  say "bench prefill 8B, gpus $GPUS $ONE, KVB_TP_OVERLAP=1"
  KVB_TP_OVERLAP=1 timeout "$(tmo 200)" "$K" bench prefill -m "$M8" --device cuda --tokens "$SIZES" --reps "$REPS" \
    --ceiling-reps 5 --gpus "$GPUS" $ONE >"$OUT/bench-tp${GPUS}o.log" 2>&1 || add "bench prefill overlapped: rc $?"
  grep -E "^ *[0-9]+ " "$OUT/bench-tp${GPUS}o.log" | head -4 | sed "s/^/  [tp${GPUS}, overlapped] /" | tee -a "$LOG"
  # TP$GPUS / TP1 tok/s per size (the table rows: tokens, tok/s, ...), plain and overlapped
  while read -r n t1; do
    tg=$(awk -v n="$n" '$1 == n && $2 ~ /^[0-9]+$/ {print $2}' "$OUT/bench-tp$GPUS.log" | head -1)
    to=$(awk -v n="$n" '$1 == n && $2 ~ /^[0-9]+$/ {print $2}' "$OUT/bench-tp${GPUS}o.log" | head -1)
    [ -n "$tg" ] && add "8B bf16 prefill, $n tokens: TP1 $t1 tok/s, TP$GPUS ${ONE:+(one device) }$tg tok/s, ratio $(awk -v a="$tg" -v b="$t1" 'BEGIN {printf "%.3f", a / b}')${to:+; overlapped $to tok/s, ratio $(awk -v a="$to" -v b="$t1" 'BEGIN {printf "%.3f", a / b}')}"
  done < <(awk '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF >= 5 {print $1, $2}' "$OUT/bench-tp1.log")
fi

if want logits && [ -f "$M8" ]; then
  TOK=$(python3 -c "import random; r=random.Random(7); print(','.join(str(r.randrange(128000)) for _ in range(3000)))")
  for g in 1 "$GPUS"; do
    extra=""
    [ "$g" != 1 ] && extra="--gpus $g $ONE"
    say "logits 8B, gpus $g"
    timeout "$(tmo 120)" "$K" run -m "$M8" --device cuda --tokens "$TOK" -n 0 --logits-out "$OUT/logits-tp$g.bin" \
      $extra >"$OUT/run-tp$g.log" 2>&1 || add "run gpus $g: rc $?"
  done
  python3 - "$OUT/logits-tp1.bin" "$OUT/logits-tp$GPUS.bin" <<'PY' 2>&1 | tee -a "$LOG" | while read -r l; do add "$l"; done
import sys, numpy as np
a = np.fromfile(sys.argv[1], dtype="<f4"); b = np.fromfile(sys.argv[2], dtype="<f4")
if a.size == 0 or a.size != b.size: print(f"logits: sizes {a.size} vs {b.size}"); sys.exit()
rel = float(np.linalg.norm(b.astype(np.float64) - a) / np.linalg.norm(a.astype(np.float64)))
print(f"logits 8B, 3000-token prompt, TP vs TP1: rel-L2 {rel:.3g}, top-1 {'same' if a.argmax() == b.argmax() else 'DIFFERENT'}, top-5 overlap {len(set(np.argsort(a)[-5:]) & set(np.argsort(b)[-5:]))}/5")
PY
fi

if want loop; then
  say "demo over --gpus $GPUS"
  timeout "$(tmo 120)" "$K" demo --device cuda --gpus "$GPUS" $ONE --threads 8 >"$OUT/demo.log" 2>&1 ||
    add "demo: rc $?"
  grep -E "complete|partial|declined|identical|turn" "$OUT/demo.log" | head -14 | tee -a "$LOG"
  add "demo: $(grep -c complete "$OUT/demo.log") 'complete' lines; $(grep -iE 'identical' "$OUT/demo.log" | head -1)"
  say "verify --device cuda --gpus $GPUS"
  timeout "$(tmo 120)" "$K" verify --device cuda --gpus "$GPUS" --bytes-at none >"$OUT/verify.log" 2>&1
  add "verify --gpus $GPUS: $(tail -1 "$OUT/verify.log")"
  M1=$(gen llama3.2-1b q8_0)
  if [ -f "$M1" ]; then
    say "ladder 1B q8_0 over --gpus $GPUS at $LADDER_LENGTHS"
    timeout "$(tmo 240)" "$K" bench ladder -m "$M1" --device cuda --gpus "$GPUS" $ONE --lengths "$LADDER_LENGTHS" \
      --seeds 1 --alone-max 0 >"$OUT/ladder.log" 2>&1 || add "ladder: rc $?"
    grep -vE "^\s*$" "$OUT/ladder.log" | tail -20 | tee -a "$LOG"
  fi
fi
if want big; then
  # on the GPUs the host has: $GPUS of them (bf16 shards), or one when it has fewer (--gpus 1:
  # the engine's auto weights choose packed, since the bf16 form does not fit with a 32K cache)
  BIG_GPUS=$GPUS
  [ -n "$ONE" ] && BIG_GPUS=1
  say "gen llama3.1-70b q4_0 (~40 GB)"
  M70=$(gen llama3.1-70b q4_0)
  if [ -f "$M70" ]; then
    say "bench prefill 70B, gpus $BIG_GPUS"
    timeout "$(tmo 400)" "$K" bench prefill -m "$M70" --device cuda --tokens 8192,32768 --reps 2 --ceiling-reps 3 \
      --gpus "$BIG_GPUS" >"$OUT/bench-70b.log" 2>&1 || add "bench prefill 70B: rc $?"
    grep -E "^device|^ *[0-9]+ " "$OUT/bench-70b.log" | head -5 | tee -a "$LOG"
    add "70B shape, --gpus $BIG_GPUS: $(awk '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF > 4 {printf "%s tokens %s tok/s; ", $1, $2}' "$OUT/bench-70b.log")"
  else
    add "big: the 70B file could not be generated (disk?)"
  fi
fi
echo "==== summary ($(($(date +%s) - T0)) s)" | tee -a "$LOG"
for s in "${SUMMARY[@]}"; do echo "$s" | tee -a "$LOG"; done
