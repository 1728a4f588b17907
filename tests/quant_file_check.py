#!/usr/bin/env python3
"""Our block decoders and quantisers against the `gguf` Python package's numpy ones, on a real
trained model (Gemma 3 270M, Q4_K_M: tensor types F32, Q8_0, Q5_0, Q4_K, Q6_K).

Usage: quant_file_check.py QUANT_DUMP
  QUANT_DUMP: the tests/quant_dump helper (kvb_row_to_f32, the reference model's decoder and
  kvb_f32_to_row over stdin/stdout).
The model: $KVB_GEMMA3_GGUF, else $HOME/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf.

Checks, all bit for bit (f32 bit patterns, quantised bytes):
  1. for the smallest tensor of each of Q5_0, Q4_K, Q6_K, Q8_0 (and Q5_K, Q4_0 if the file has
     them): kvb_row_to_f32 == gguf.quants.dequantize, and the float64 reference decoder
     (tests/support/ref_model.c) rounded to f32 == the same;
  2. kvb_f32_to_row for Q8_0, Q4_0 and Q5_0 == gguf.quants.quantize (both are ggml's reference
     quantisers) on real weights and on random data with exact ties and zero blocks;
  3. our K-quant quantisers (Q4_K, Q5_K, Q6_K) write blocks that gguf.quants.dequantize decodes
     to exactly what kvb_row_to_f32 decodes (Q5_K has no tensor in the file: this is its decoding
     check), within about half a quantisation step of the input (a loose sanity bound; the exact
     bound is tests/test_quant.c's).
Exit 0 when everything matches, 1 on a mismatch, 77 (skip) when the model file or the Python
packages are missing.
"""
import os
import subprocess
import sys

SKIP = 77


def skip(msg):
    print(f"quant_file_check: SKIP: {msg}", file=sys.stderr)
    sys.exit(SKIP)


try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as e:
    skip(f"needs numpy and the gguf package ({e})")

if len(sys.argv) != 2:
    print(__doc__, file=sys.stderr)
    sys.exit(2)
DUMP = sys.argv[1]
MODEL = os.environ.get("KVB_GEMMA3_GGUF") or os.path.join(
    os.path.expanduser("~"), ".cache", "kvbridge", "gemma-3-270m-q4_k_m.gguf")
if not os.path.isfile(MODEL):
    skip(f"model file {MODEL} not found (set KVB_GEMMA3_GGUF to a Gemma 3 Q4_K_M GGUF)")

failures = 0


def check(ok, what):
    global failures
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures += 1


