#!/usr/bin/env python3
"""Time to first token through kvbridge's llama-server door against llama-server alone.

Driven by tools/device/llama_door_check.sh, which starts llama-server (two slots: the door owns
slot 0, llama-server alone runs in slot 1), a prefill node and the door. Standard library only.

Cold prompts: for each length, the door bridges the prompt (slot 0), then llama-server alone
computes the whole of it (cache_prompt off, slot 1): wall time of a 1-token completion each, the door's
verdict and usage.kvbridge, and whether the first token agrees.

Conversation: TURNS turns, each appending TURN_TOKENS new tokens to the one before. The door
ships only each turn's increment (usage.kvbridge.bridged); llama-server alone keeps its own
history in slot 1 (cache_prompt on), which is the fair multi-turn baseline: it too computes only
the increment. Both are timed per turn.

Prints a table and writes every row as JSON (--out)."""
import argparse
import json
import random
import sys
import time
import urllib.request


def post(url, body, timeout=900):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = json.loads(r.read())
        hdr = dict(r.headers)
    return time.perf_counter() - t0, data, hdr


def alone(server, ids, cache):
    s, d, _ = post(server + "/completion", {"prompt": ids, "n_predict": 1, "temperature": 0, "id_slot": 1,
                                            "cache_prompt": cache})
    return {"s": s, "prompt_n": d.get("timings", {}).get("prompt_n"), "tokens": d.get("tokens"),
            "content": d.get("content")}


def door(url, ids):
    s, d, h = post(url + "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0})
    kb = d.get("usage", {}).get("kvbridge", {})
    return {"s": s, "verdict": h.get("X-KVBridge", h.get("x-kvbridge", "")), "content": d["choices"][0]["text"],
            "cached": kb.get("cached_tokens"), "bridged": kb.get("bridged_tokens"), "native": kb.get("native_tokens"),
            # the door's own split: asking the prefill node, writing the slot file and restoring it;
            # then llama-server's tail and first token
            "tokenize_s": kb.get("tokenize_s"), "bridge_restore_s": kb.get("transfer_s"), "tail_s": kb.get("decode_s")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="llama-server's URL")
    ap.add_argument("--door", required=True, help="the door's URL")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=2048)
    ap.add_argument("--first-turn", type=int, default=8192)
    ap.add_argument("--id-lo", type=int, default=1000,
                    help="prompt ids are drawn from [id-lo, id-hi), within the middle half of the vocabulary")
    ap.add_argument("--id-hi", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with urllib.request.urlopen(a.server + "/v1/models", timeout=30) as r:
        n_vocab = json.loads(r.read())["data"][0]["meta"]["n_vocab"]
    a.id_lo, a.id_hi = min(a.id_lo, n_vocab // 4), min(a.id_hi, n_vocab * 3 // 4)  # clear of special tokens
    rows = []
    print(f"{'prompt':>8} {'alone s':>9} {'door s':>9} {'ratio':>7}  {'bridged':>8} {'native':>7}  same  verdict")
    for n in [int(x) for x in a.lengths.split(",")]:
        ids = [rng.randrange(a.id_lo, a.id_hi) for _ in range(n)]
        dr = door(a.door, ids)  # the door first: at 32K llama-server alone takes minutes, and a call cut
        print(f"{n:>8} {'':>9} {dr['s']:>9.3f}  (door; llama-server alone now)", flush=True)  # short keeps this
        al = alone(a.server, ids, False)
        same = al["content"] == dr["content"]
        rows.append({"kind": "cold", "tokens": n, "alone": al, "door": dr, "same": same})
        print(f"{n:>8} {al['s']:>9.3f} {dr['s']:>9.3f} {al['s'] / dr['s']:>6.2f}x  {dr['bridged']!s:>8} "
              f"{dr['native']!s:>7}  {'yes' if same else 'NO':>4}  {dr['verdict']}", flush=True)
    print(f"\nconversation: {a.turns} turns, first {a.first_turn} tokens, then +{a.turn_tokens} each; llama-server "
          "alone keeps its own history (cache_prompt)")
    print(f"{'turn':>4} {'prompt':>8} {'alone s':>9} {'door s':>9} {'ratio':>7}  {'cached':>7} {'bridged':>8} "
          f"{'native':>7} {'alone computed':>14}  same  verdict")
    conv = []
    for t in range(a.turns):
        conv += [rng.randrange(a.id_lo, a.id_hi) for _ in range(a.first_turn if t == 0 else a.turn_tokens)]
        al = alone(a.server, conv, True)
        dr = door(a.door, conv)
        same = al["content"] == dr["content"]
        rows.append({"kind": "turn", "turn": t + 1, "tokens": len(conv), "alone": al, "door": dr, "same": same})
        print(f"{t + 1:>4} {len(conv):>8} {al['s']:>9.3f} {dr['s']:>9.3f} {al['s'] / dr['s']:>6.2f}x  "
              f"{dr['cached']!s:>7} {dr['bridged']!s:>8} {dr['native']!s:>7} {al['prompt_n']!s:>14}  "
              f"{'yes' if same else 'NO':>4}  {dr['verdict']}", flush=True)
    print("\nthe door's time (s): tokenize / bridge and restore / llama-server's tail and first token")
    for r in rows:
        d = r["door"]
        f = [f"{x:.3f}" if isinstance(x, (int, float)) else "-" for x in (d["tokenize_s"], d["bridge_restore_s"], d["tail_s"])]
        print(f"  {r['kind']} {r.get('turn', '')} {r['tokens']}: {' / '.join(f)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r["door"]["verdict"].startswith("complete")]
    if bad:
        print(f"{len(bad)} rows not 'complete'", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
