/* ref_fixture — small random model files for tests, written with nothing but the GGUF writer and
 * quant's kvb_f32_to_row (to encode weights in F32, F16, BF16, Q8_0 or Q4_0): llama, qwen2 (q/k/v
 * biases), qwen3 (per-head q/k norms, explicit head_dim) and gemma3 (q/k norms, post-attention and
 * post-FFN norms, attention.sliding_window, optionally a sliding_window_pattern key as a period or
 * one boolean per layer) in llama.cpp's tensor naming, with a
 * choice of tied or separate output, partial rotary, and Llama-3 or linear RoPE scaling either as
 * rope.scaling.* keys or as a rope_freqs.weight tensor. Every tensor's values come from its own RNG
 * stream seeded by (seed, tensor name), so two files that differ only in type, output mode or
 * scaling share all other weights. Also a lower-level writer for hand-made tensors and a temporary
 * directory helper. Functions return 0 on success, -1 with a message in errbuf. */
#ifndef KVB_REF_FIXTURE_H
#define KVB_REF_FIXTURE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_gguf.h"

typedef enum {
    REF_FIX_OUTPUT_SEPARATE = 0, /* output.weight with its own random values */
    REF_FIX_OUTPUT_TIED,         /* no output.weight: the model reuses token_embd */
    REF_FIX_OUTPUT_COPY,         /* output.weight present, holding exactly token_embd's values */
} ref_fix_output;

typedef enum {
    REF_FIX_ROPE_PLAIN = 0,   /* no scaling keys, no rope_freqs */
    REF_FIX_ROPE_LLAMA3_KEYS, /* rope.scaling.type = "llama3" + factor/low/high/original_context_length */
    REF_FIX_ROPE_LLAMA3_TENSOR, /* rope_freqs.weight (n_rot/2 f32) computed as convert_hf_to_gguf.py does */
    REF_FIX_ROPE_LINEAR,      /* rope.scaling.type = "linear" + rope.scaling.factor */
} ref_fix_rope;

typedef struct {
    const char *arch;        /* "llama", "qwen2", "qwen3", "gemma3" */
    uint32_t wtype;          /* kvb_type of every 2-D matrix (token_embd and output included);
                                norms, biases and rope_freqs are always F32 */
    uint64_t seed;
    uint32_t n_vocab, n_embd, n_layer, n_ff, n_head, n_head_kv;
    uint32_t head_dim;       /* written as attention.key_length/value_length when != n_embd/n_head */
    uint32_t n_rot;          /* written as rope.dimension_count when != head_dim */
    uint32_t n_ctx_train;    /* {arch}.context_length */
    float rope_freq_base;
    float norm_eps;
    ref_fix_output output;
    ref_fix_rope rope;
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor; /* LLAMA3_* and LINEAR */
    uint32_t rope_orig_ctx;
    bool write_vocab;        /* tokenizer.ggml.* (model "llama", n_vocab tokens "<t0>", ...) */
    float embd_scale;        /* token_embd ~ N(0, embd_scale^2) */
    float mat_scale;         /* other matrices ~ N(0, (mat_scale^2) / cols) */
    uint32_t swa_window;     /* gemma3: {arch}.attention.sliding_window */
    int32_t swa_pattern;     /* gemma3: < 0 writes no pattern key (Gemma 3's 5 local + 1 global applies);
                                >= 0 writes {arch}.attention.sliding_window_pattern as this u32 period */
    const bool *swa_layers;  /* gemma3: non-NULL writes the pattern key as n_layer booleans (true = local)
                                instead */
} ref_fixture_cfg;

/* Defaults for a small test model of the given architecture: n_vocab 97, n_embd 64, 2 layers,
 * n_ff 128, 4 heads / 2 kv heads, head_dim 16 (qwen3: 32, so n_head*head_dim != n_embd), full
 * rotary, rope base 10000, eps 1e-5, separate output, plain RoPE, a vocabulary. gemma3: 7 layers
 * (layers 0-4 and 6 local, 5 global), head_dim 32, window 5, rope base 1e6, eps 1e-6, no pattern key. */
void ref_fixture_default(ref_fixture_cfg *c, const char *arch, uint32_t wtype, uint64_t seed);
int ref_fixture_write(const ref_fixture_cfg *c, const char *path, char *errbuf, size_t cap);

/* The Llama-3 rope factor convert_hf_to_gguf.py stores in rope_freqs.weight for pair i of n_rot. */
float ref_fixture_llama3_factor(double base, int n_rot, int i, double factor, double low, double high,
                                double orig_ctx);

/* ---- low level: hand-made tensors ---------------------------------------------------------- */

typedef struct {
    const char *name;
    uint32_t n_dims;         /* 1 or 2 */
    uint64_t ne[2];          /* ne[0] = columns (contiguous), ne[1] = rows */
    uint32_t type;           /* encoded from data with kvb_f32_to_row */
    const float *data;       /* (ne[1], ne[0]) row-major f32 values */
} ref_fix_tensor;

/* Adds tensor infos for t[0..n) to w (which already holds the caller's KVs), writes the file and
 * the encoded data. Does not destroy w. */
int ref_fixture_write_tensors(kvb_gguf_writer *w, const ref_fix_tensor *t, size_t n, const char *path,
                              char *errbuf, size_t cap);

/* ---- temporary directories ----------------------------------------------------------------- */

/* Creates a fresh directory ($TMPDIR or /tmp)/kvb-test-XXXXXX; its path goes to buf. */
int ref_tmpdir_create(char *buf, size_t cap);
/* Removes the regular files directly inside dir, then dir itself. */
void ref_tmpdir_remove(const char *dir);

#endif
