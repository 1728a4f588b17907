#!/usr/bin/env bash
# Run `kvbridge verify --target llama.cpp` against a stock llama-server started here for MODEL:
# llama-server (tools/peer/build_llama_server.sh) computes the prompt and saves its slot, kvbridge
# computes the same prompt in llama.cpp's state format, and the two are compared per layer and K/V;
# with --restore kvbridge's file is restored into the slot and decoded. The server runs on one slot
# (-np 1) with an f16 cache and no host-memory prompt cache (--cache-ram 0: a restore or a fallback
# must not be served from it), on a free port, with its slot directory and log in a temp directory.
#
# usage: tools/peer/verify_llama_server.sh MODEL [options] [-- extra verify options]
#   --fa on|off        llama-server's flash attention (off: V transposed in the cache; default on)
#   --prompt TEXT      the prompt (default: verify's)
#   --restore          also restore kvbridge's file and decode (verify --restore)
#   --server BIN       llama-server binary (default $KVB_LLAMA_SERVER or build-peer/llama-server-bin/llama-server)
#   --kvbridge BIN     kvbridge binary (default build/kvbridge)
#   --threads N        threads for both (default 2)
#   --server-arg ARG   one more llama-server argument (repeatable), e.g. --swa-full
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MODEL=""; FA=on; PROMPT=""; RESTORE=(); THREADS=2
SERVER="${KVB_LLAMA_SERVER:-$ROOT/build-peer/llama-server-bin/llama-server}"; KVB="$ROOT/build/kvbridge"
EXTRA=(); SARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage 0 ;;
    --fa) FA="$2"; shift 2 ;;
    --prompt) PROMPT="$2"; shift 2 ;;
    --restore) RESTORE=(--restore); shift ;;
    --server) SERVER="$2"; shift 2 ;;
    --kvbridge) KVB="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --server-arg) SARGS+=("$2"); shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "unknown option $1" >&2; usage 2 ;;
    *) if [ -z "$MODEL" ]; then MODEL="$1"; shift; else echo "extra argument $1" >&2; usage 2; fi ;;
  esac
done
[ -n "$MODEL" ] || usage 2
[ -x "$SERVER" ] || { echo "no llama-server at $SERVER (tools/peer/build_llama_server.sh build-peer/llama-server-bin)" >&2; exit 1; }
TMP="$(mktemp -d)"; mkdir -p "$TMP/slots"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -np 1 -c 4096 -t "$THREADS" -ctk f16 -ctv f16 \
  --slot-save-path "$TMP/slots" -fa "$FA" --cache-ram 0 --no-webui --no-warmup "${SARGS[@]}" >"$TMP/server.log" 2>&1 &
SPID=$!
trap 'kill $SPID 2>/dev/null; wait $SPID 2>/dev/null; rm -rf "$TMP"' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $SPID 2>/dev/null || { cat "$TMP/server.log"; exit 1; }
  sleep 0.2
done
ARGS=(verify --target llama.cpp --model "$MODEL" --server "http://127.0.0.1:$PORT" --slot-dir "$TMP/slots"
      --threads "$THREADS" "${RESTORE[@]}")
[ -n "$PROMPT" ] && ARGS+=(--prompt "$PROMPT")
echo "== llama-server $(grep -m1 -o 'build: [^ ]* ([^)]*)' "$TMP/server.log" || true), flash attention $FA"
"$KVB" "${ARGS[@]}" "${EXTRA[@]}"
