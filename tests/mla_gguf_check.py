#!/usr/bin/env python3
"""`kvbridge gen-model` writes deepseek2 GGUFs (preset tiny-mla, and the first layer of
deepseek-v2-lite) that the `gguf` Python package (llama.cpp's own gguf-py) reads
as llama.cpp's converter writes DeepSeek's latent attention: the architecture name, every key
spelled as gguf.Keys formats it, every tensor name one of gguf.MODEL_TENSORS[MODEL_ARCH.DEEPSEEK2],
and ggml's shapes: attn_q_a [E, q_lora], attn_q_b [q_lora, H*K] (or attn_q [E, H*K] without
q_lora), attn_kv_a_mqa [E, R+P], attn_kv_a_norm [R], attn_k_b [N, R, H], attn_v_b [R, Vd, H],
attn_output [H*Vd, E], dense ffn_* in the leading layers, then the experts with ffn_*_shexp
[E, F*S] / [F*S, E] and (sigmoid gating) exp_probs_b.bias [n_expert].

Usage: mla_gguf_check.py KVBRIDGE
Exit 0 when everything matches, 1 on a mismatch, 77 (skip) without the gguf package.
"""
import os
import subprocess
import sys
import tempfile

SKIP = 77

# preset, --layers, expected (E, H, q_lora, R, P, K, Vd, dense_lead, X, top, S, F, gating, groups, used)
CASES = [
    ("tiny-mla", 0, (256, 4, 128, 64, 32, 64, 32, 1, 8, 2, 1, 256, 2, 4, 2), 3),
    # its leading dense layer only (q without q_lora): a MoE layer of the real shape is 0.6 GB, too much for CI
    ("deepseek-v2-lite", 1, (2048, 16, 0, 512, 64, 192, 128, 1, 64, 6, 2, 1408, 1, 0, 0), 1),
]


def check_file(gguf, path, want, n_layer_want, fail):
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES, Keys
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    tag = os.path.basename(path)
    if arch != gguf.MODEL_ARCH_NAMES[MODEL_ARCH.DEEPSEEK2]:
        fail(f"{tag}: architecture {arch!r}")
        return

    def key(k, default=None):
        f = r.fields.get(k.format(arch=arch))
        if f is None and default is None:
            fail(f"{tag}: key {k.format(arch=arch)} missing")
        return f.contents() if f is not None else default

    A, L = Keys.Attention, Keys.LLM
    E, H, QL, R, P, K, Vd, lead, X, top, S, F, gating, groups, used = want
    got = (key(L.EMBEDDING_LENGTH), key(A.HEAD_COUNT), key(A.Q_LORA_RANK, 0), key(A.KV_LORA_RANK),
           key(Keys.Rope.DIMENSION_COUNT), key(A.KEY_LENGTH_MLA), key(A.VALUE_LENGTH_MLA),
           key(L.LEADING_DENSE_BLOCK_COUNT), key(L.EXPERT_COUNT), key(L.EXPERT_USED_COUNT),
           key(L.EXPERT_SHARED_COUNT), key(L.EXPERT_FEED_FORWARD_LENGTH), key(L.EXPERT_GATING_FUNC),
           key(L.EXPERT_GROUP_COUNT, 0), key(L.EXPERT_GROUP_USED_COUNT, 0))
    if got != want:
        fail(f"{tag}: keys {got}, expected {want}")
    n_layer = key(L.BLOCK_COUNT)
    if n_layer != n_layer_want:
        fail(f"{tag}: block_count {n_layer}, expected {n_layer_want}")
    # the MLA form: one latent cache row per token (head_count_kv 1, key = latent + rope, value = latent)
    if (key(A.HEAD_COUNT_KV), key(A.KEY_LENGTH), key(A.VALUE_LENGTH)) != (1, R + P, R):
        fail(f"{tag}: head_count_kv/key_length/value_length not the MLA form")
    # llama.cpp sizes deepseek2's shared experts n_ff_exp * expert_shared_count: its converter writes no
    # expert_shared_feed_forward_length (qwen2moe's key) for this architecture
    if r.fields.get(L.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch)) is not None:
        fail(f"{tag}: {L.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch)} written (not a deepseek2 key)")
    if key(Keys.Rope.SCALING_TYPE, "none") != "yarn" or key(Keys.Rope.SCALING_YARN_LOG_MUL, -1.0) <= 0:
        fail(f"{tag}: YaRN keys missing")
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.DEEPSEEK2]}
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    for name in shapes:
        base = name.rsplit(".", 1)[0]
        generic = ".".join("{bid}" if p.isdigit() else p for p in base.split("."))
        if generic not in allowed:
            fail(f"{tag}: tensor {name} is not a deepseek2 tensor name")
    N = K - P
    for layer in range(n_layer):
        want_t = {"attn_kv_a_mqa.weight": [E, R + P], "attn_kv_a_norm.weight": [R],
                  "attn_k_b.weight": [N, R, H], "attn_v_b.weight": [R, Vd, H], "attn_output.weight": [H * Vd, E]}
        if QL:
            want_t.update({"attn_q_a.weight": [E, QL], "attn_q_a_norm.weight": [QL], "attn_q_b.weight": [QL, H * K]})
        else:
            want_t["attn_q.weight"] = [E, H * K]
        if layer < lead:
            want_t["ffn_gate.weight"] = None
        else:
            want_t.update({"ffn_gate_inp.weight": [E, X], "ffn_gate_exps.weight": [E, F, X],
                           "ffn_down_exps.weight": [F, E, X], "ffn_gate_shexp.weight": [E, F * S],
                           "ffn_down_shexp.weight": [F * S, E]})
            if gating == 2:
                want_t["exp_probs_b.bias"] = [X]
        for short, dims in want_t.items():
            g = shapes.get(f"blk.{layer}.{short}")
            if g is None or (dims is not None and g != dims):
                fail(f"{tag}: blk.{layer}.{short} has shape {g}, expected {dims}")
    print(f"mla_gguf_check: {tag}: {len(shapes)} tensors, {n_layer} layers, arch {arch}")


def main():
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        print(f"mla_gguf_check: SKIP: the gguf package is missing ({e})")
        return SKIP
    kvbridge = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset, layers, want, n_layer in CASES:
            for wtype in ("q8_0",) if layers else ("q8_0", "f16"):
                path = os.path.join(tmp, f"{preset}-{wtype}.gguf")
                cmd = [kvbridge, "gen-model", "--preset", preset, "--type", wtype, "--out", path, "--quiet"]
                if layers:
                    cmd += ["--layers", str(layers)]
                subprocess.run(cmd, check=True)
                check_file(sys.modules["gguf"], path, want, n_layer, failures.append)
                os.remove(path)
    for f in failures:
        print("mla_gguf_check: FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
