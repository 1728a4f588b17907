#!/usr/bin/env bash
# tests/netns_loop.sh KVBRIDGE — the closed loop across two network namespaces joined by a veth
# pair shaped to 10 Gbit/s with tc tbf (netem is not available here): a prefill node in one, a
# decode node in the other, a bridged conversation of two turns through the OpenAI API.
# Needs root and `ip netns`; exits 77 (skipped) where namespaces cannot be made.
set -u
K=${1:?usage: netns_loop.sh KVBRIDGE}
[ "$(id -u)" = 0 ] || { echo "netns_loop: needs root; skipped"; exit 77; }
command -v ip >/dev/null && command -v tc >/dev/null || { echo "netns_loop: iproute2 missing; skipped"; exit 77; }
S=$$
P=kvbp$S D=kvbd$S
WORK=$(mktemp -d)
cleanup() {
  ip netns pids $P 2>/dev/null | xargs -r kill 2>/dev/null
  ip netns pids $D 2>/dev/null | xargs -r kill 2>/dev/null
  ip netns del $P 2>/dev/null; ip netns del $D 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
if ! ip netns add $P 2>/dev/null; then echo "netns_loop: cannot create namespaces here; skipped"; exit 77; fi
ip netns add $D
ip link add vp$S type veth peer name vd$S
ip link set vp$S netns $P
ip link set vd$S netns $D
ip -n $P addr add 10.213.7.1/24 dev vp$S; ip -n $P link set vp$S up; ip -n $P link set lo up
ip -n $D addr add 10.213.7.2/24 dev vd$S; ip -n $D link set vd$S up; ip -n $D link set lo up
tc -n $P qdisc add dev vp$S root tbf rate 10gbit burst 4mb latency 10ms
tc -n $D qdisc add dev vd$S root tbf rate 10gbit burst 4mb latency 10ms
tc -n $P qdisc show dev vp$S | grep -q tbf || { echo "netns_loop: tc tbf not applied"; exit 1; }

M=$WORK/m.gguf
"$K" gen-model --preset tiny --out "$M" --seed 4 --quiet || exit 1
export KVB_PSK=netns-test-key-0123456789
ip netns exec $P "$K" serve --role prefill --listen 10.213.7.1:7411 -m "$M" --threads 1 >"$WORK/p.log" 2>&1 &
ip netns exec $D "$K" serve --role decode --http 127.0.0.1:7412 --peer 10.213.7.1:7411 -m "$M" --threads 1 \
  >"$WORK/d.log" 2>&1 &
# up once its link to the prefill node is (the link dials on its own thread, with back-off)
for i in $(seq 75); do
  ip netns exec $D curl -s http://127.0.0.1:7412/health 2>/dev/null | grep -Eq '"peer": ?"up"' && break; sleep 0.2
done
doc=$(python3 -c "print('the granite left on the evening tide. ' * 30)")
fail=0
for turn in 1 2; do
  body="{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"$doc\"}"
  [ $turn = 2 ] && body="$body,{\"role\":\"assistant\",\"content\":\"ok\"},{\"role\":\"user\",\"content\":\"and then? $doc\"}"
  body="$body],\"max_tokens\":8,\"temperature\":0}"
  out=$(ip netns exec $D curl -s -D "$WORK/h$turn" http://127.0.0.1:7412/v1/chat/completions \
        -H 'Content-Type: application/json' -d "$body")
  verdict=$(grep -i '^x-kvbridge:' "$WORK/h$turn" | tr -d '\r' | cut -d' ' -f2-)
  [ -n "$(echo "$out" | grep -o usage)" ] || echo "netns_loop: turn $turn: reply: $out"
  echo "netns_loop: turn $turn: verdict '$verdict'; usage: $(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["usage"]["kvbridge"])')"
  [ "$verdict" = complete ] || fail=1
done
# Throughput beside the raw shaped link, measured the same way in the same run (printed, not
# asserted: a benchmark, not a timed test): the whole slab path (a prefill node shipping filler
# rows: cut, checksummed, striped over 4 lanes, verified and committed by the decoder; 128 MiB per
# prompt), then the transport alone.
ip netns exec $P "$K" serve --role prefill --listen 10.213.7.1:7413 -m "$M" --threads 1 --ctx 70000 \
  --bench-filler-rows >"$WORK/f.log" 2>&1 &
ip netns exec $P "$K" bench link --listen 10.213.7.1:7420 >"$WORK/l.log" 2>&1 &
sleep 0.5
ip netns exec $D "$K" bench ladder -m "$M" --peer 10.213.7.1:7413 --raw-peer 10.213.7.1:7420 --slab-path-only \
  --lengths 65536 --seeds 3 2>/dev/null | grep -E "^ +65536|raw TCP" | sed 's/^ */netns_loop: slab path: /'
ip netns exec $D "$K" bench link --peer 10.213.7.1:7420 --bytes 268435456 --reps 3 2>/dev/null | sed 's/^/netns_loop: /'
[ $fail = 0 ] || { echo "--- prefill log"; cat "$WORK/p.log"; echo "--- decode log"; cat "$WORK/d.log"; }
echo "netns_loop: $((2 - fail)) passed, $fail failed"
exit $fail
