#!/usr/bin/env python3
"""The prefill peer for `kvbridge bench prefill --device cuda`: PyTorch + transformers
LlamaForCausalLM (SDPA attention, bf16, random weights, Llama-3.1-8B shape) on the same GPU, timing
a prompt forward WITHOUT the output head (model.model(...), use_cache=True so the KV cache is
built as a prefill would) at several prompt lengths. Prints one JSON object (and writes it with
--out) that `kvbridge bench prefill --peer-json FILE` reads:

  {"peer": "...", "torch": "2.11.0", "transformers": "5.17.0", "device": "NVIDIA H200",
   "results": [{"tokens": 2048, "tok_s": 33800.0, "runs_tok_s": [...], "peak_gib": 17.1}, ...]}

Method: weights drawn on the GPU (normal, std 0.02; norms 1); per size one warm-up forward, then
--reps timed forwards on fresh random token ids, each timed with torch.cuda.synchronize() around
it; the median is reported with every run listed.
"""
import argparse
import json
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,8192,32768", help="comma-separated prompt lengths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3.1-8B)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",") if s]

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    rope_note = "llama3 rope scaling"
    try:  # transformers 5 spells it rope_parameters; 4.x rope_scaling + rope_theta
        cfg = LlamaConfig(rope_parameters=dict(rope, rope_theta=500000.0), **kw)
    except Exception:
        try:
            cfg = LlamaConfig(rope_scaling=rope, rope_theta=500000.0, **kw)
        except Exception:
            cfg = LlamaConfig(rope_theta=500000.0, **kw)
            rope_note = "plain rope (llama3 scaling not accepted by this transformers)"
    cfg._attn_implementation = "sdpa"

    torch.manual_seed(0)
    dev = torch.device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with dev:
        model = LlamaForCausalLM(cfg)
    model = model.to(device=dev, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    torch.cuda.synchronize()
    t_init = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()

    results = []
    for n in sizes:
        runs = []
        torch.cuda.reset_peak_memory_stats()
        for r in range(args.reps + 1):
            ids = torch.randint(0, cfg.vocab_size, (1, n), device=dev, generator=None)
            torch.cuda.synchronize()
            a = time.perf_counter()
            with torch.inference_mode():
                out = model.model(input_ids=ids, use_cache=True)
            torch.cuda.synchronize()
            b = time.perf_counter()
            del out
            if r > 0:  # r == 0 is the warm-up
                runs.append(n / (b - a))
                print(f"peer: {n} tokens, run {r}/{args.reps}: {n / (b - a):.0f} tok/s ({b - a:.3f} s)",
                      file=sys.stderr, flush=True)
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        results.append({"tokens": n, "tok_s": statistics.median(runs), "runs_tok_s": runs, "peak_gib": peak})

    doc = {
        "peer": (f"PyTorch {torch.__version__} + transformers {transformers.__version__} LlamaForCausalLM "
                 f"({model.config._attn_implementation}, bf16, random weights, Llama-3.1-8B shape, {args.layers} "
                 f"layers, {rope_note}), model.model(...) without the output head, use_cache=True"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "device": torch.cuda.get_device_name(0),
        "params_nonembd_no_head": n_params,
        "init_s": t_init,
        "results": results,
    }
    txt = json.dumps(doc)
    print(txt)
    if args.out:
        with open(args.out, "w") as f:
            f.write(txt + "\n")


if __name__ == "__main__":
    main()
