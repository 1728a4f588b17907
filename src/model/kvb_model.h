/* model — what a transformer is, read from GGUF metadata: the architecture description
 * (llama, qwen2, qwen3; GQA, RoPE with Llama-3 scaling, RMSNorm eps, tied output), the weights
 * bound to views into the mapped file with every shape checked against the description, and
 * the synthetic model generator behind `kvbridge gen-model` (real architectures, real GGUF
 * files, seeded weights scaled so activations stay sane and logits are not flat). */
#ifndef KVB_MODEL_H
#define KVB_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_gguf.h"

typedef enum {
    KVB_ARCH_LLAMA = 0, /* Llama 2/3, Mistral, TinyLlama */
    KVB_ARCH_QWEN2,     /* llama + q/k/v bias */
    KVB_ARCH_QWEN3,     /* llama + per-head q/k RMSNorm, explicit head_dim */
} kvb_arch;

typedef struct {
    kvb_arch arch;
    char arch_name[32];    /* general.architecture */
    char name[128];        /* general.name, if any */
    uint32_t n_vocab;
    uint32_t n_ctx_train;  /* {arch}.context_length */
    uint32_t n_embd;       /* hidden size */
    uint32_t n_layer;
    uint32_t n_ff;         /* MLP inner size */
    uint32_t n_head;       /* query heads */
    uint32_t n_head_kv;    /* key/value heads (GQA) */
    uint32_t head_dim;     /* per head (key_length == value_length) */
    uint32_t n_rot;        /* rotary dimensions (<= head_dim; rope.dimension_count) */
    float rope_freq_base;
    /* Llama-3 ("llama3") rope scaling; factor == 0 means none. */
    float rope_scale_factor, rope_low_freq_factor, rope_high_freq_factor;
    uint32_t rope_orig_ctx;
    float rope_linear_factor; /* linear rope scaling: positions divided by this; 0 = none */
    bool rope_neox;        /* rotate pairs (i, i + n_rot/2) (qwen2/qwen3) instead of (2i, 2i+1) (llama) */
    float norm_eps;        /* RMSNorm epsilon */
    bool has_qkv_bias;     /* qwen2 */
    bool has_qk_norm;      /* qwen3 */
    bool tied_output;      /* output.weight absent: reuse token_embd */
} kvb_model_desc;

/* A weight matrix: ne0 = columns (input dim, contiguous), ne1 = rows (output dim). */
typedef struct {
    const void *data; /* (rows, row_bytes) in the file's type */
    uint32_t type;    /* kvb_type */
    int64_t cols, rows;
    size_t row_bytes;
} kvb_mat;

typedef struct {
    const float *attn_norm;  /* (n_embd) f32 */
    kvb_mat wq, wk, wv, wo;  /* wq: (n_head*head_dim, n_embd); wk,wv: (n_head_kv*head_dim, n_embd);
                                wo: (n_embd, n_head*head_dim) as (rows, cols) */
    const float *bq, *bk, *bv; /* qwen2 biases, else NULL */
    const float *q_norm, *k_norm; /* qwen3 (head_dim) f32, else NULL */
    const float *ffn_norm;   /* (n_embd) */
    kvb_mat w_gate, w_up;    /* (n_ff, n_embd) */
    kvb_mat w_down;          /* (n_embd, n_ff) */
} kvb_layer_weights;

typedef struct kvb_model {
    kvb_model_desc d;
    kvb_gguf *gguf;            /* owns the mapping */
    kvb_mat tok_embd;          /* (n_vocab, n_embd) */
    const float *output_norm;  /* (n_embd) */
    kvb_mat output;            /* (n_vocab, n_embd); == tok_embd when tied */
    kvb_layer_weights *layers; /* n_layer */
    const float *rope_freqs;   /* (n_rot/2) frequency divisors from rope_freqs.weight, or NULL */
    float *owned_f32;          /* norm/bias vectors converted to f32 when stored as f16/bf16 */
    uint64_t fingerprint;      /* hash of the description and all weight bytes' identities */
} kvb_model;

/* Reads the description from GGUF metadata; every value is range-checked. */
kvb_status kvb_model_desc_from_gguf(const kvb_gguf *g, kvb_model_desc *d, kvb_err *err);
/* Opens a GGUF and binds all weights; checks every tensor's presence, type and dims against
 * the description (a wrong shape is an error naming the tensor, expected and found dims). */
kvb_status kvb_model_load(const char *path, kvb_model **out, kvb_err *err);
void kvb_model_free(kvb_model *m);
/* One-line human summary ("llama, 16 layers, 2048 embd, 32/8 heads, Q8_0, 1.24 B params"). */
void kvb_model_describe(const kvb_model *m, char *buf, size_t cap);
/* Parameters excluding token embeddings (for FLOP counts). */
uint64_t kvb_model_n_params_nonembd(const kvb_model_desc *d);

/* RoPE inverse frequencies for i in [0, n_rot/2): base^(-2i/n_rot), divided by the
 * rope_freqs.weight factors when the file has them, else by the Llama-3 scaling factors computed
 * from the description's keys; in double. */
void kvb_rope_inv_freq(const kvb_model *m, double *out);
/* The RoPE table every engine and the bridge use (one table, computed on the host in double and
 * rounded to f32 once): for positions pos0 .. pos0+n_pos-1 and i < n_rot/2,
 *     cos_out[p * (n_rot/2) + i] = (float)cos(pos * inv_freq[i]), sin_out likewise.  */
void kvb_rope_table(const double *inv_freq, uint32_t n_rot, uint32_t pos0, uint32_t n_pos, float *cos_out,
                    float *sin_out);
/* Llama-3 frequency divisors (what llama.cpp's converter stores as rope_freqs.weight). */
void kvb_llama3_rope_factors(const kvb_model_desc *d, float *out);

/* ---- synthetic models ------------------------------------------------------------------------ */

typedef struct {
    const char *name;       /* "tiny", "qwen3-0.6b", "llama3.2-1b", "llama3.1-8b", ... */
    const char *summary;
    kvb_model_desc d;       /* shapes; n_vocab is replaced by the vocabulary's size */
} kvb_preset;

const kvb_preset *kvb_preset_find(const char *name); /* NULL if unknown */
size_t kvb_preset_count(void);
const kvb_preset *kvb_preset_at(size_t i);

typedef struct {
    const char *preset;     /* required */
    uint32_t type;          /* weight type for matrices (F32, F16, BF16, Q8_0, Q4_0) */
    uint64_t seed;
    const char *vocab_path; /* NULL: byte-level vocabulary; .gguf: copy its tokenizer.* keys;
                               .json: a Hugging Face tokenizer.json */
    int n_threads;          /* generation threads (0 = all CPUs) */
    bool progress;          /* print progress to stderr */
} kvb_gen_opts;

/* Writes a GGUF with the preset's shapes and seeded weights. Deterministic for a given
 * (preset, type, seed, vocab) whatever the thread count. */
kvb_status kvb_gen_model(const kvb_gen_opts *o, const char *out_path, kvb_err *err);

#endif
