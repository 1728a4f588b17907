#!/usr/bin/env python3
"""Gemma 3 270M: kvbridge's engines against PyTorch/transformers' Gemma 3 on the same GGUF weights.

Run where torch and transformers are installed (the H200 host: PyTorch 2.11, transformers 5.17;
the `gguf` package comes as a wheel: pip install --no-deps gguf-*.whl into a target dir on
PYTHONPATH). transformers reads the GGUF with `gguf` and dequantises every tensor to float32; its
Gemma3ForCausalLM then runs in float32 (eager attention, its own sliding-window mask) — an
implementation that shares no code with kvbridge.

For each prompt: the ids come from `kvbridge tokenize` (checked 400/400 against transformers'
SentencePiece conversion by tools/gemma_tokenizer_check.py); `kvbridge run --tokens ... -n 16
--temp 0 --logits-out F --output ids` on each --device gives the last prompt token's logits and a
greedy continuation; transformers gives the same from one forward pass and generate(do_sample=False).
Printed per prompt and device: relative L2 of the logits, KL(transformers || kvbridge) of the
next-token distributions, top-1 equal, top-5 overlap, greedy tokens equal before the first
divergence. Exit status 1 when a top-1 differs or rel-L2 exceeds --max-rel (default 0.1: our
engines quantise activations to 8 bits for the Q8_0/K-quant dots on the CPU, and compute in bf16
on the GPU, against transformers' float32 on dequantised weights).

usage: gemma_hf_check.py --kvbridge BIN --model GGUF [--device cpu,cuda] [--max-rel 0.1]
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The three primary colors are red, yellow and",
    # longer than the 512-token sliding window: local and global layers both matter
    "Notes from the archive. " + " ".join(
        f"Entry {i}: the shipment of {i * 7 % 23} crates left the harbour on day {i % 30 + 1}." for i in range(60))
    + " The entry that mentions 5 crates is Entry",
]


def run(cmd, stdin=None):
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ...: exit {p.returncode}: {p.stderr.strip()[-400:]}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvbridge", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu,cuda")
    ap.add_argument("--max-rel", type=float, default=0.1)
    ap.add_argument("--gen", type=int, default=16)
    a = ap.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, reference on {dev} (float32)")
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(a.model)),
                                                 gguf_file=os.path.basename(a.model), torch_dtype=torch.float32,
                                                 attn_implementation="eager").to(dev).eval()
    print(f"reference model: {type(model).__name__}, sliding window {getattr(model.config, 'sliding_window', None)}")
    bad = 0
    tmp = tempfile.mkdtemp()
    for pi, text in enumerate(PROMPTS):
        ids = [int(t) for t in run([a.kvbridge, "tokenize", "-m", a.model], stdin=text).split()]
        with torch.no_grad():
            x = torch.tensor([ids], device=dev)
            ref = model(x).logits[0, -1].double().cpu().numpy()
            gen = model.generate(x, max_new_tokens=a.gen, do_sample=False, min_new_tokens=a.gen)[0, len(ids):]
        ref_gen = [int(t) for t in gen.tolist()]
        rp = np.exp(ref - ref.max())
        rp /= rp.sum()
        for d in a.device.split(","):
            lf = os.path.join(tmp, f"logits-{pi}-{d}.bin")
            out = run([a.kvbridge, "run", "-m", a.model, "--device", d, "--tokens", ",".join(map(str, ids)),
                       "-n", str(a.gen), "--temp", "0", "--ignore-eos", "--output", "ids", "--logits-out", lf,
                       "--ctx", str(len(ids) + a.gen + 8)])
            ours = np.fromfile(lf, dtype=np.float32).astype(np.float64)
            our_gen = [int(t) for t in out.replace(",", " ").split()]
            rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
            op = np.exp(ours - ours.max())
            op /= op.sum()
            kl = float(np.sum(rp * (np.log(rp + 1e-300) - np.log(op + 1e-300))))
            t1 = int(np.argmax(ours)) == int(np.argmax(ref))
            top5 = len(set(np.argsort(-ours)[:5]) & set(np.argsort(-ref)[:5]))
            same = next((i for i, (u, v) in enumerate(zip(our_gen, ref_gen)) if u != v), min(len(our_gen), len(ref_gen)))
            ok = t1 and rel <= a.max_rel and math.isfinite(rel)
            bad += not ok
            print(f"prompt {pi} ({len(ids)} tokens) {d:4s}: rel-L2 {rel:.2e}  KL {kl:.2e}  top-1 {'same' if t1 else 'DIFF'}"
                  f"  top-5 overlap {top5}/5  greedy {same}/{a.gen} same  {'ok' if ok else 'FAIL'}")
    print("PASS" if bad == 0 else f"FAIL: {bad} row(s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
