#!/usr/bin/env python3
"""Write a small llama-architecture GGUF with random weights, using the `gguf`
package (llama.cpp's own gguf-py writer, from PyPI) -- an independently written
file for benchmarking llama.cpp against kvbridge, and for checking that kvbridge
loads files produced by the reference writer.

Tokenizer: tokenizer.ggml.model=gpt2 with the 256 byte-level tokens (GPT-2's
bytes_to_unicode alphabet, token id == byte value), two control tokens
<s>/</s> and, for --n-vocab > 258, unreachable filler tokens (pairs of
byte characters). No merges: tokenizer.ggml.merges is an empty string array
(llama.cpp requires the key to exist; gguf-py refuses empty arrays, so this
script packs that one array itself).

Weights: N(0, 0.02) for matrices, 1.0 for RMS-norm weights; matrices stored as
--type (q8_0, q4_0, f16 or f32), norms always F32.

  python tools/peer/make_test_gguf.py --out /tmp/peer-tiny.gguf --preset tiny --type q8_0
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT
except ImportError:  # pragma: no cover
    sys.exit("make_test_gguf.py needs the `gguf` package: pip install gguf "
             "(tools/peer/setup_llamacpp.sh installs it into the peer venv)")

# name: (n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx)
PRESETS = {
    "tiny":   (256,   4,  8, 4,   768,   512, 2048),     # ~3.4 M params
    "small":  (1024,  8, 16, 4,  2816,  8192, 4096),     # ~107 M params
    "tinyllama-1.1b": (2048, 22, 32, 4, 5632, 32000, 2048),  # TinyLlama-1.1B shapes, ~1.1 G params
}

TYPES = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}


def bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable unicode character table (index = byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


class Writer(gguf.GGUFWriter):
    """GGUFWriter that can also pack an empty array (given an explicit sub_type)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # noqa: D401
        if vtype == VT.ARRAY and sub_type is not None and len(val) == 0:
            out = bytearray()
            if add_vtype:
                out += self._pack("I", vtype)
            out += self._pack("I", sub_type)
            out += self._pack("Q", 0)
            return bytes(out)
        return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--type", choices=sorted(TYPES), default="q8_0", help="matrix storage type")
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--n-head-kv", type=int)
    ap.add_argument("--n-ff", type=int)
    ap.add_argument("--n-vocab", type=int)
    ap.add_argument("--n-ctx", type=int)
    ap.add_argument("--tie-embeddings", action="store_true", help="omit output.weight (llama.cpp reuses token_embd)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()

    n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx = PRESETS[a.preset]
    n_embd = a.n_embd or n_embd
    n_layer = a.n_layer or n_layer
    n_head = a.n_head or n_head
    n_head_kv = a.n_head_kv or n_head_kv
    n_ff = a.n_ff or n_ff
    n_vocab = a.n_vocab or n_vocab
    n_ctx = a.n_ctx or n_ctx
    qt = TYPES[a.type]
    blk = gguf.GGML_QUANT_SIZES[qt][0]
    if n_embd % n_head or n_head % n_head_kv:
        sys.exit("n_embd must be a multiple of n_head, n_head of n_head_kv")
    if n_embd % blk or n_ff % blk:
        sys.exit(f"n_embd and n_ff must be multiples of the {a.type} block size {blk}")
    if n_vocab < 258:
        sys.exit("n_vocab must be >= 258 (256 byte tokens + bos + eos)")
    head_dim = n_embd // n_head

    # ---- vocabulary: bytes, 2 controls, unreachable filler pairs
    alphabet = bytes_to_unicode()
    tokens = alphabet + ["<s>", "</s>"]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2
    i = 0
    while len(tokens) < n_vocab:
        tokens.append(alphabet[(i // 256) % 256] + alphabet[i % 256])
        types.append(gguf.TokenType.NORMAL)
        i += 1

    w = Writer(a.out, "llama")
    w.add_name(f"kvbridge-peer-test-{a.preset}-{a.type}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(int(FILE_TYPES[a.type]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_key_value(gguf.Keys.Tokenizer.MERGES, [], VT.ARRAY, sub_type=VT.STRING)
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(False)

    rng = np.random.default_rng(a.seed)
    n_params = 0

    def mat(name: str, rows: int, cols: int) -> None:
        """rows = output dim (ne1), cols = input dim (ne0)."""
        nonlocal n_params
        x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        n_params += x.size
        if qt in (QT.F32, QT.F16):
            w.add_tensor(name, gguf.quants.quantize(x, qt))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)

    def norm(name: str, n: int) -> None:
        nonlocal n_params
        n_params += n
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t0 = time.time()
    n_kv = head_dim * n_head_kv
    mat("token_embd.weight", n_vocab, n_embd)
    for l in range(n_layer):
        p = f"blk.{l}."
        norm(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_embd, n_embd)
        mat(p + "attn_k.weight", n_kv, n_embd)
        mat(p + "attn_v.weight", n_kv, n_embd)
        mat(p + "attn_output.weight", n_embd, n_embd)
        norm(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)
    norm("output_norm.weight", n_embd)
    if not a.tie_embeddings:
        mat("output.weight", n_vocab, n_embd)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # read it back with gguf-py as a first sanity check
    r = gguf.GGUFReader(a.out)
    kinds = sorted({t.tensor_type.name for t in r.tensors})
    size = sum(int(t.n_bytes) for t in r.tensors)
    print(f"wrote {a.out}: llama, n_embd={n_embd} n_layer={n_layer} n_head={n_head} n_head_kv={n_head_kv} "
          f"n_ff={n_ff} n_vocab={n_vocab} n_ctx={n_ctx}, {n_params/1e6:.1f} M params, "
          f"{len(r.tensors)} tensors ({'/'.join(kinds)}), {size/2**20:.1f} MiB of weights, "
          f"{time.time()-t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
