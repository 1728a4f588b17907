#!/usr/bin/env python3
"""The agreement study (issue 35): a stock llama-server as the decoder, its own prompt processing
against prompts bridged into it through kvbridge's front door, at each fidelity level of the K/V
the prefill node computes (`kvbridge serve --role prefill --kv-arith engine|ggml`).

For every prompt (lengths log-uniform over [--min-tokens, --max-tokens], stratified so that any
first few prompts span the range, texts cut from a fixed
corpus: the docstrings of Python's standard library, every module in sorted order, at seeded
offsets; nothing is downloaded) three runs on the same llama-server (-np 1, f16 cache, greedy,
64 tokens, EOS ignored, n_probs K):
  alone   POST /completion with the prompt's token ids and cache_prompt false: llama-server
          computes the whole prompt itself;
  LEVEL   the prompt through the door (POST /v1/completions, max_tokens 1): the door asks the
          prefill node for the K/V of every whole block before the last token, writes them as
          llama.cpp's slot file and restores it into slot 0; llama-server computes the tail. Then
          the same /completion as `alone` but with cache_prompt true and id_slot 0: llama-server
          reuses the restored rows and the tail it computed (timings.prompt_n says how many it
          computed again; a reply with more than a block recomputed is marked `not_reused`).
  split   the control, without kvbridge: llama-server computes the door's prefix (every whole
          block before the last token) itself, then the whole prompt with cache_prompt true: its
          own rows with the same split, which shows how much llama-server's reply moves with how
          its cache came about alone.
Recorded per prompt and level (one JSON line each in --out, appended; a rerun skips what is there,
except turns the door did not bridge whole, which it runs again):
the tokens equal to alone's up to the first divergence (of --n-predict), whether all are equal,
and the next-token KL(alone || bridged) at the first generated position.

KL from top-k: llama-server returns the K most probable tokens with their log-probabilities
(softmax over the whole vocabulary, before sampling). With P = alone's, Q = bridged's:
  KL ~= sum over P's top K of p_i log(p_i / q_i) + p_rest log(p_rest / q_rest)
where q_i is Q's probability when i is in Q's top K, else Q's K-th probability (an upper bound
of q_i), p_rest = 1 - sum of P's top K and q_rest = 1 - the sum of the q_i used (clamped at
1e-12): the tail lumped into one bin. Where Q's top K holds every token of P's this is KL over a
coarser partition, so by the log-sum inequality a lower bound of the true KL, tight when P's top K
holds nearly all its mass (each record has p_rest); a token of P's top K absent from Q's makes it
an estimate only.

usage: tools/peer/llama_study.py --server BIN --kvbridge BIN --model GGUF [--prompts 100]
       [--min-tokens 1024] [--max-tokens 16384] [--levels engine,ggml] [--threads 2] [--out FILE]
       [--deadline HH:MM] (stop starting new prompts after this UTC time)
Run it under `nice -n 15` on a shared machine. Summary: --summarize FILE prints the table.

Several machines, one study: the corpus is this Python's standard library, so another machine's
Python cuts other texts. `--save-prompts FILE` writes the prompt texts (needs only --server and
--model) and `--load-prompts FILE` runs those instead of cutting its own. Several rigs on one
machine share the work: `--indices 40-99` limits a rig to those prompts, `--claim-dir DIR` gives
each prompt to the first rig that claims it (a file DIR/I made exclusively), `--longest-first`
orders them by length, and `--stop-at EPOCH` starts no prompt this rig's own pace (seconds per
prompt token so far, `--pace` before the first) says would end after EPOCH. `--tag` names the machine in every record.
"""
import argparse
import collections
import datetime
import json
import math
import os
import pkgutil
import random
import signal
import socket
import sysconfig
import subprocess
import sys
import tempfile
import time
import urllib.request
import importlib

PSK = "kvbridge-llama-study-pre-shared-key"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def post(url, body, timeout=3600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode()), dict(r.headers)


