#!/usr/bin/env bash
# tools/device/llama_door_check.sh — a stock llama-server as the decoder, GPU prefill bridged into it,
# on the GPU host in one call (run from the repo root there): llama-server (CPU, THREADS threads, two
# slots, --slot-save-path, flash attention off), a CUDA prefill node and kvbridge's door in front
# of llama-server, all on loopback, for PRESET (default llama3.2-1b) of TYPE (q8_0). Then
# tools/device/llama_door_ttft.py: time to first token at LENGTHS, llama-server alone vs bridged
# through the door, and a TURNS-turn conversation where each turn ships only its increment (against
# llama-server alone keeping its own history). Uses a pack with kvbridge, its libraries in lib/ and
# llama-server in llama/ (tools/peer/build_llama_server.sh D/llama, the portable AVX-512 build):
#
#   [D=.devcarry-gpu] tools/device/llama_door_check.sh
#
# DEVICE (cuda; cpu to try the script on a machine without a GPU), LENGTHS (8192,32768), TURNS (4),
# TURN_TOKENS (2048), FIRST_TURN (8192), THREADS (all CPUs), MODELS_DIR (/tmp/kvb-models),
# OUT (/tmp/kvb-door-check; door.txt is the table), DEADLINE (seconds, default 570).
set -u
D=${D:-.devcarry-gpu}
case $D in /*) ;; *) D=$PWD/$D ;; esac
LS=${LLAMA_SERVER:-$D/llama/llama-server}
PRESET=${PRESET:-llama3.2-1b}
TYPE=${TYPE:-q8_0}
DEVICE=${DEVICE:-cuda}
LENGTHS=${LENGTHS:-8192,32768}
TURNS=${TURNS:-4}
TURN_TOKENS=${TURN_TOKENS:-2048}
FIRST_TURN=${FIRST_TURN:-8192}
THREADS=${THREADS:-$(nproc)}
MD=${MODELS_DIR:-/tmp/kvb-models}
OUT=${OUT:-/tmp/kvb-door-check}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT" "$MD"
# the pack's libraries for kvbridge alone, through a wrapper that execs (a backgrounded node's $! is
# the node itself); llama-server finds its libgomp beside it (RUNPATH $ORIGIN), and the host's curl
# and python3 keep the host's libraries (the pack's libcurl is older than the host's curl wants)
K=$OUT/kvbridge.sh
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s/kvbridge "$@"\n' "$D" "$D" >"$K"
chmod +x "$K"
. "$(dirname "$0")/stages.sh" # T0, left, want, say
[ -f "$(dirname "$0")/cudnn_env.sh" ] && . "$(dirname "$0")/cudnn_env.sh"
say "llama_door_check on $(hostname): $(nproc) CPUs; $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo no GPU)"
[ -x "$LS" ] || { echo "no $LS: build it with tools/peer/build_llama_server.sh $D/llama"; exit 2; }
F=$MD/$PRESET-$TYPE.gguf
[ -f "$F" ] || "$K" gen-model --preset "$PRESET" --type "$TYPE" --out "$F" --quiet --threads "$(nproc)"
# the longest prompt in either part, and a margin for the reply; llama-server's context is per slot
IFS=, read -ra LS_LEN <<<"$LENGTHS"
MAXN=$((FIRST_TURN + (TURNS - 1) * TURN_TOKENS))
for n in "${LS_LEN[@]}"; do [ "$n" -gt "$MAXN" ] && MAXN=$n; done
CTX=$((MAXN + 256))
SLOTS=$OUT/slots
rm -rf "$SLOTS"; mkdir -p "$SLOTS"
PORT_LS=18090 PORT_PN=17090 PORT_DOOR=18091
PSK=llama-door-check-key-0123
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
"$LS" -m "$F" --host 127.0.0.1 --port $PORT_LS -np 2 -c $((2 * CTX)) -t "$THREADS" -tb "$THREADS" \
  --slot-save-path "$SLOTS" -fa off --cache-ram 0 --no-webui --no-warmup >"$OUT/llama-server.log" 2>&1 &
pids+=($!)
"$K" serve --role prefill --device "$DEVICE" -m "$F" --listen 127.0.0.1:$PORT_PN --psk $PSK --ctx "$CTX" \
  >"$OUT/prefill.log" 2>&1 &
pids+=($!)
up() { # up URL SECONDS: a 200 from URL within SECONDS
  local i
  for ((i = 0; i < $2 * 10; i++)); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  return 1
}
up http://127.0.0.1:$PORT_LS/health 120 || { echo "llama-server did not come up"; tail "$OUT/llama-server.log"; exit 1; }
for ((i = 0; i < 600; i++)); do grep -q "listening on port" "$OUT/prefill.log" && break; sleep 0.1; done
grep -q "listening on port" "$OUT/prefill.log" || { echo "the prefill node did not come up"; tail "$OUT/prefill.log"; exit 1; }
say "llama-server and the $DEVICE prefill node are up (context $CTX per slot)"
"$K" serve --role decode --decoder llama-server=http://127.0.0.1:$PORT_LS --slot-dir "$SLOTS" --slots 1 \
  -m "$F" --peer 127.0.0.1:$PORT_PN --psk $PSK --http 127.0.0.1:$PORT_DOOR --ctx "$CTX" >"$OUT/door.log" 2>&1 &
pids+=($!)
up http://127.0.0.1:$PORT_DOOR/health 60 || { echo "the door did not come up"; tail "$OUT/door.log"; exit 1; }
say "the door is up; timing"
timeout "$(left)" python3 "$(dirname "$0")/llama_door_ttft.py" --server http://127.0.0.1:$PORT_LS \
  --door http://127.0.0.1:$PORT_DOOR --lengths "$LENGTHS" --turns "$TURNS" --turn-tokens "$TURN_TOKENS" \
  --first-turn "$FIRST_TURN" --out "$OUT/door.json" | tee "$OUT/door.txt"
rc=${PIPESTATUS[0]}
say "done (rc $rc); llama-server: $(grep -m1 -o 'system_info.*' "$OUT/llama-server.log" | cut -c1-160)"
exit "$rc"
