#!/usr/bin/env bash
# tools/device/node_check.sh — the bridge and the closed loop on the H200 host, in one call (run
# from the repo root there). Uses binaries packed here with
#   tools/device/gpu_check.sh --pack BUILD_DIR .devcarry-gpu
# and carried as .devcarry-gpu. Stages (STAGES, default "tests verify cost ladder"):
#   tests   the gpu-labelled bridge tests (test_cuda_bridge, test_cuda_bridge_dev)
#   verify  kvbridge verify --device cuda on tiny..llama3.2-1b (every row N/N) and --perturb (must fail)
#   cost    bench prefill --device cuda --bridge f16 on the Llama-3.1-8B shape (Q8_0 file: a CPU
#           decoder's weights) at COST_SIZES: the bridge kernel's cost as a fraction of prefill time
#   ladder  bench ladder --device cuda on the llama3.2-1b shape (CUDA prefill node -> CPU decode
#           node on loopback) at LADDER_LENGTHS, decoder alone up to ALONE_MAX tokens (another model:
#           LADDER_PRESET, default llama3.2-1b, of LADDER_TYPE, default q8_0)
#   million one bridged 1,048,576-token prompt on the 1B shape (bench ladder, decoder alone not run)
#   trace   the CUDA ladder at each of LADDER_LENGTHS (decoder alone not run) with KVB_TRACE, and
#           tools/trace_report.py's sums of its last two bridged prompts (trace*.txt; the timelines
#           gzipped beside them): where the time after the GPU goes, the decoder's tail above all
#   shipper the ladder again (bridged legs and GPU alone only) with KVB_BRIDGE_SHIPPER=0: the CUDA
#           bridge shipping inline on the engine's thread, to compare with the default shipping
#           thread the ladder stage uses
#   link    the raw loopback link and kvbridge's transport over it (bench link), then the slab path
#           alone (bench ladder --slab-path-only: filler rows, no engine) at LADDER_LENGTHS, the
#           same run: the figures the ladder's GB/s is judged against
#   compare this build against an older one packed beside it as $D/kvbridge.prev, alternated in
#           COMPARE_ROUNDS rounds (default 3; prev first): the slab path alone (4 lanes) at
#           LADDER_LENGTHS, then the CUDA ladder (bridged legs and GPU alone) at COMPARE_LENGTHS
#           (default 8192,32768) with --seeds 3; each run's table and slab-path lines are printed
#   parallel the decode node on the host's CPUs, 1B shape: bench decode --batch 8 (one sequence vs 8
#           stepped together, same run) and bench parallel with 4 and 8 clients (a node serving
#           them at once vs one at a time, every reply checked equal)
# Logs under $OUT (default /tmp/kvb-node-check); DEADLINE (seconds, default 570) bounds the whole.
# Knobs: LADDER_LENGTHS, LADDER_SEEDS (prompts per length, default 1), ALONE_MAX, CACHE (f16),
# COST_SIZES, VERIFY_PRESETS (default: tiny .. llama3.2-1b), MILLION_CACHE, LADDER_EXTRA (more
# bench ladder flags for the ladder, link and million stages, e.g. "--block-tokens 64" or
# "--lanes 1"), LINK_STREAMS (bench link's --streams, default 1).
set -u
D=${D:-.devcarry-gpu}
case $D in /*) DL=$D/lib ;; *) DL=$PWD/$D/lib ;; esac # D may be absolute (a copy kept in /tmp between calls)
export LD_LIBRARY_PATH="$DL${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
case $D in /*) K=$D/kvbridge ;; *) K=$PWD/$D/kvbridge ;; esac # absolute: verify runs it from the models dir
. "$(dirname "$0")/cudnn_env.sh" # cuDNN for the engine's fused-attention choice (dlopen), when the host has it
OUT=${OUT:-/tmp/kvb-node-check}
MD=${MODELS_DIR:-/tmp/kvb-models}
STAGES=${STAGES:-"tests verify cost ladder"}
COST_SIZES=${COST_SIZES:-8192,32768}
LADDER_LENGTHS=${LADDER_LENGTHS:-8192,32768,131072}
ALONE_MAX=${ALONE_MAX:-32768}
CACHE=${CACHE:-f16}
LADDER_SEEDS=${LADDER_SEEDS:-1}
LADDER_EXTRA=${LADDER_EXTRA:-}
VERIFY_PRESETS=${VERIFY_PRESETS:-"tiny tiny-qwen2 tiny-qwen3 tiny-llama3 qwen3-0.6b llama3.2-1b"}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT" "$MD"
. "$(dirname "$0")/stages.sh" # T0, left, want, say
gen() { # gen PRESET TYPE -> path
  local f=$MD/$1-$2.gguf
  [ -f "$f" ] || $K gen-model --preset "$1" --type "$2" --out "$f" --quiet --threads "$(nproc)" >&2
  echo "$f"
}
say "node_check on $(hostname): $(nproc) CPUs; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
if want tests; then
  for t in test_cuda_bridge test_cuda_bridge_dev; do
    say "== $t"
    timeout "$(left)" "$D/$t" 2>&1 | tail -12
  done
fi
if want verify; then
  say "== verify --device cuda"
  vp=""
  for p in $VERIFY_PRESETS; do vp="$vp --preset $p"; done
  # shellcheck disable=SC2086 # one word per preset flag
  (cd "$MD" && timeout "$(left)" "$K" verify --device cuda $vp) >"$OUT/verify_cuda.txt" 2>&1
  echo "verify rc=$?"; grep -E "SHORT|PASS|FAIL|not run" "$OUT/verify_cuda.txt" | head -20
  say "== verify --device cuda --perturb (must fail)"
  (cd "$MD" && timeout "$(left)" "$K" verify --device cuda --preset tiny --perturb) 2>&1 | tail -3
fi
if want cost; then
  say "== bridge cost, 8B shape"
  f=$(gen llama3.1-8b q8_0)
  timeout "$(left)" $K bench prefill --device cuda -m "$f" --tokens "$COST_SIZES" --reps 3 --bridge "$CACHE" \
    --ceiling-reps 10 2>"$OUT/cost.err" | tee "$OUT/cost.txt"
  tail -3 "$OUT/cost.err"
fi
if want ladder; then
  say "== ladder, ${LADDER_PRESET:-llama3.2-1b} ${LADDER_TYPE:-q8_0}, CUDA prefill -> CPU decode"
  f=$(gen "${LADDER_PRESET:-llama3.2-1b}" "${LADDER_TYPE:-q8_0}")
  timeout "$(left)" $K bench ladder --device cuda -m "$f" --lengths "$LADDER_LENGTHS" --seeds "$LADDER_SEEDS" \
    --alone-max "$ALONE_MAX" --cache-type "$CACHE" $LADDER_EXTRA 2>"$OUT/ladder.err" | tee "$OUT/ladder.txt"
  tail -5 "$OUT/ladder.err"
fi
if want trace; then # where a bridged prompt's time goes after the GPU is done (the decoder's tail)
  say "== trace: the CUDA ladder with KVB_TRACE, one timeline per length, summed by tools/trace_report.py"
  f=$(gen llama3.2-1b q8_0)
  for L in ${LADDER_LENGTHS//,/ }; do
    KVB_TRACE="$OUT/trace$L.json" timeout "$(left)" $K bench ladder --device cuda -m "$f" --lengths "$L" \
      --seeds "$LADDER_SEEDS" --alone-max 0 --cache-type "$CACHE" $LADDER_EXTRA >"$OUT/trace$L.txt" 2>&1
    python3 tools/trace_report.py "$OUT/trace$L.json" --last 2 --min-ms 0.2 >>"$OUT/trace$L.txt" 2>&1
    gzip -f "$OUT/trace$L.json"
    grep -E '^ +[0-9]+ |tail|floor' "$OUT/trace$L.txt" | head -12
  done
fi
if want shipper; then
  say "== ladder with the CUDA bridge shipping inline (KVB_BRIDGE_SHIPPER=0)"
  f=$(gen llama3.2-1b q8_0)
  KVB_BRIDGE_SHIPPER=0 timeout "$(left)" $K bench ladder --device cuda -m "$f" --lengths "$LADDER_LENGTHS" --seeds "$LADDER_SEEDS" \
    --alone-max 0 --cache-type "$CACHE" 2>"$OUT/shipper.err" | tee "$OUT/shipper.txt"
  tail -5 "$OUT/shipper.err"
fi
if want link; then
  say "== link: raw loopback vs the transport, then the slab path alone"
  $K bench link --listen 127.0.0.1:47000 --psk kvb-node-check-link-key >/dev/null 2>&1 &
  lp=$!
  sleep 1
  timeout "$(left)" $K bench link --peer 127.0.0.1:47000 --psk kvb-node-check-link-key --slab-bytes 65536 \
    --streams "${LINK_STREAMS:-1}" 2>&1 | tail -4 | tee "$OUT/link.txt"
  kill $lp 2>/dev/null
  f=$(gen llama3.2-1b q8_0)
  timeout "$(left)" $K bench ladder -m "$f" --lengths "$LADDER_LENGTHS" --seeds 2 --slab-path-only --cache-type "$CACHE" $LADDER_EXTRA \
    2>"$OUT/slabpath.err" | tee "$OUT/slabpath.txt"
fi
if want parallel; then
  say "== the decode node's batched decode, 1B shape, $(nproc) threads"
  f=$(gen llama3.2-1b q8_0)
  timeout "$(left)" $K bench decode -m "$f" --ctx 512 --gen 32 --reps 3 --batch 8 2>/dev/null | tee "$OUT/batch.txt"
  for c in 4 8; do
    timeout "$(left)" $K bench parallel -m "$f" --clients $c --tokens 64 --rounds 3 2>"$OUT/parallel$c.err" |
      tee "$OUT/parallel$c.txt"
  done
fi
if want compare; then
  say "== compare: $D/kvbridge.prev (prev) against $K (new), alternated"
  P=$(dirname "$K")/kvbridge.prev
  if [ ! -x "$P" ]; then
    echo "compare: no $P (pack an older build's kvbridge there)"
  else
    f=$(gen llama3.2-1b q8_0)
    for r in $(seq 1 "${COMPARE_ROUNDS:-3}"); do
      for which in prev new; do
        b=$K
        [ $which = prev ] && b=$P
        o=$OUT/compare_${which}_r$r
        timeout "$(left)" "$b" bench ladder -m "$f" --lengths "$LADDER_LENGTHS" --seeds 2 --slab-path-only \
          --cache-type "$CACHE" $LADDER_EXTRA >"$o.slab.txt" 2>&1
        echo "-- round $r, $which: slab path alone"; grep -E "^ +[0-9]+ |slab path / raw|stages" "$o.slab.txt"
        timeout "$(left)" "$b" bench ladder --device cuda -m "$f" --lengths "${COMPARE_LENGTHS:-8192,32768}" --seeds 3 \
          --alone-max 0 --cache-type "$CACHE" $LADDER_EXTRA >"$o.ladder.txt" 2>&1
        echo "-- round $r, $which: CUDA ladder"; grep -E "^ +[0-9]+ |bridged phases" "$o.ladder.txt"
      done
    done
  fi
fi
if want million; then
  say "== one bridged 1M-token prompt, 1B shape"
  f=$(gen llama3.2-1b q8_0)
  timeout "$(left)" $K bench ladder --device cuda -m "$f" --lengths 1048576 --seeds 1 --alone-max 0 \
    --prefill-alone-max 0 --cache-type "${MILLION_CACHE:-q8_0}" $LADDER_EXTRA 2>"$OUT/million.err" | tee "$OUT/million.txt"
  tail -5 "$OUT/million.err"
fi
say "done"
