#!/usr/bin/env bash
# tools/device/gpu_check.sh — the CUDA engine's one script for the H200 host. From the repo root:
#
#   tools/device/gpu_check.sh
#
# 1. builds (cmake + ninja, Release, -DKVB_CUDA=ON) into build-gpu/, or with KVB_PREBUILT=DIR uses
#    binaries built elsewhere for x86-64 (DIR/kvbridge, DIR/test_cuda_*, DIR/lib/*.so*: the
#    libraries the host lacks — on 2026-12-02 it had no libxxhash/libcjson/libcmocka/libmicrohttpd
#    dev packages, so cmake there stops at find_library(xxhash)). Make such a DIR on a machine with
#    the same nvcc:  tools/device/gpu_check.sh --pack BUILD_DIR DIR   (then carry DIR);
# 2. generates the qwen3-0.6b and llama3.2-1b presets (bf16) into $MODELS_DIR and, in the
#    background, the Llama-3.1-8B shape (bf16, ~16 GB);
# 3. runs the gpu-labelled tests (test_cuda_*: kernels vs CPU twins, engine vs CPU engine on tiny
#    presets, fixtures vs the float64 reference, chunked == one-shot, cached prefix == cold, and the
#    two real presets; the prefill-engine interface: its logits, its bridge, tensor parallel);
# 4. runs the PyTorch peer (tools/peer/torch_llama_prefill.py) and `kvbridge bench prefill --device
#    cuda` on the 8B shape at $SIZES, in this order, nothing else on the GPU meanwhile; then the
#    small presets at 1K..32K;
# 5. prints a summary table last.
#
# Logs go under $OUT (default /tmp/kvb-gpu-check), at most 8 files. Environment knobs:
#   SIZES (2048,8192,32768)  REPS (3)  MODELS_DIR (/tmp/kvb-models)  KVB_PREBUILT (unset: build)
#   STAGES ("tests peer bench split small"; split = the 8B bench again without attention and with
#   64-row attention tiles, to see where the time goes)  PEER_JSON: use this peer JSON instead of
#   running the peer (when the stage list leaves "peer" out)  LONG=1: also 131072 tokens on the 8B shape (1 run)
#   ATTENTION (both: every bench with our kernel and cuDNN's, side by side; own|cudnn|auto: one)
#   SMALL_SIZES (1024,8192,32768)  DEADLINE (seconds for the whole script, default 3000: each
#   step's timeout is cut to what is left, and steps that cannot start in time are skipped)
set -u
if [ "${1:-}" = "--pack" ]; then # --pack BUILD_DIR DIR: binaries + every non-system library they load
  [ $# = 3 ] || { echo "usage: $0 --pack BUILD_DIR DIR" >&2; exit 2; }
  rm -rf "$3" && mkdir -p "$3/lib" || exit 1
  cp "$2/kvbridge" "$2"/tests/test_cuda_* "$3/" || exit 1
  for f in "$3"/kvbridge "$3"/test_cuda_*; do ldd "$f"; done | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|libcublas|libcublasLt|libcuda)\.so' |
    while read -r l; do cp -L "$l" "$3/lib/"; done
  # a UCX build (-DKVB_UCX=ON) loads UCX's transport plugins at run time from its module directory:
  # carried in lib/ucx with what they link; the scripts set UCX_MODULE_DIR=DIR/lib/ucx
  ucxmod=/usr/lib/x86_64-linux-gnu/ucx
  if ldd "$3/kvbridge" | grep -q libucp && [ -d "$ucxmod" ]; then
    mkdir -p "$3/lib/ucx" && cp -L "$ucxmod"/libuct_*.so.0 "$3/lib/ucx/" || exit 1
    for f in "$3"/lib/ucx/*; do ldd "$f"; done | awk '/=> \//{print $3}' | sort -u |
      grep -vE '/(libc|libm|libpthread|libdl|librt|libgcc_s)\.so|/libu(cs|ct|cp|cm)\.so' |
      while read -r l; do cp -L "$l" "$3/lib/"; done
    echo "UCX plugins packed into $3/lib/ucx: $(ls "$3/lib/ucx" | tr '\n' ' ')"
  fi
  echo "packed into $3: $(ls "$3" | tr '\n' ' ')"; ls "$3/lib"
  exit 0
fi
ROOT=$(pwd)
OUT=${OUT:-/tmp/kvb-gpu-check}
MD=${MODELS_DIR:-/tmp/kvb-models}
SIZES=${SIZES:-2048,8192,32768}
SMALL_SIZES=${SMALL_SIZES:-1024,8192,32768}
REPS=${REPS:-3}
STAGES=${STAGES:-"tests peer bench split small"}
mkdir -p "$OUT" "$MD"
LOG="$OUT/run.log"
T0=$(date +%s)
SUMMARY=()
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
add() { SUMMARY+=("$1"); }
want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
DEADLINE=${DEADLINE:-3000}
# tmo N: a step's timeout, N seconds or what is left before DEADLINE (minus 10), whichever is less
tmo() {
  local left=$((DEADLINE - ($(date +%s) - T0) - 10))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
enough() { # enough N: at least N seconds left
  [ $((DEADLINE - ($(date +%s) - T0))) -ge "$1" ] && return 0
  say "skipping: $2 (less than $1 s left before DEADLINE=$DEADLINE)"
  add "$(printf '%-12s skipped (out of time)' "$2")"
  return 1
}

say "gpu_check: $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname), $(nproc) CPUs, stages: $STAGES"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1 || true

# ---- 1. binaries ---------------------------------------------------------------------------------
if [ -n "${KVB_PREBUILT:-}" ]; then
  case "$KVB_PREBUILT" in /*) PB=$KVB_PREBUILT ;; *) PB=$ROOT/$KVB_PREBUILT ;; esac
  BIN=$PB/kvbridge
  TESTS=$PB
  export LD_LIBRARY_PATH="$PB/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "using prebuilt binaries from $PB"
  add "build        prebuilt ($PB)"
else
  say "building into build-gpu/"
  if cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVB_CUDA=ON >"$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" >>"$OUT/build.log" 2>&1; then
    add "build        ok ($(($(date +%s) - T0)) s)"
  else
    say "BUILD FAILED (see build.log)"
    tail -30 "$OUT/build.log"
    add "build        FAILED"
    printf '%s\n' "${SUMMARY[@]}"
    exit 1
  fi
  BIN=$ROOT/build-gpu/kvbridge
  TESTS=$ROOT/build-gpu/tests
fi
# cuBLAS 13: from the toolkit or from PyTorch's nvidia-* wheels, wherever the loader can't find it
if ldd "$BIN" | grep -q "not found"; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(python3 - <<'EOF' 2>/dev/null
import importlib, os
for m in ("nvidia.cu13", "nvidia.cublas", "nvidia"):
    try:
        for p in importlib.import_module(m).__path__:
            for root, dirs, files in os.walk(p):
                if "libcublas.so.13" in files:
                    print(root)
    except Exception:
        pass
EOF
  ); do
    if [ -e "$d/libcublas.so.13" ]; then export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
  done
fi
. "$ROOT/tools/device/cudnn_env.sh" | tee -a "$LOG" # cuDNN for the fused-attention alternative (dlopen)
. "$ROOT/tools/device/cudnn_env.sh" >/dev/null       # (again outside the pipe, so the export sticks)
if ldd "$BIN" | grep "not found" | tee -a "$LOG" | grep -q .; then
  say "kvbridge cannot find its libraries (above); stopping"
  exit 1
fi
"$BIN" --help >/dev/null 2>&1 || true

# ---- 2. models -------------------------------------------------------------------------------------
gen() { # preset file
  [ -s "$2" ] && return 0
  "$BIN" gen-model --preset "$1" --type bf16 --out "$2.tmp" --quiet >>"$LOG" 2>&1 && mv "$2.tmp" "$2"
}
Q06=$MD/qwen3-0.6b-bf16.gguf
L1B=$MD/llama3.2-1b-bf16.gguf
L8B=$MD/llama3.1-8b-bf16.gguf
if want tests || want small; then
  say "generating qwen3-0.6b and llama3.2-1b (bf16)"
  gen qwen3-0.6b "$Q06" || say "gen qwen3-0.6b failed"
  gen llama3.2-1b "$L1B" || say "gen llama3.2-1b failed"
fi
GEN8=""
if want bench; then
  say "generating llama3.1-8b (bf16) in the background"
  (gen llama3.1-8b "$L8B") &
  GEN8=$!
fi

# ---- 3. tests ----------------------------------------------------------------------------------------
if want tests; then
  for t in test_cuda_kernels test_cuda_engine test_cuda_interface; do
    enough 30 "$t" || continue
    say "running $t"
    KVB_BIN=$BIN KVB_CUDA_TEST_MODELS="$Q06,$L1B" timeout "$(tmo 300)" "$TESTS/$t" >>"$OUT/tests.log" 2>&1
    rc=$?
    say "$t: exit $rc"
    add "$(printf '%-12s %s (exit %d)' "$t" "$([ $rc = 0 ] && echo passed || echo FAILED)" $rc)"
  done
  grep -E '^\[  (FAILED|ERROR) |rel-L2|agreement|attention D|gemm ' "$OUT/tests.log" >>"$LOG" || true
  grep -E '^\[  (FAILED|ERROR) ' "$OUT/tests.log" | head -5
fi

if [ -n "$GEN8" ]; then
  say "waiting for the 8B model"
  wait "$GEN8" || say "gen llama3.1-8b failed"
fi

# ---- 4. peer and benchmarks -----------------------------------------------------------------------
if want peer && enough 60 peer; then
  say "PyTorch peer at $SIZES"
  PYTHONUNBUFFERED=1 timeout "$(tmo 300)" python3 tools/peer/torch_llama_prefill.py --tokens "$SIZES" --reps "$REPS" \
    --out "$OUT/peer.json" >/dev/null 2>"$OUT/peer.log"
  rc=$?
  say "peer: exit $rc"
  [ $rc = 0 ] || tail -20 "$OUT/peer.log" | tee -a "$LOG"
fi
if want bench && [ -s "$L8B" ] && enough 40 "bench 8B"; then
  say "kvbridge bench prefill --device cuda, llama3.1-8b at $SIZES"
  timeout "$(tmo 300)" "$BIN" bench prefill --device cuda -m "$L8B" --tokens "$SIZES" --reps "$REPS" \
    --peer-json "${PEER_JSON:-$OUT/peer.json}" --json "$OUT/bench_8b.json" --attention "${ATTENTION:-both}" \
    >"$OUT/bench_8b.txt" 2>&1
  say "bench 8B: exit $?"
  cat "$OUT/bench_8b.txt" >>"$LOG"
  if [ "${LONG:-0}" = 1 ] && enough 90 "bench 8B 128K"; then
    say "kvbridge bench prefill --device cuda, llama3.1-8b at 131072 tokens"
    timeout "$(tmo 400)" "$BIN" bench prefill --device cuda -m "$L8B" --tokens 131072 --reps 1 --warmup 0 \
      --ceiling-reps 5 --attention "${ATTENTION:-both}" >>"$OUT/bench_small.txt" 2>&1
    say "bench 8B 128K: exit $?"
  fi
fi
if want split && [ -s "$L8B" ] && enough 40 "split 8B"; then
  # where the time goes: attention left out (diagnostic), and the 64-row attention tile
  say "8B split: KVB_CUDA_DEBUG_SKIP_ATTENTION=1 at $SIZES; KVB_CUDA_FA_BR=64 at $SIZES"
  KVB_CUDA_DEBUG_SKIP_ATTENTION=1 timeout "$(tmo 120)" "$BIN" bench prefill --device cuda -m "$L8B" --tokens "$SIZES" \
    --reps 2 --ceiling-reps 5 >>"$OUT/bench_small.txt" 2>&1
  KVB_CUDA_FA_BR=64 timeout "$(tmo 120)" "$BIN" bench prefill --device cuda -m "$L8B" --tokens "$SIZES" \
    --reps 2 --ceiling-reps 5 >>"$OUT/bench_small.txt" 2>&1
  say "split: done"
fi
if want small; then
  for f in "$Q06" "$L1B"; do
    [ -s "$f" ] || continue
    enough 25 "bench $(basename "$f")" || continue
    say "kvbridge bench prefill --device cuda, $(basename "$f") at $SMALL_SIZES"
    timeout "$(tmo 200)" "$BIN" bench prefill --device cuda -m "$f" --tokens "$SMALL_SIZES" --reps "$REPS" \
      --attention "${ATTENTION:-both}" --host-overhead >>"$OUT/bench_small.txt" 2>&1
    say "bench $(basename "$f"): exit $?"
  done
  [ -f "$OUT/bench_small.txt" ] && grep -vE '^bench prefill cuda: ' "$OUT/bench_small.txt" >>"$LOG"
fi

# ---- 5. summary --------------------------------------------------------------------------------------
{
  echo
  echo "==================== gpu_check summary ($(($(date +%s) - T0)) s) ===================="
  printf '%s\n' "${SUMMARY[@]}"
  if [ -s "$OUT/bench_8b.txt" ]; then
    echo "---- llama3.1-8b bf16 prefill (kvbridge bench prefill --device cuda)"
    grep -E '^(ceiling|peer|memory|device|attention) ' "$OUT/bench_8b.txt"
    awk '/^(\[A\]|  *tokens )/{p=1} p && !/^memory/' "$OUT/bench_8b.txt"
  fi
  if [ -s "$OUT/bench_small.txt" ]; then
    echo "---- more benchmarks (bench_small.txt)"
    grep -E '^(model  |NOTE  |attention|host overhead|side by side|\[[AB]\]|  *[0-9]+ )' "$OUT/bench_small.txt" | grep -v '^           '
  fi
} | tee -a "$LOG"
