#!/usr/bin/env bash
# tools/device/llama_study_check.sh — the agreement study (tools/peer/llama_study.py) on the GPU
# host's CPUs, from the repo root there: RIGS rigs of THREADS threads each (a llama-server, a prefill
# node per level and a door per level, all on loopback) share the prompts of INDICES, longest first,
# each prompt claimed by one rig; no rig starts a prompt its pace says would end after the call.
# Every record is tagged `where: TAG`. The prompts are the development machine's
# (`llama_study.py --save-prompts`: the corpus is Python's standard library, so this host's Python
# would cut other texts); the llama-server is the portable AVX2 build the `ggml` level follows, and
# kvbridge runs its AVX2 kernels (KVB_SIMD=avx2), so a record does not depend on the machine that
# made it: CHECK (indices) reruns prompts already recorded elsewhere into check.jsonl to show it.
#
#   [D=.devcarry-gpu] [S=.devcarry-study] MODEL=FILE tools/device/llama_study_check.sh
#
# D: a pack with kvbridge and its libraries in lib/ (tools/device/gpu_check.sh --pack). S: a folder
# with llama/ (the AVX2 llama-server) and prompts.jsonl. MODEL: Gemma 3 270M Q4_K_M (253 MB: over
# one call's 64 MiB carry, so it travels in pieces, one or two per call, named in order, e.g.
# `head -c 35000000 F >.devcarry-m0; tail -c +35000001 F | split -b 54528256 -d -a 1
# --numeric-suffixes=1 - .devcarry-m`: PIECES='.devcarry-m*' copies the pieces a call carried
# out of the tree into PIECE_DIR (/tmp/kvb-study/pieces: a warm host keeps /tmp between calls);
# PIECES_ONLY=1 stops there; once the pieces join into a file of MODEL_SHA256, that is MODEL). RIGS (8),
# THREADS (2), INDICES (0-99), CHECK (none), TAG (h100-host), PACE (0.03 s per prompt token, the
# first guess of a rig's pace), OUT (/tmp/kvb-study/out; rig-N.jsonl, check.jsonl), DEADLINE (570 s).
set -u
D=${D:-.devcarry-gpu}
S=${S:-.devcarry-study}
case $D in /*) ;; *) D=$PWD/$D ;; esac
case $S in /*) ;; *) S=$PWD/$S ;; esac
MODEL=${MODEL:?MODEL=the Gemma 3 270M file}
PIECE_DIR=${PIECE_DIR:-/tmp/kvb-study/pieces}
if [ -n "${PIECES:-}" ]; then
  mkdir -p "$PIECE_DIR"
  for f in $PIECES; do # kept without the leading dot of a carried name
    [ -f "$f" ] && cp "$f" "$PIECE_DIR/$(basename "$f" | sed 's/^\.//')" && echo "piece $f: $(stat -c %s "$f") bytes"
  done
  [ "${PIECES_ONLY:-0}" = 1 ] && exit 0
  if [ ! -f "$MODEL" ]; then
    mkdir -p "$(dirname "$MODEL")"
    # shellcheck disable=SC2046 # the pieces in name order
    cat $(ls "$PIECE_DIR"/* | sort) >"$MODEL.part"
    got=$(sha256sum "$MODEL.part" | cut -d" " -f1)
    [ "$got" = "${MODEL_SHA256:?MODEL_SHA256=the sha256 of the whole file}" ] ||
      { rm -f "$MODEL.part"; echo "the pieces in $PIECE_DIR join into sha256 $got, not $MODEL_SHA256: a piece is missing"; exit 2; }
    mv "$MODEL.part" "$MODEL"
  fi
fi
RIGS=${RIGS:-8}
THREADS=${THREADS:-2}
INDICES=${INDICES:-0-99}
CHECK=${CHECK:-}
TAG=${TAG:-h100-host}
PACE=${PACE:-0.03}
OUT=${OUT:-/tmp/kvb-study/out}
DEADLINE=${DEADLINE:-570}
STAGES=""
. "$(dirname "$0")/stages.sh" # T0, left, say
mkdir -p "$OUT"
STUDY=$PWD/tools/peer/llama_study.py
# the pack's libraries for kvbridge alone: python3 and llama-server keep the host's own
KVB=$OUT/kvbridge.sh
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib KVB_SIMD=avx2 exec %s/kvbridge "$@"\n' "$D" "$D" >"$KVB"
chmod +x "$KVB"
LS=$S/llama/llama-server
[ -x "$LS" ] || { echo "no $LS"; exit 2; }
"$KVB" --version >/dev/null 2>&1 || { echo "the pack's kvbridge does not run here"; "$KVB" --version; exit 2; }
say "llama_study_check on $(hostname): $(nproc) CPUs, $RIGS rigs x $THREADS threads, prompts $INDICES"
STOP=$((T0 + DEADLINE - 15))
common=(--server "$LS" --kvbridge "$KVB" --model "$MODEL" --top-k 100 --threads "$THREADS"
        --load-prompts "$S/prompts.jsonl" --tag "$TAG" --stop-at "$STOP" --pace "$PACE")
CLAIMS=$OUT/claims.$T0
mkdir -p "$CLAIMS"
export STUDY CHECK INDICES CLAIMS OUT
pids=()
for ((r = 0; r < RIGS; r++)); do
  # each rig in its own session: at the wall its whole process group (python, llama-server,
  # prefill nodes, doors) is stopped; its prompt in flight is lost, the records written stay
  setsid bash -c '
    r=$1; shift
    if [ "$r" = 0 ] && [ -n "$CHECK" ]; then
      python3 "$STUDY" "$@" --indices "$CHECK" --out "$OUT/check.jsonl"
    fi
    exec python3 "$STUDY" "$@" --indices "$INDICES" --claim-dir "$CLAIMS" --longest-first --out "$OUT/rig-$r.jsonl"
  ' rig "$r" "${common[@]}" >"$OUT/rig-$r.log" 2>&1 &
  pids+=($!)
  sleep 1
done
while :; do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] || [ "$(left)" -le 0 ] && break
  sleep 2
done
for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
sleep 3
for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
cat "$OUT"/rig-*.jsonl >"$OUT/host.jsonl" 2>/dev/null
say "records: $(wc -l <"$OUT/host.jsonl") of $(cat "$OUT"/rig-*.jsonl 2>/dev/null | python3 -c 'import sys,json; print(len({json.loads(l)["i"] for l in sys.stdin}))') prompts; check: $(wc -l <"$OUT/check.jsonl" 2>/dev/null || echo 0)"
for ((r = 0; r < RIGS; r++)); do grep -h -E "Error|error|exited|Traceback" "$OUT/rig-$r.log" | grep -v Deprecation | head -3; done
exit 0