def run_dump(args, stdin=None):
    r = subprocess.run([DUMP, *args], input=stdin, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"quant_dump {' '.join(args)} failed: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def same_bits(a, b):
    """(equal, count of differing elements, first differing index) of two f32 arrays."""
    a = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    b = np.ascontiguousarray(b, dtype=np.float32).view(np.uint32)
    if a.shape != b.shape:
        return False, -1, -1
    diff = np.nonzero(a != b)[0]
    return diff.size == 0, diff.size, int(diff[0]) if diff.size else -1


reader = gguf.GGUFReader(MODEL)
print(f"quant_file_check: {MODEL}: {len(reader.tensors)} tensors")

# ---- 1. decoding ----------------------------------------------------------------------------
by_type = {}
for t in reader.tensors:
    if t.tensor_type in (QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q5_K, QT.Q4_0):
        if t.tensor_type not in by_type or t.n_elements < by_type[t.tensor_type].n_elements:
            by_type[t.tensor_type] = t
for need in (QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q8_0):
    check(need in by_type, f"the file has a {need.name} tensor")

real_weights = None
for qt, t in sorted(by_type.items(), key=lambda kv: kv[0].value):
    want = gguf.quants.dequantize(t.data, qt).reshape(-1).astype(np.float32)
    ours = np.frombuffer(run_dump([MODEL, t.name]), dtype=np.float32)
    ok, nd, first = same_bits(ours, want)
    check(ok, f"{qt.name:5s} {t.name} ({t.n_elements} elements): kvb_row_to_f32 == gguf"
          + ("" if ok else f" ({nd} differ, first at {first}: {ours[first]!r} vs {want[first]!r})"))
    ref = np.frombuffer(run_dump(["--ref", MODEL, t.name]), dtype=np.float32)
    ok, nd, first = same_bits(ref, want)
    check(ok, f"{qt.name:5s} {t.name}: reference decoder (float64 -> f32) == gguf"
          + ("" if ok else f" ({nd} differ, first at {first})"))
    if qt == QT.Q5_0:
        real_weights = want

# ---- 2. ggml's reference quantisers ---------------------------------------------------------
rng = np.random.default_rng(20240607)
rand = (rng.standard_normal(32 * 4096) * np.exp2(rng.integers(-12, 6, 32 * 4096))).astype(np.float32)
blocks = rand.reshape(-1, 32)
blocks[::7] = 0.0                                                      # zero blocks
blocks[3::7] = (rng.integers(-126, 126, (blocks[3::7].shape)) + 0.5)   # exact ties
blocks[3::7, 5] = -127.0
blocks[5::7, :8] = -blocks[5::7, 8:16]                                 # equal |max| of both signs
inputs = [("random", rand)]
if real_weights is not None:
    inputs.append(("Gemma Q5_0 weights", real_weights[: 32 * 8192]))
for qt in (QT.Q8_0, QT.Q4_0, QT.Q5_0):
    for label, x in inputs:
        want = gguf.quants.quantize(x.reshape(-1, 256 if x.size % 256 == 0 else 32), qt).reshape(-1)
        ours = np.frombuffer(run_dump(["--quantize", qt.name, str(x.size)], x.tobytes()), dtype=np.uint8)
        nd = int(np.count_nonzero(ours != want)) if ours.shape == want.shape else -1
        check(nd == 0, f"{qt.name:5s} quantiser on {label} ({x.size} values): bytes == gguf.quants.quantize"
              + ("" if nd == 0 else f" ({nd} bytes differ)"))

# ---- 3. our K-quant quantisers, decoded by gguf ------------------------------------------
kin = (rng.standard_normal(256 * 512) * np.exp2(rng.integers(-8, 4, 256 * 512))).astype(np.float32)
kin[: 256 * 4] = np.abs(kin[: 256 * 4])   # all-positive and all-negative super-blocks
kin[256 * 4: 256 * 8] = -np.abs(kin[256 * 4: 256 * 8])
kin[256 * 8: 256 * 9] = 0.0
for qt, levels in ((QT.Q4_K, 15), (QT.Q5_K, 31), (QT.Q6_K, 63)):
    data = run_dump(["--quantize", qt.name, str(kin.size)], kin.tobytes())
    theirs = gguf.quants.dequantize(np.frombuffer(data, dtype=np.uint8), qt).reshape(-1).astype(np.float32)
    ours = np.frombuffer(run_dump(["--decode", qt.name, str(kin.size)], data), dtype=np.float32)
    ok, nd, first = same_bits(ours, theirs)
    check(ok, f"{qt.name:5s} our quantiser's blocks: kvb_row_to_f32 == gguf.quants.dequantize"
          + ("" if ok else f" ({nd} differ, first at {first})"))
    err = np.abs(theirs.astype(np.float64) - kin.astype(np.float64)).reshape(-1, 256)
    span = kin.reshape(-1, 256).astype(np.float64)
    lo = np.minimum(span.min(axis=1), 0.0)
    if qt == QT.Q6_K:
        rough = 2 * np.abs(span).max(axis=1) / 62   # one step: 2 max|x| / 62, plus the fp16/6-bit slack
    else:
        rough = (span.max(axis=1) - lo) / levels
    worst = float((err.max(axis=1) / np.maximum(rough, 1e-30)).max())
    check(worst <= 0.55, f"{qt.name:5s} our quantiser, decoded by gguf: max error {worst:.3f} of one step "
          "(range/levels of the super-block; <= 0.55 expected)")

print(f"quant_file_check: {'all passed' if failures == 0 else f'{failures} FAILED'}")
sys.exit(1 if failures else 0)