def wait_health(url, proc, what, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited (rc {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} not healthy after {timeout} s")


def corpus():
    """Docstrings of the standard library's modules, in sorted module order (deterministic for one
    Python version); modules that fail to import or print on import are skipped."""
    std = sysconfig.get_paths()["stdlib"]
    names = sorted(m.name for m in pkgutil.iter_modules() if getattr(m.module_finder, "path", "") in
                   (std, os.path.join(std, "lib-dynload")) and not m.name.startswith("_") and
                   m.name not in ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"))
    parts = []
    devnull = open(os.devnull, "w")
    for n in names:
        try:
            old = sys.stdout
            sys.stdout = devnull
            try:
                mod = importlib.import_module(n)
            finally:
                sys.stdout = old
        except BaseException:
            continue
        for obj in [mod] + [getattr(mod, a, None) for a in sorted(dir(mod)) if not a.startswith("_")]:
            d = getattr(obj, "__doc__", None)
            if isinstance(d, str) and len(d) > 200 and d not in parts:
                parts.append(d.strip())
    return "\n\n".join(parts)


def make_prompts(args, server_url):
    text = corpus()
    rng = random.Random(args.seed)
    # log-uniform, stratified: prompt i falls in stratum perm[i] of N equal slices of log-length,
    # so the first prompts of a run cut short already span the range
    perm = list(range(args.prompts))
    rng.shuffle(perm)
    lo, hi = math.log(args.min_tokens), math.log(args.max_tokens)
    prompts = []
    for i in range(args.prompts):
        target = int(round(math.exp(lo + (perm[i] + rng.random()) / args.prompts * (hi - lo))))
        chars = min(len(text) - 1, target * 6)
        start = rng.randrange(0, len(text) - chars)
        chunk = text[start:start + chars]
        ids = post(server_url + "/tokenize", {"content": chunk, "add_special": True})[0]["tokens"]
        ids = ids[:target]
        piece = post(server_url + "/detokenize", {"tokens": ids[1:]})[0]["content"]  # without BOS
        prompts.append({"i": i, "target": target, "text": piece})
    return prompts


def completion(server_url, ids, args, reuse):
    args = args if isinstance(args, dict) else vars(args)
    body = {"prompt": ids, "n_predict": args["n_predict"], "temperature": 0, "top_k": 1, "n_probs": args["top_k"],
            "ignore_eos": True, "cache_prompt": reuse, "id_slot": 0, "return_tokens": True, "seed": 0}
    r = post(server_url + "/completion", body)[0]
    probs = r.get("completion_probabilities") or []
    top = {}
    if probs:
        first = probs[0]
        for e in first.get("top_logprobs") or first.get("top_probs") or []:
            lp = e["logprob"] if "logprob" in e else math.log(max(e["prob"], 1e-45))
            top[int(e["id"])] = lp
    return {"tokens": r.get("tokens") or [], "top": top, "prompt_n": r.get("timings", {}).get("prompt_n"),
            "text": r.get("content", "")}


def kl_topk(p_top, q_top):
    p = {i: math.exp(lp) for i, lp in p_top.items()}
    q_all = {i: math.exp(lp) for i, lp in q_top.items()}
    q_floor = min(q_all.values()) if q_all else 1e-12
    kl, q_used = 0.0, 0.0
    for i, pi in p.items():
        qi = q_all.get(i, q_floor)
        q_used += qi
        if pi > 0:
            kl += pi * math.log(pi / max(qi, 1e-45))
    p_rest = max(0.0, 1.0 - sum(p.values()))
    q_rest = max(1e-12, 1.0 - q_used)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0), p_rest


def agreement(a, b, n):
    eq = 0
    while eq < min(len(a), len(b), n) and a[eq] == b[eq]:
        eq += 1
    return eq, eq == n and len(a) >= n and len(b) >= n


class Rig:
    """llama-server, and per level a prefill node and a door in front of that llama-server."""

    def __init__(self, args, tmp):
        self.procs = []
        self.args = args
        self.slots = os.path.join(tmp, "slots")
        os.makedirs(self.slots, exist_ok=True)
        self.server_url = f"http://127.0.0.1:{free_port()}"
        ctx = args.max_tokens + args.n_predict + 256
        self.start([args.server, "-m", args.model, "--host", "127.0.0.1", "--port", self.server_url.rsplit(":", 1)[1],
                    "-np", "1", "-c", str(ctx), "-t", str(args.threads), "-ctk", "f16", "-ctv", "f16",
                    "--slot-save-path", self.slots, "-fa", "off", "--cache-ram", "0", "--no-webui", "--no-warmup"],
                   os.path.join(tmp, "server.log"))
        wait_health(self.server_url, self.procs[-1], "llama-server")
        self.doors = {}
        for level in args.levels:
            if level == "split":
                continue
            peer = f"127.0.0.1:{free_port()}"
            self.start([args.kvbridge, "serve", "--role", "prefill", "-m", args.model, "--listen", peer, "--psk", PSK,
                        "--threads", str(args.threads), "--ctx", str(ctx), "--kv-arith", level, "--name", "pf-" + level],
                       os.path.join(tmp, f"prefill-{level}.log"))
            time.sleep(2)
            http = f"127.0.0.1:{free_port()}"
            self.start([args.kvbridge, "serve", "--role", "decode", "-m", args.model, "--decoder",
                        "llama-server=" + self.server_url, "--slot-dir", self.slots, "--peer", peer, "--psk", PSK,
                        "--http", http, "--ctx", str(ctx), "--name", "door-" + level],
                       os.path.join(tmp, f"door-{level}.log"))
            wait_health("http://" + http, self.procs[-1], "door " + level)
            self.doors[level] = "http://" + http

    def start(self, argv, log):
        f = open(log, "w")
        self.procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT))

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def parse_indices(spec, n):
    """'40-99,3' -> [40, ..., 99, 3]; None -> every prompt."""
    if not spec:
        return list(range(n))
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return [i for i in out if 0 <= i < n]


