#!/usr/bin/env bash
# tools/device/mla_bridge_check.sh — the CUDA bridge's latent (MLA) rows on the GPU host, in one
# call: test_cuda_bridge (every preset, tiny-mla included: CUDA rows == the CPU's kvb_kv_produce
# byte for byte, every weight type and cache dtype, two chunks from positions past 0, and the
# test-only perturbation) and test_cuda_bridge_dev (the post kernel's two forms with the latent
# row's norm/rotation split and no V, the V2-Lite-shaped 576-value rows, the prefill node's
# device-input path on tiny-mla), then `kvbridge verify --device cuda --preset tiny-mla` (the
# decoder's own blocks against the CUDA bridge's), once with one bridge and once with two rank
# bridges (--gpus 2): their exit statuses are reported, the script does not fail on them. From the repo root there, with a build of this branch packed here by
# `tools/device/gpu_check.sh --pack BUILD_DIR DIR` (BUILD_DIR configured with -DKVB_CUDA=ON):
#
#   B=DIR tools/device/mla_bridge_check.sh
#
# Exit 0 when both test binaries pass. DEADLINE (seconds, default 570). Logs under $OUT (default
# /tmp/kvb-mla-bridge): mla_bridge.txt is the summary.
set -u
B=${B:?set B to the packed build}
OUT=${OUT:-/tmp/kvb-mla-bridge}
DEADLINE=${DEADLINE:-570}
T0=$(date +%s)
mkdir -p "$OUT"
LOG=$OUT/mla_bridge.txt
: >"$LOG"
left() { echo $((DEADLINE - ($(date +%s) - T0) - 5)); }
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
case $B in /*) ;; *) B=$PWD/$B ;; esac
. "$(dirname "$0")/cublas_env.sh"
. "$(dirname "$0")/cudnn_env.sh" >/dev/null
export LD_LIBRARY_PATH="$B/lib:$LD_LIBRARY_PATH"
say "mla_bridge_check on $(hostname): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -1)"
fails=0
for t in test_cuda_bridge test_cuda_bridge_dev; do
  say "$t"
  KVB_BIN=$B/kvbridge timeout "$(left)" "$B/$t" >"$OUT/$t.log" 2>&1
  rc=$?
  [ $rc = 0 ] || fails=$((fails + 1))
  say "$t: exit $rc; $(grep -E '^kvbt: [0-9]' "$OUT/$t.log" | tr '\n' ' ')"
  grep -E 'bit-identical|identical \(|differ|row sets|ship calls|skipped|FAILED|ERROR|Failure' "$OUT/$t.log" |
    head -40 >>"$LOG"
done
# verify NAME ARGS...: `kvbridge verify --device cuda ARGS --preset tiny-mla`, its exit status and the
# rows the CUDA bridge computed ("tiny-mla  TYPE  cuda|cudaxN  arrays|blocks|chunked|bytes  N/N  ok")
verify() {
  local name=$1 vd
  shift
  say "verify --device cuda $* --preset tiny-mla"
  vd=$(mktemp -d)
  (cd "$vd" && timeout "$(left)" "$B/kvbridge" verify --device cuda "$@" --preset tiny-mla) >"$OUT/$name.log" 2>&1
  local vrc=$? rows ok
  rows=$(grep -cE '^\s*tiny-mla\s+\S+\s+cuda\S*\s' "$OUT/$name.log")
  ok=$(grep -cE '^\s*tiny-mla\s+\S+\s+cuda\S*\s.*\sok\s*$' "$OUT/$name.log")
  say "$name: exit $vrc; $ok of $rows CUDA rows ok (0 rows: the CUDA bridge did not run, see $name.log)"
  grep -vE '^\s*$' "$OUT/$name.log" | grep -vE '^\s*tiny-mla\s+[0-9]' | tail -20 >>"$LOG"
  rm -rf "$vd"
}
verify verify
# two rank bridges (tensor parallelism; on one device both run there): the one latent "KV head"
# falls to rank 1, rank 0 computes none
verify verify_gpus2 --gpus 2
if [ $fails = 0 ]; then say "PASS: test_cuda_bridge and test_cuda_bridge_dev"; else say "FAIL: $fails test binary(ies) failed"; fi
exit $((fails > 0))
