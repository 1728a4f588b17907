#!/usr/bin/env bash
# tools/device/ucx_ladder.sh — the slab stream over UCX on the GPU host, in one call (run from the
# repo root there): the CUDA -> CPU ladder over --transport tcp and --transport ucx, alternated,
# and bench link's four figures (raw TCP, our TCP, our UCX, UCX's raw put) on the host's loopback.
# Uses binaries from a build with UCX, packed here with
#   cmake -S . -B build-gpu-ucx -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVB_CUDA=ON -DKVB_UCX=ON
#   cmake --build build-gpu-ucx          (everything: --pack copies the test_cuda_* binaries too)
#   tools/device/gpu_check.sh --pack build-gpu-ucx .devcarry-gpu-ucx
# (the pack carries UCX's transport plugins in lib/ucx; this script points UCX_MODULE_DIR there)
# and carried as .devcarry-gpu-ucx. Stages (STAGES, default "link ladder"):
#   link    bench link over UCX on loopback (1 GiB, 1 MiB slabs, LINK_REPS rounds): the UCX slab
#           path against our TCP (target >= 3x) and against UCX's raw put (target >= 85 %)
#   ladder  bench ladder --device cuda on the llama3.2-1b shape (Q8_0, f16 cache) at
#           LADDER_LENGTHS, --seeds LADDER_SEEDS, decoder alone not run, ROUNDS rounds of
#           (tcp, ucx): every verdict must be `complete`, and ucx's bridged time to first token no
#           worse than tcp's at each length
# Passing: every ladder row's verdicts read "complete, complete, ..."; the summary's ucx/tcp ratio
# of bridged TTFT medians is <= 1.00 (noise: +-3 %) at 8192, 32768 and 131072; the "UCX's lanes"
# lines name shared memory (posix/sysv/cma), never only tcp. Logs under $OUT (default
# /tmp/kvb-ucx-ladder); DEADLINE (seconds, default 570) bounds the whole.
set -u
D=${D:-.devcarry-gpu-ucx}
case $D in /*) DA=$D ;; *) DA=$PWD/$D ;; esac
export LD_LIBRARY_PATH="$DA/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export UCX_MODULE_DIR=$DA/lib/ucx
K=$DA/kvbridge
. "$(dirname "$0")/cudnn_env.sh"
OUT=${OUT:-/tmp/kvb-ucx-ladder}
MD=${MODELS_DIR:-/tmp/kvb-models}
STAGES=${STAGES:-"link ladder"}
LADDER_LENGTHS=${LADDER_LENGTHS:-8192,32768,131072}
LADDER_SEEDS=${LADDER_SEEDS:-3}
ROUNDS=${ROUNDS:-2}
LINK_REPS=${LINK_REPS:-5}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT" "$MD"
. "$(dirname "$0")/stages.sh" # T0, left, want, say
say "ucx_ladder on $(hostname): $(nproc) CPUs; $(nvidia-smi --query-gpu=name --format=csv,noheader)"
[ -x "$K" ] || { echo "no $K: pack a UCX build (see the top of this file)"; exit 2; }
[ -d "$UCX_MODULE_DIR" ] || { echo "no $UCX_MODULE_DIR: the pack has no UCX plugins (a build without -DKVB_UCX=ON?)"; exit 2; }
export KVB_PSK=${KVB_PSK:-ucx-ladder-key-0123456789abcdef}
if want link; then
  say "== bench link over UCX, loopback"
  P=$((20000 + RANDOM % 20000))
  timeout "$(left)" "$K" bench link --listen "127.0.0.1:$P" --transport ucx >"$OUT/link_listener.txt" 2>&1 &
  sleep 1
  timeout "$(left)" "$K" bench link --peer "127.0.0.1:$P" --transport ucx --reps "$LINK_REPS" 2>&1 |
    grep -v '^\[' | tee "$OUT/link.txt"
  wait
fi
if want ladder; then
  f=$MD/llama3.2-1b-q8_0.gguf
  [ -f "$f" ] || "$K" gen-model --preset llama3.2-1b --type q8_0 --out "$f" --quiet --threads "$(nproc)" >&2
  for r in $(seq 1 "$ROUNDS"); do
    for t in tcp ucx; do
      say "== ladder round $r over $t"
      timeout "$(left)" "$K" bench ladder --device cuda -m "$f" --lengths "$LADDER_LENGTHS" --seeds "$LADDER_SEEDS" \
        --alone-max 0 --cache-type f16 --transport "$t" 2>"$OUT/ladder_${t}_$r.err" | tee "$OUT/ladder_${t}_$r.txt"
      tail -3 "$OUT/ladder_${t}_$r.err"
    done
  done
  say "== summary: bridged TTFT medians (s) by length, each round; ucx / tcp"
  for L in ${LADDER_LENGTHS//,/ }; do
    line="$(printf '%8s' "$L")"
    for r in $(seq 1 "$ROUNDS"); do
      # a row: tokens, alone TTFT ("not run" here), bridged s, ..., GB/s, verdicts
      a=$(awk -v L="$L" '$1 == L {sub(/not run/, "-"); $0 = $0; print $3; exit}' "$OUT/ladder_tcp_$r.txt")
      b=$(awk -v L="$L" '$1 == L {sub(/not run/, "-"); $0 = $0; print $3; exit}' "$OUT/ladder_ucx_$r.txt")
      v=$(awk -v L="$L" '$1 == L {sub(/^.*[0-9]  +/, ""); print; exit}' "$OUT/ladder_ucx_$r.txt")
      line="$line  round $r: tcp ${a:-?} ucx ${b:-?} ($(awk -v a="${a:-0}" -v b="${b:-0}" 'BEGIN{if (a > 0) printf "%.2f", b / a; else print "?"}'); ucx verdicts: ${v:-?})"
    done
    echo "$line"
  done
  grep -h "UCX's lanes" "$OUT"/ladder_ucx_*.txt | sort | uniq -c
fi