def claim(claim_dir, i):
    """True for the first rig that asks for prompt i (an exclusively created file)."""
    if not claim_dir:
        return True
    try:
        os.close(os.open(os.path.join(claim_dir, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def save_prompts(args):
    tmp = tempfile.mkdtemp(prefix="kvb-study-")
    rig = Rig(argparse.Namespace(**dict(vars(args), levels=["split"])), tmp)  # llama-server only
    try:
        with open(args.save_prompts, "w") as f:
            for p in make_prompts(args, rig.server_url):
                f.write(json.dumps(p) + "\n")
    finally:
        rig.stop()
    print("prompts written to", args.save_prompts)


def run(args):
    done = set()
    if os.path.exists(args.out):
        for line in open(args.out):
            r = json.loads(line)
            if r["verdict"] == "complete":  # a turn declined (a busy machine misses the door's deadlines) runs again
                done.add((r["i"], r["level"]))
    tmp = tempfile.mkdtemp(prefix="kvb-study-")
    # SIGTERM (a deadline's kill) unwinds like Ctrl-C, so the rig's servers stop with this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rig = Rig(args, tmp)
    try:
        if args.load_prompts:
            prompts = [json.loads(line) for line in open(args.load_prompts)]
        else:
            prompts = make_prompts(args, rig.server_url)
        by_index = {p["i"]: p for p in prompts}
        order = [by_index[i] for i in parse_indices(args.indices, len(prompts)) if i in by_index]
        if args.longest_first:
            order.sort(key=lambda p: -p["target"])
        out = open(args.out, "a")
        spent_s, spent_tokens = 0.0, 0
        for p in order:
            if args.deadline and datetime.datetime.utcnow().strftime("%H:%M") >= args.deadline:
                print("deadline reached: stopping", flush=True)
                break
            if all((p["i"], lv) in done for lv in args.levels):
                continue
            pace = spent_s / spent_tokens if spent_tokens else args.pace
            if args.stop_at and pace and time.time() + pace * p["target"] > args.stop_at:
                continue  # would not end in time at this rig's pace; a shorter one may
            if not claim(args.claim_dir, p["i"]):
                continue
            t_prompt = time.time()
            ids = post(rig.server_url + "/tokenize", {"content": p["text"], "add_special": True,
                                                     "parse_special": True})[0]["tokens"]
            t0 = time.time()
            alone = completion(rig.server_url, ids, args, False)
            t_alone = time.time() - t0
            for level in args.levels:
                if (p["i"], level) in done:
                    continue
                t0 = time.time()
                if level == "split":  # the control: llama-server's own rows for the door's prefix
                    cut = (len(ids) - 1) // 32 * 32
                    completion(rig.server_url, ids[:cut], dict(vars(args), n_predict=1, top_k=0), False)
                    r, kb = {}, {"verdict": "complete", "bridged_tokens": cut, "native_tokens": len(ids) - cut}
                else:
                    r, hdr = post(rig.doors[level] + "/v1/completions",
                                  {"model": "m", "prompt": p["text"], "max_tokens": 1, "temperature": 0})
                    kb = r.get("usage", {}).get("kvbridge", {})
                br = completion(rig.server_url, ids, args, True)
                eq, all_eq = agreement(alone["tokens"], br["tokens"], args.n_predict)
                kl, p_rest = kl_topk(alone["top"], br["top"])
                rec = {"i": p["i"], "level": level, "tokens": len(ids), "verdict": kb.get("verdict"),
                       "bridged": kb.get("bridged_tokens"), "native": kb.get("native_tokens"),
                       "door_prompt_tokens": r.get("usage", {}).get("prompt_tokens"),
                       "recomputed": br["prompt_n"], "not_reused": (br["prompt_n"] or 0) > 33,
                       "tokens_equal": eq, "all_equal": all_eq, "kl": kl, "p_rest": p_rest,
                       "top1_equal": bool(alone["top"]) and bool(br["top"]) and
                       max(alone["top"], key=alone["top"].get) == max(br["top"], key=br["top"].get),
                       "alone_s": round(t_alone, 1), "bridged_s": round(time.time() - t0, 1)}
                if args.tag:
                    rec["where"] = args.tag
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(json.dumps(rec), flush=True)
            spent_s += time.time() - t_prompt
            spent_tokens += len(ids)
    finally:
        rig.stop()
        if args.keep_logs:
            print("logs in", tmp)


def summarize(path):
    rows = [json.loads(l) for l in open(path)]
    print("| level | prompts (tokens) | all-64-equal | mean tokens equal | mean KL | max KL | KL 0 | top-1 equal | "
          "records not counted (not complete or not reused) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for level in sorted({r["level"] for r in rows}):
        rs = [r for r in rows if r["level"] == level and r["verdict"] == "complete" and not r["not_reused"]]
        if not rs:
            continue
        n = len(rs)
        lens = sorted(r["tokens"] for r in rs)
        print(f"| {level} | {n} ({lens[0]}-{lens[-1]}) | {100 * sum(r['all_equal'] for r in rs) / n:.0f} % | "
              f"{sum(r['tokens_equal'] for r in rs) / n:.1f} | {sum(r['kl'] for r in rs) / n:.2e} | "
              f"{max(r['kl'] for r in rs):.2e} | {sum(r['kl'] == 0 for r in rs)} | {sum(r['top1_equal'] for r in rs)}/{n} | "
              f"{sum(1 for r in rows if r['level'] == level) - n} |")
    ok = {(r["i"], r["level"]): r for r in rows if r["verdict"] == "complete" and not r["not_reused"]}
    both = sorted({i for i, lv in ok if lv == "engine" and (i, "ggml") in ok})
    if both:
        lower = sum(ok[(i, "ggml")]["kl"] < ok[(i, "engine")]["kl"] for i in both)
        more = sum(ok[(i, "ggml")]["tokens_equal"] > ok[(i, "engine")]["tokens_equal"] for i in both)
        fewer = sum(ok[(i, "ggml")]["tokens_equal"] < ok[(i, "engine")]["tokens_equal"] for i in both)
        ties = sum(ok[(i, "ggml")]["kl"] == ok[(i, "engine")]["kl"] for i in both)
        n, k = len(both) - ties, lower
        tail = sum(math.comb(n, j) for j in range(0, n + 1) if abs(j - n / 2) >= abs(k - n / 2)) / 2 ** n if n else 1
        print(f"\nper prompt, ggml against engine over {len(both)} prompts: lower KL in {lower} "
              f"(ties {ties}; two-sided sign test p = {tail:.2g}), more tokens equal in {more}, fewer in {fewer}")
    print("\nmean KL by prompt length:")
    levels = sorted({lv for _, lv in ok})
    print("| tokens | prompts | " + " | ".join(levels) + " |")
    print("|---" * (len(levels) + 2) + "|")
    for lo, hi in ((1024, 2048), (2048, 4096), (4096, 8192), (8192, 16385)):
        ids = sorted({i for (i, lv), r in ok.items() if lo <= r["tokens"] < hi})
        cells = []
        for lv in levels:
            ks = [ok[(i, lv)]["kl"] for i in ids if (i, lv) in ok]
            cells.append(f"{sum(ks) / len(ks):.1e}" if ks else "—")
        print(f"| {lo}–{hi - 1} | {len(ids)} | " + " | ".join(cells) + " |")
    where = collections.Counter(r.get("where", "dev") for r in rows)  # records before --tag: dev
    print("\nrecords by machine: " + ", ".join(f"{w} {n}" for w, n in sorted(where.items())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server")
    ap.add_argument("--kvbridge")
    ap.add_argument("--model")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=20, help="n_probs: top tokens llama-server reports")
    ap.add_argument("--levels", default="split,engine,ggml",
                    help="engine, ggml: through the door at that --kv-arith; split: the control (no door)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--out", default="llama_study.jsonl")
    ap.add_argument("--deadline", help="HH:MM UTC: start no prompt after it")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--summarize", metavar="FILE")
    ap.add_argument("--save-prompts", metavar="FILE", help="write the prompt texts (JSON lines) and stop")
    ap.add_argument("--load-prompts", metavar="FILE", help="run these prompt texts instead of cutting them here")
    ap.add_argument("--indices", help="only these prompts, e.g. 40-99,3")
    ap.add_argument("--claim-dir", help="share the prompts with other rigs claiming in DIR")
    ap.add_argument("--longest-first", action="store_true")
    ap.add_argument("--stop-at", type=float, help="epoch seconds: start no prompt this rig's pace says ends later")
    ap.add_argument("--pace", type=float, help="seconds per prompt token: --stop-at's guess before a prompt is done")
    ap.add_argument("--tag", help="the machine, recorded in every record as 'where'")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if args.save_prompts:
        if not (args.server and args.model):
            ap.error("--save-prompts needs --server and --model")
        save_prompts(args)
        return
    if not (args.server and args.kvbridge and args.model):
        ap.error("--server, --kvbridge and --model are needed")
    args.levels = args.levels.split(",")
    run(args)


if __name__ == "__main__":
    main()
