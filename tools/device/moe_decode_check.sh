#!/usr/bin/env bash
# tools/device/moe_decode_check.sh — mixture-of-experts decode on the GPU host's 16 CPU cores beside
# llama.cpp, same files, same run: for each weight type, `kvbridge gen-model` writes the preset
# (default qwen3-30b-a3b) into MODELS_DIR, then `kvbridge bench decode` runs one sequence and BATCH
# sequences stepped together with llama.cpp's llama-bench (tg) beside the first, and, when the pack
# has it, llama-batched-bench (-npl 1,BATCH: sequences decoded together) beside both. A table of
# tok/s, ratios and the bytes each token reads (the routed experts only; for a batch the expected
# union of experts its tokens touch) goes to $OUT/moe_decode.md, logs and JSON beside it.
#
#   [D=.devcarry] [TYPES="q8_0 q4_k"] tools/device/moe_decode_check.sh      (from the repo root)
#
# D: the carried folder, as tools/device/cpu_bench.sh takes it: D/kvbridge, its libraries in D/lib,
# D/llama/llama-bench (tools/peer/build_llama_bench.sh D/llama [--batched]: then also
# D/llama/llama-batched-bench) with libgomp.so.1. Settings (environment): PRESET, TYPES, THREADS
# (16), CTX (prompt tokens before decode, 16), GEN (decode steps, 64), REPS (3), BATCH (8),
# MODELS_DIR (/tmp/kvb-moe; files already there are reused, so a second call on the same warm
# machine skips the generation), DEADLINE (seconds for the whole, default 570: a step that cannot
# finish in time is skipped and said so; the 30B shape's Q8_0 file is ~32 GB, so run one type per
# call if both do not fit in one). Exit 0 when every step ran, 1 otherwise.
set -uo pipefail
D=${D:-.devcarry}
PRESET=${PRESET:-qwen3-30b-a3b}
TYPES=${TYPES:-"q8_0 q4_k"}
T=${THREADS:-16}
CTX=${CTX:-16}
GEN=${GEN:-64}
REPS=${REPS:-3}
BATCH=${BATCH:-8}
MD=${MODELS_DIR:-/tmp/kvb-moe}
DEADLINE=${DEADLINE:-570}
OUT=${OUT:-/tmp/kvb-moe-out}
case $D in /*) ;; *) D=$PWD/$D ;; esac
export LD_LIBRARY_PATH="$D/lib:$D/llama${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
K=$D/kvbridge
LB=$D/llama/llama-bench
LBB=$D/llama/llama-batched-bench
T0=$(date +%s)
mkdir -p "$OUT" "$MD"
left() { echo $((DEADLINE - ($(date +%s) - T0) - 5)); }
say() { echo "[$(($(date +%s) - T0))s] $*"; }
fail() { say "FAILED: $*"; }  # the log is read for FAILED at the end
[ -x "$K" ] || { echo "no kvbridge at $K (carry the pack as $D)" >&2; exit 1; }
[ -x "$LB" ] || { say "no llama-bench at $LB: kvbridge's figures only"; LB=""; }
[ -x "$LBB" ] || { say "no llama-batched-bench at $LBB: the batch has no llama.cpp peer"; LBB=""; }

# json FILE KEY: a number from a flat JSON object (kvbridge bench --json), or "-"
json() { python3 -c 'import json,sys
try: v = json.load(open(sys.argv[1])).get(sys.argv[2])
except Exception: v = None
print("-" if v is None or (isinstance(v, (int, float)) and v < 0) else v)' "$1" "$2"; }
# batched LOG PL: llama-batched-bench's tg tok/s (speed_tg) for PL sequences, or "-"
batched() { python3 -c 'import json,sys
v = "-"
for l in open(sys.argv[1], errors="replace"):
    l = l.strip()
    if l.startswith("{\"n_kv_max\""):
        r = json.loads(l)
        if r["pl"] == int(sys.argv[2]): v = "%.2f" % r["speed_tg"]
print(v)' "$1" "$2"; }
ratio() { python3 -c 'import sys
a, b = sys.argv[1], sys.argv[2]
print("-" if "-" in (a, b) or float(b) <= 0 else "%.2fx" % (float(a) / float(b)))' "$1" "$2"; }
fmt() { [ "$1" = - ] && echo - || printf '%.2f' "$1"; }

# gen TYPE: the preset's file of that type in MD (reused when there); its path on stdout
gen() {
  local f=$MD/$PRESET-$1.gguf
  if [ -s "$f" ]; then say "reusing $f" >&2; echo "$f"; return 0; fi
  # the other types' files go first when the disk is short (the 30B shape's Q8_0 is ~32 GB)
  local free_gb; free_gb=$(df -Pk "$MD" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt 45 ]; then say "$free_gb GB free: removing $MD/*.gguf" >&2; rm -f "$MD"/*.gguf; fi
  say "gen-model --preset $PRESET --type $1 ($(left) s left)" >&2
  if ! timeout "$(left)" /usr/bin/time -f "gen $PRESET $1: %e s wall, %M KB max RSS" \
      "$K" gen-model --preset "$PRESET" --type "$1" --out "$f.tmp" --quiet --threads "$T" >&2; then
    rm -f "$f.tmp"; return 1
  fi
  mv "$f.tmp" "$f" && ls -la "$f" >&2 && echo "$f"
}

{
  echo "== machine"; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)' ; free -g | head -2
  for ty in $TYPES; do
    echo "== $PRESET $ty"
    f=$(gen "$ty") || { fail "gen-model $ty (out of time or error)"; continue; }
    J=$OUT/$PRESET-$ty-decode.json
    if [ "$(left)" -lt 60 ]; then fail "$ty: bench decode skipped, $(left) s left"; continue; fi
    say "bench decode $ty: 1 and $BATCH sequences${LB:+, llama-bench beside}"
    timeout "$(left)" "$K" bench decode -m "$f" --threads "$T" --ctx "$CTX" --gen "$GEN" --reps "$REPS" \
      --batch "$BATCH" ${LB:+--llama-bench "$LB"} --json "$J" || fail "$ty: bench decode"
    BL=$OUT/$PRESET-$ty-batched.log
    if [ -n "$LBB" ] && [ "$(left)" -gt 30 ]; then
      say "llama-batched-bench $ty: -npl 1,$BATCH"
      timeout "$(left)" "$LBB" -m "$f" -t "$T" -c $((BATCH * (CTX + GEN) + 64)) -b 512 -ub 512 -npp "$CTX" \
        -ntg "$GEN" -npl "1,$BATCH" --output-format jsonl > "$BL" 2>&1 || fail "$ty: llama-batched-bench"
      grep '^{' "$BL"
    elif [ -n "$LBB" ]; then fail "$ty: llama-batched-bench skipped, $(left) s left"; fi
  done
} 2>&1 | tee "$OUT/moe_decode.log"
# the table, from the JSON and logs the steps left
{
  echo "# $PRESET decode, $T threads: kvbridge bench decode beside llama.cpp (same files, same run)"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%MZ), $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}'), prompt $CTX tokens, $GEN steps, medians of $REPS (llama-bench: its mean)"
  echo
  echo "| file | kvbridge 1 seq tok/s | llama-bench tg | ratio | llama-batched 1 seq | kvbridge $BATCH seq tok/s | llama-batched $BATCH seq | ratio | weights read/token (1 seq); experts touched ($BATCH seq) | read bandwidth |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  for ty in $TYPES; do
    J=$OUT/$PRESET-$ty-decode.json BL=$OUT/$PRESET-$ty-batched.log
    [ -s "$J" ] || { echo "| $PRESET $ty | not run (see moe_decode.log) | | | | | | | | |"; continue; }
    k1=$(json "$J" tok_s) kb=$(json "$J" batch_tok_s) lt=$(json "$J" peer_tok_s)
    l1=-; lb=-; [ -s "$BL" ] && { l1=$(batched "$BL" 1); lb=$(batched "$BL" "$BATCH"); }
    wb=$(json "$J" weight_bytes) bw=$(json "$J" read_bw_gbs) xb=$(json "$J" batch_experts_per_layer)
    echo "| $PRESET $ty | $(fmt "$k1") | $(fmt "$lt") | $(ratio "$k1" "$lt") | $l1 | $(fmt "$kb") | $lb | $(ratio "$kb" "$lb") | $(python3 -c "print('%.0f' % ($wb / 1e6))") MB; $(fmt "$xb") | $(fmt "$bw") GB/s |"
  done
} > "$OUT/moe_decode.md"
cat "$OUT/moe_decode.md"
grep -q FAILED "$OUT/moe_decode.log" && exit 1
exit 0
