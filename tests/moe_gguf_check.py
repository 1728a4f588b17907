#!/usr/bin/env python3
"""`kvbridge gen-model --preset tiny-moe` writes a qwen3moe GGUF (and `--preset tiny-qwen2moe` a
qwen2moe one) that the `gguf` Python package (llama.cpp's own gguf-py) reads as llama.cpp's converter
writes Qwen3-MoE (Qwen2-MoE): the architecture name, every key spelled as gguf.Keys.LLM formats it
for the architecture, every tensor name one of gguf.MODEL_TENSORS[the architecture] and every such
per-layer tensor present, with ggml's shapes: ffn_gate_inp [n_embd, n_expert], ffn_gate_exps /
ffn_up_exps [n_embd, n_ff_exp, n_expert], ffn_down_exps [n_ff_exp, n_embd, n_expert]; qwen2moe's
expert_shared_feed_forward_length and shared expert ffn_gate_inp_shexp [n_embd], ffn_gate_shexp /
ffn_up_shexp [n_embd, n_ff_shexp], ffn_down_shexp [n_ff_shexp, n_embd].

Usage: moe_gguf_check.py KVBRIDGE
Exit 0 when everything matches, 1 on a mismatch, 77 (skip) without the gguf package.
"""
import os
import subprocess
import sys
import tempfile

SKIP = 77


def check_file(gguf, kvbridge, tmp, preset, march, n_ff_shexp, wtype, check):
    """One generated file of `preset` (architecture march) in wtype: keys, tensor names, shapes."""
    from gguf.constants import MODEL_TENSORS, TENSOR_NAMES, Keys
    path = os.path.join(tmp, f"{preset}-{wtype}.gguf")
    subprocess.run([kvbridge, "gen-model", "--preset", preset, "--type", wtype, "--out", path,
                    "--quiet"], check=True)
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    check(arch == gguf.MODEL_ARCH_NAMES[march], f"{wtype}: architecture {arch!r}")

    def key(k):
        f = r.fields.get(k.format(arch=arch))
        check(f is not None, f"{wtype}: key {k.format(arch=arch)} missing")
        return f.contents() if f is not None else None

    n_embd = key(Keys.LLM.EMBEDDING_LENGTH)
    n_layer = key(Keys.LLM.BLOCK_COUNT)
    n_expert = key(Keys.LLM.EXPERT_COUNT)
    n_used = key(Keys.LLM.EXPERT_USED_COUNT)
    n_ff_exp = key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    check((n_embd, n_layer, n_expert, n_used, n_ff_exp) == (256, 3, 8, 2, 256),
          f"{wtype}: shape keys {(n_embd, n_layer, n_expert, n_used, n_ff_exp)}")
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[march]}
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    for name in shapes:
        base = name.rsplit(".", 1)[0]
        generic = ".".join("{bid}" if p.isdigit() else p for p in base.split("."))
        check(generic in allowed, f"{preset} {wtype}: tensor {name} is not a {arch} tensor name")
    want = {
        "ffn_gate_inp": [n_embd, n_expert],
        "ffn_gate_exps": [n_embd, n_ff_exp, n_expert],
        "ffn_up_exps": [n_embd, n_ff_exp, n_expert],
        "ffn_down_exps": [n_ff_exp, n_embd, n_expert],
    }
    if n_ff_shexp:  # qwen2moe's shared expert: its size key, a gate vector [n_embd], the expert's matrices
        n_sh = key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
        check(n_sh == n_ff_shexp, f"{preset} {wtype}: expert_shared_feed_forward_length {n_sh}")
        want.update({"ffn_gate_inp_shexp": [n_embd], "ffn_gate_shexp": [n_embd, n_sh],
                     "ffn_up_shexp": [n_embd, n_sh], "ffn_down_shexp": [n_sh, n_embd]})
    per_layer = [TENSOR_NAMES[t] for t in MODEL_TENSORS[march] if "{bid}" in TENSOR_NAMES[t]]
    for layer in range(n_layer):
        for generic in per_layer:
            name = generic.format(bid=layer) + ".weight"
            check(name in shapes, f"{wtype}: tensor {name} missing")
        for short, dims in want.items():
            got = shapes.get(f"blk.{layer}.{short}.weight")
            check(got == dims, f"{wtype}: blk.{layer}.{short}.weight has shape {got}, expected {dims}")
    gi = next(t for t in r.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    check(gi.tensor_type == gguf.GGMLQuantizationType.F32, f"{wtype}: router type {gi.tensor_type.name}")
    ex = next(t for t in r.tensors if t.name == "blk.0.ffn_down_exps.weight")
    check(ex.tensor_type.name == wtype.upper(), f"{wtype}: expert type {ex.tensor_type.name}")
    print(f"moe_gguf_check: {preset} {wtype}: {len(shapes)} tensors, arch {arch}, {n_expert} experts top-{n_used}")


def main():
    try:
        import gguf
        from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES, Keys
    except ImportError as e:
        print(f"moe_gguf_check: SKIP: the gguf package is missing ({e})")
        return SKIP
    kvbridge = sys.argv[1]
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        for preset, march, n_ff_shexp in (("tiny-moe", MODEL_ARCH.QWEN3MOE, None),
                                          ("tiny-qwen2moe", MODEL_ARCH.QWEN2MOE, 512)):
            for wtype in ("q8_0", "f16"):
                check_file(gguf, kvbridge, tmp, preset, march, n_ff_shexp, wtype, check)
    for f in failures:
        print("moe_gguf_check: FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
