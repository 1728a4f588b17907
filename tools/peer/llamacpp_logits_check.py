#!/usr/bin/env python3
"""llama.cpp, an independent implementation, against kvbridge's CPU engine on the same GGUF: every
prompt position's logits from llama.cpp (llama-cpp-python, the project's pinned peer, CPU only,
logits_all, f32 logits) beside kvbridge's (`kvbridge run --tokens ... -n 0 --logits-out F
--logits-all`, one prefill forward that returns every position's logits). Prompts are token ids
(seeded, the same to both), so neither tokenizer is involved. Per prompt it prints whether the
top-1 token is equal at every position, the argmax agreement rate, the max abs logit difference
and, where a top-1 differs, llama.cpp's own margin between the two tokens (a near-tie or not).

Models: --model FILE (repeatable), or --preset NAMES --types LIST, which generates
`kvbridge gen-model --preset NAME --type T` files in a temporary folder for each preset and type. The KV cache is f32 on
both sides by default (--cache-type f16 for both: llama.cpp's default).

Usage (in the peer venv, tools/peer/setup_llamacpp.sh):
  .venv-peer/bin/python tools/peer/llamacpp_logits_check.py --kvbridge build/kvbridge \\
      --preset tiny-moe --types f32,bf16,f16,q8_0 [--max-abs TOL] [--json OUT]
Exit 0 when every prompt's top-1 is equal at every position (with --near-ties: or differs only where
llama.cpp's own margin is below twice the prompt's max abs difference) and, with --max-abs, every max
abs difference is within TOL; 1 otherwise; 77 (skip) without llama_cpp or numpy, or with a llama.cpp
built for instructions this CPU lacks.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

SKIP = 77
# (name, length, seed): one token; a short prompt; one that routes to every expert of tiny-moe; one
# longer than kvbridge's and llama.cpp's smallest chunking steps
PROMPTS = [("single", 1, 11), ("short", 7, 12), ("medium", 40, 13), ("long", 150, 14)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvbridge", required=True, help="the kvbridge binary")
    p.add_argument("--model", action="append", default=[], help="a GGUF file (repeatable)")
    p.add_argument("--preset", help="generate these presets' files (kvbridge gen-model; comma-separated)")
    p.add_argument("--types", default="f32,bf16,f16,q8_0", help="with --preset: the weight types")
    p.add_argument("--cache-type", default="f32", choices=["f32", "f16"], help="KV cache type of both")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-abs", type=float, default=0.0, help="also fail a max abs difference above this (0: off)")
    p.add_argument("--near-ties", action="store_true",
                   help="pass a top-1 mismatch where llama.cpp's own margin between the two tokens is below twice "
                        "the prompt's max abs difference (a near-tie that the stated arithmetic difference can flip; "
                        "--max-abs still bounds that difference)")
    p.add_argument("--json", help="write the per-prompt figures to this file")
    return p.parse_args()


def prompt_ids(n_vocab, length, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, n_vocab, size=length)]


def llamacpp_logits(llm, ids):
    """(len(ids), n_vocab) f32: llama.cpp's logits at every position of a fresh sequence."""
    import numpy as np
    llm.reset()  # n_tokens = 0: eval() then drops every cached position first
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def kvbridge_logits(kvbridge, model, ids, n_vocab, cache_type, threads, tmp):
    import numpy as np
    out = os.path.join(tmp, "kvb_logits.bin")
    cmd = [kvbridge, "run", "-m", model, "--tokens", ",".join(map(str, ids)), "-n", "0", "--threads", str(threads),
           "--cache-type", cache_type, "--logits-out", out, "--logits-all", "--output", "ids"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    a = np.fromfile(out, dtype="<f4")
    if a.size != len(ids) * n_vocab:
        raise RuntimeError(f"kvbridge wrote {a.size} logits, expected {len(ids)} x {n_vocab}")
    return a.reshape(len(ids), n_vocab)


def compare(ref, ours):
    """The figures of one prompt: llama.cpp's logits `ref` against kvbridge's `ours`, (n, n_vocab)."""
    import numpy as np
    a_ref, a_ours = ref.argmax(axis=1), ours.argmax(axis=1)
    same = a_ref == a_ours
    diff = np.abs(ref.astype(np.float64) - ours.astype(np.float64))
    rows = np.arange(ref.shape[0])
    # where the top-1 differs: llama.cpp's own margin between its top-1 and ours (a near-tie if small)
    margins = (ref[rows, a_ref] - ref[rows, a_ours])[~same]
    return {
        "positions": int(ref.shape[0]),
        "top1_all_equal": bool(same.all()),
        "agreement": float(same.mean()),
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "max_logit": float(np.abs(ref).max()),
        "mismatch_margins": [float(m) for m in margins],
    }


def runs_here(model):
    """None when llama.cpp loads `model` and evaluates a token in a child process, else why not. The
    portable peer build uses AVX-512, which some development CPUs lack: there it dies of SIGILL."""
    code = ("import sys; from llama_cpp import Llama; "
            "Llama(model_path=sys.argv[1], n_ctx=16, n_gpu_layers=0, verbose=False).eval([1])")
    r = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True)
    if r.returncode == 0:
        return None
    if r.returncode == -signal.SIGILL:
        return ("llama.cpp was built for instructions this CPU lacks (the portable peer build uses AVX-512); "
                "tools/peer/setup_llamacpp.sh --native builds one for this machine")
    raise RuntimeError(f"llama.cpp cannot load {model}: exit {r.returncode}\n{r.stderr[-2000:]}")


