#!/usr/bin/env python3
"""Peer benchmark: llama.cpp prefill (pp) and decode (tg) throughput on a GGUF.

Backends (--backend auto picks the first that is available):
  llama-bench  llama.cpp's official benchmark tool (tools/peer/build_llama_bench.sh);
               found via --llama-bench, $PEER_LLAMA_BENCH, build-peer/llama-bench-bin/
               next to this repo, or PATH.
  python       llama-cpp-python's low-level API (tools/peer/setup_llamacpp.sh), doing
               what llama-bench does: per rep, clear the KV cache, then
               pp: one prompt of N random tokens from an empty context (decoded in
                   n_batch=2048 chunks, n_ubatch=512), tok/s = N / time;
               tg: N single-token decodes from an empty context, tok/s = N / time;
               one warmup run each (full pp, 1 tg token); avg and stddev over reps.

Prints one line of JSON:
  {"peer":"llama.cpp","version":...,"pp_tok_s":...,"tg_tok_s":...,"threads":...,"model":...,...}

  python tools/peer/bench_llamacpp.py --model m.gguf --threads 2 --pp 512 --tg 128 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def find_llama_bench(explicit: str | None) -> Path | None:
    cands = []
    if explicit:
        cands.append(Path(explicit))
    if os.environ.get("PEER_LLAMA_BENCH"):
        cands.append(Path(os.environ["PEER_LLAMA_BENCH"]))
    cands += [REPO / "build-peer" / "llama-bench-bin" / "llama-bench",
              HERE / "llama-bench-bin" / "llama-bench", HERE / "llama-bench"]
    w = shutil.which("llama-bench")
    if w:
        cands.append(Path(w))
    for c in cands:
        if c.is_dir():
            c = c / "llama-bench"
        if c.is_file() and os.access(c, os.X_OK):
            return c.resolve()
    if explicit:
        sys.exit(f"bench_llamacpp: llama-bench not found or not executable: {explicit}")
    return None


def read_build_info(binary: Path) -> dict:
    info = {}
    f = binary.parent / "BUILD_INFO.txt"
    if f.is_file():
        for line in f.read_text().splitlines():
            if ": " in line:
                k, v = line.split(": ", 1)
                info[k.strip()] = v.strip()
    return info


def run_llama_bench(binary: Path, a) -> dict:
    cmd = [str(binary), "-m", a.model, "-t", str(a.threads), "-p", str(a.pp), "-n", str(a.tg),
           "-r", str(a.reps), "-o", "json"]
    cmd += shlex.split(a.extra_args or "")
    print("bench_llamacpp: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        sys.exit(f"bench_llamacpp: llama-bench exited with {p.returncode}")
    try:
        rows = json.loads(p.stdout)
    except json.JSONDecodeError:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        sys.exit("bench_llamacpp: could not parse llama-bench JSON output")
    pp = next((r for r in rows if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0), None)
    tg = next((r for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0), None)
    first = rows[0] if rows else {}
    bi = read_build_info(binary)
    commit = first.get("build_commit") or bi.get("llama.cpp commit", "unknown")
    return {
        "version": f"llama.cpp@{commit}",
        "llama_cpp_python": bi.get("llama-cpp-python"),
        "pp_tok_s": pp and pp["avg_ts"], "pp_stddev": pp and pp["stddev_ts"],
        "tg_tok_s": tg and tg["avg_ts"], "tg_stddev": tg and tg["stddev_ts"],
        "cpu_info": first.get("cpu_info"), "model_type": first.get("model_type"),
        "model_n_params": first.get("model_n_params"), "model_size": first.get("model_size"),
        "flash_attn": first.get("flash_attn"), "n_batch": first.get("n_batch"),
        "n_ubatch": first.get("n_ubatch"), "type_k": first.get("type_k"),
        "binary": str(binary), "build_flags": bi.get("stamp"),
        "raw": rows,
    }


def ggml_build(L) -> tuple[str | None, str | None]:
    """(commit, version) that the bundled libggml-base.so reports (ggml_commit/ggml_version)."""
    import ctypes
    try:
        lib = ctypes.CDLL(str(Path(L.__file__).parent / "lib" / "libggml-base.so"))
        out = []
        for name in ("ggml_commit", "ggml_version"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_char_p
            out.append(fn().decode())
        return out[0], out[1]
    except (OSError, AttributeError):
        return None, None


def run_python(a) -> dict:
    try:
        import ctypes
        import llama_cpp as L
    except ImportError:
        sys.exit("bench_llamacpp: no llama-bench binary and llama_cpp is not importable "
                 "(run tools/peer/setup_llamacpp.sh, then use .venv-peer/bin/python)")
    L.llama_backend_init()
    if not a.verbose:
        # silence llama.cpp's logging (same as llama-bench without -v)
        cb = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(cb, ctypes.c_void_p())
        run_python.cb = cb  # keep alive
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        sys.exit(f"bench_llamacpp: llama.cpp failed to load {a.model}")
    cp = L.llama_context_default_params()
    cp.n_ctx = a.pp + a.tg
    cp.n_batch = 2048
    cp.n_ubatch = 512
    cp.n_threads = a.threads
    cp.n_threads_batch = a.threads
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("bench_llamacpp: llama_init_from_model failed")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    add_bos = L.llama_vocab_get_add_bos(vocab)
    bos = L.llama_vocab_bos(vocab)
    mem = L.llama_get_memory(ctx)
    rng = random.Random(a.seed)
    n_batch = cp.n_batch

    def decode(tokens: list[int]) -> None:
        arr = (L.llama_token * len(tokens))(*tokens)
        rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            sys.exit(f"bench_llamacpp: llama_decode returned {rc}")

    def test_prompt(n: int) -> None:
        done = 0
        while done < n:
            k = min(n - done, n_batch)
            toks = [rng.randrange(n_vocab) for _ in range(k)]
            if done == 0 and add_bos:
                toks[0] = bos
            decode(toks)
            done += k
        L.llama_synchronize(ctx)

    def test_gen(n: int) -> None:
        tok = bos if add_bos else rng.randrange(n_vocab)
        for _ in range(n):
            decode([tok])
            L.llama_synchronize(ctx)
            tok = rng.randrange(n_vocab)

    def measure(fn, n: int, warm: int) -> list[float]:
        L.llama_memory_clear(mem, False)
        fn(warm)  # warmup
        out = []
        for _ in range(a.reps):
            L.llama_memory_clear(mem, False)
            t0 = time.perf_counter_ns()
            fn(n)
            out.append(n / ((time.perf_counter_ns() - t0) / 1e9))
        return out

    pp = measure(test_prompt, a.pp, a.pp) if a.pp > 0 else []
    tg = measure(test_gen, a.tg, 1) if a.tg > 0 else []
    sysinfo = L.llama_print_system_info().decode(errors="replace").strip()
    commit, ggml_ver = ggml_build(L)
    L.llama_free(ctx)
    L.llama_model_free(model)

    def sd(x):
        return statistics.stdev(x) if len(x) > 1 else 0.0

    return {
        "version": f"llama-cpp-python {L.__version__}" + (f" (llama.cpp@{commit})" if commit else ""),
        "ggml_version": ggml_ver,
        "llama_cpp_python": L.__version__,
        "pp_tok_s": statistics.mean(pp) if pp else None, "pp_stddev": sd(pp) if pp else None,
        "tg_tok_s": statistics.mean(tg) if tg else None, "tg_stddev": sd(tg) if tg else None,
        "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch, "system_info": sysinfo,
        "raw": {"pp_samples_ts": pp, "tg_samples_ts": tg},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens (pp test), 0 to skip")
    ap.add_argument("--tg", type=int, default=128, help="generated tokens (tg test), 0 to skip")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", metavar="OUT", help="also write the result (with raw samples) to OUT")
    ap.add_argument("--backend", choices=["auto", "llama-bench", "python"], default="auto")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama-bench binary (or its folder)")
    ap.add_argument("--extra-args", default="", help="extra llama-bench arguments, e.g. '-fa 1'")
    ap.add_argument("--seed", type=int, default=42, help="token RNG seed (python backend)")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if not os.path.isfile(a.model):
        sys.exit(f"bench_llamacpp: no such model file: {a.model}")

    binary = None
    if a.backend in ("auto", "llama-bench"):
        binary = find_llama_bench(a.llama_bench)
        if binary is None and a.backend == "llama-bench":
            sys.exit("bench_llamacpp: llama-bench not found (build it with tools/peer/build_llama_bench.sh)")
    if binary is not None:
        backend = "llama-bench"
        res = run_llama_bench(binary, a)
    else:
        backend = "python"
        res = run_python(a)

    raw = res.pop("raw")
    out = {"peer": "llama.cpp", "version": res.pop("version"),
           "pp_tok_s": res.pop("pp_tok_s"), "tg_tok_s": res.pop("tg_tok_s"),
           "threads": a.threads, "model": os.path.abspath(a.model),
           "pp": a.pp, "tg": a.tg, "reps": a.reps, "backend": backend}
    out.update({k: v for k, v in res.items() if v is not None})
    line = json.dumps(out)
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(out, raw=raw), f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
