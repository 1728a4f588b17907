#!/usr/bin/env python3
"""The mixture-of-experts prefill peer for `kvbridge bench prefill --device cuda` on the
qwen3-30b-a3b preset: PyTorch + transformers Qwen3MoeForCausalLM (SDPA attention, bf16, random
weights, Qwen3-30B-A3B shape: 48 layers, hidden 2048, 32/4 heads x 128, 128 experts top-8 of inner
size 768, top-k probabilities renormalised) on the same GPU, timing a prompt forward WITHOUT the
output head (model.model(...), use_cache=True so the KV cache is built as a prefill would) at
several prompt lengths. Prints one JSON object (and writes it with --out) that
`kvbridge bench prefill --peer-json FILE` reads, in torch_llama_prefill.py's form:

  {"peer": "...", "torch": "2.11.0", "transformers": "5.17.0", "device": "NVIDIA H200",
   "results": [{"tokens": 8192, "tok_s": ..., "runs_tok_s": [...], "peak_gib": ...}, ...]}

Method: weights drawn on the device (normal, std 0.02; norms 1); per size one warm-up forward, then
--reps timed forwards on fresh random token ids, each timed with a device synchronise around it;
the median is reported with every run listed. params_active_nonembd_no_head counts what one token
reads (attention, norms, the router, its 8 routed experts), the count `bench prefill` takes its
FLOPs from. --tiny (2 layers, hidden 256, 8 experts top-2) and --device cpu check the script
without a GPU.
"""
import argparse
import json
import statistics
import sys
import time


def make_config(Qwen3MoeConfig, args):
    if args.tiny:
        kw = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                  num_experts_per_tok=2)
    else:
        kw = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8)
    kw.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
              rms_norm_eps=1e-6, tie_word_embeddings=False, output_router_logits=False)
    try:  # transformers 5 spells it rope_parameters; 4.x rope_theta
        cfg = Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **kw)
    except Exception:
        cfg = Qwen3MoeConfig(rope_theta=1000000.0, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def active_params(model, cfg):
    """Non-embedding parameters one token reads, without the output head: every parameter of the
    layers except the experts', plus n_experts_per_tok / num_experts of the experts'."""
    total, experts = 0, 0
    for name, p in model.model.layers.named_parameters():
        total += p.numel()
        if ".experts." in name:  # transformers 4: experts.{i}.gate_proj...; 5: experts.gate_up_proj, down_proj
            experts += p.numel()
    total += model.model.norm.weight.numel()
    return total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts, total


def sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768", help="comma-separated prompt lengths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=48, help="decoder layers (48 = Qwen3-30B-A3B)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (to check the script, e.g. on cpu)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",") if s]

    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = make_config(Qwen3MoeConfig, args)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with dev:
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to(device=dev, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    sync(dev)
    t_init = time.perf_counter() - t0
    n_active, n_all = active_params(model, cfg)

    results = []
    for n in sizes:
        runs = []
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for r in range(args.reps + 1):
            ids = torch.randint(0, cfg.vocab_size, (1, n), device=dev)
            sync(dev)
            a = time.perf_counter()
            with torch.inference_mode():
                out = model.model(input_ids=ids, use_cache=True)
            sync(dev)
            b = time.perf_counter()
            del out
            if r > 0:  # r == 0 is the warm-up
                runs.append(n / (b - a))
                print(f"peer: {n} tokens, run {r}/{args.reps}: {n / (b - a):.0f} tok/s ({b - a:.3f} s)",
                      file=sys.stderr, flush=True)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        results.append({"tokens": n, "tok_s": statistics.median(runs), "runs_tok_s": runs, "peak_gib": peak})

    shape = "tiny config" if args.tiny else f"Qwen3-30B-A3B shape, {args.layers} layers"
    doc = {
        "peer": (f"PyTorch {torch.__version__} + transformers {transformers.__version__} Qwen3MoeForCausalLM "
                 f"({model.config._attn_implementation}, bf16, random weights, {shape}, "
                 f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}), model.model(...) without the output "
                 f"head, use_cache=True"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else str(dev),
        "params_nonembd_no_head": n_all,
        "params_active_nonembd_no_head": n_active,
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