def check_model(args, model, tmp):
    import llama_cpp
    from llama_cpp import Llama
    kv_type = llama_cpp.GGML_TYPE_F32 if args.cache_type == "f32" else llama_cpp.GGML_TYPE_F16
    n_ctx = max(n for _, n, _ in PROMPTS) + 16
    llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=args.threads,
                n_gpu_layers=0, logits_all=True, type_k=kv_type, type_v=kv_type, verbose=False)
    n_vocab = llm.n_vocab()
    results = []
    for name, length, seed in PROMPTS:
        ids = prompt_ids(n_vocab, length, seed)
        r = compare(llamacpp_logits(llm, ids), kvbridge_logits(args.kvbridge, model, ids, n_vocab, args.cache_type,
                                                              args.threads, tmp))
        r.update(model=os.path.basename(model), prompt=name)
        results.append(r)
        margins = ", ".join(f"{m:.4g}" for m in r["mismatch_margins"])
        print(f"{os.path.basename(model):28s} {name:7s} {length:4d} pos  top-1 equal at every position: "
              f"{'yes' if r['top1_all_equal'] else 'NO '}  agreement {100 * r['agreement']:6.2f}%  "
              f"max abs {r['max_abs']:.3e}  mean abs {r['mean_abs']:.3e}  (|logit| up to {r['max_logit']:.2f})"
              + (f"  llama.cpp margins at mismatches: {margins}" if margins else ""), flush=True)
    del llm
    return results


def main():
    args = parse_args()
    try:
        import numpy  # noqa: F401
        import llama_cpp
    except ImportError as e:
        print(f"llamacpp_logits_check: SKIP: llama-cpp-python or numpy is missing ({e}); "
              "tools/peer/setup_llamacpp.sh makes the peer venv")
        return SKIP
    print(f"llamacpp_logits_check: llama-cpp-python {llama_cpp.__version__}, KV cache {args.cache_type}, "
          f"{args.threads} threads")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models = list(args.model)
        for preset in args.preset.split(",") if args.preset else []:
            for t in args.types.split(","):
                path = os.path.join(tmp, f"{preset}-{t}.gguf")
                subprocess.run([args.kvbridge, "gen-model", "--preset", preset, "--type", t, "--out", path,
                                "--quiet"], check=True)
                models.append(path)
        if not models:
            print("llamacpp_logits_check: give --model FILE or --preset NAME", file=sys.stderr)
            return 2
        why = runs_here(models[0])
        if why:
            print(f"llamacpp_logits_check: SKIP: {why}")
            return SKIP
        for model in models:
            results += check_model(args, model, tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    def top1_ok(r):
        if r["top1_all_equal"]:
            return True
        return args.near_ties and all(m < 2 * r["max_abs"] for m in r["mismatch_margins"])

    bad = [r for r in results if not top1_ok(r) or (args.max_abs and r["max_abs"] > args.max_abs)]
    ties = sum(len(r["mismatch_margins"]) for r in results if r not in bad)
    if ties:
        print(f"llamacpp_logits_check: {ties} top-1 mismatch(es) passed as near-ties (--near-ties)")
    for r in bad:
        print(f"llamacpp_logits_check: FAIL: {r['model']} {r['prompt']}: top-1 agreement "
              f"{100 * r['agreement']:.2f}%, max abs {r['max_abs']:.3e}")
    print(f"llamacpp_logits_check: {len(results) - len(bad)}/{len(results)} prompts agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
