/* model — what a transformer is, read from GGUF metadata: the architecture description
 * (llama, qwen2, qwen3, qwen3moe, qwen2moe, gemma3, deepseek2; GQA, latent attention, mixture-of-experts
 * MLPs with an optional shared expert, RoPE with Llama-3 scaling or YaRN, per-layer RoPE bases and
 * sliding-window (local) layers, RMSNorm eps, tied output), the weights
 * bound to views into the mapped file with every shape checked against the description, and
 * the synthetic model generator behind `kvbridge gen-model` (real architectures, real GGUF
 * files, seeded weights scaled so activations stay sane and logits are not flat). */
#ifndef KVB_MODEL_H
#define KVB_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_gguf.h"
#include "kvb_kvformat.h"

typedef enum {
    KVB_ARCH_LLAMA = 0, /* Llama 2/3, Mistral, TinyLlama */
    KVB_ARCH_QWEN2,     /* llama + q/k/v bias */
    KVB_ARCH_QWEN3,     /* llama + per-head q/k RMSNorm, explicit head_dim */
    KVB_ARCH_GEMMA3,    /* Gemma 3 (text): qwen3's q/k norms + embedding scale, post-attention and post-MLP
                           norms, GeGLU MLP (tanh GELU), local sliding-window layers with their own RoPE base */
    KVB_ARCH_QWEN3MOE,  /* qwen3's attention + a mixture-of-experts MLP (softmax router, top-k, SwiGLU experts) */
    KVB_ARCH_DEEPSEEK2, /* DeepSeek V2/V3: latent attention (MLA) + leading dense layers, then MoE with shared experts */
    KVB_ARCH_QWEN2MOE,  /* qwen2's attention (q/k/v bias) + qwen3moe's experts (top-k not renormalised) + a
                           shared SwiGLU expert every token runs, scaled by a sigmoid gate */
} kvb_arch;

#define KVB_MAX_EXPERTS 1024 /* expert_count is refused above this */

#define KVB_MAX_LAYERS 1024 /* block_count is refused above this */

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
    float attn_scale;      /* attention scores are (q . k) * attn_scale; 1/sqrtf(head_dim) unless the
                              architecture says otherwise (gemma3: 1/sqrt(query_pre_attn_scalar)) */
    /* ---- Gemma 3 (zero / false for the other architectures) ---- */
    float embd_scale;      /* token embedding rows are multiplied by this in f32 (gemma3: sqrtf(n_embd)); 0 = none */
    bool has_post_norms;   /* post_attention_norm on the attention output and post_ffw_norm on the MLP output,
                              each before its residual add */
    bool mlp_gelu;         /* MLP is down(gelu_tanh(gate h) * up h) (GeGLU) instead of SwiGLU */
    uint32_t swa_window;   /* local layers: a query at position p attends keys at k with p - k < swa_window
                              (the query itself and the swa_window - 1 before it); 0 = no local layers */
    uint32_t swa_pattern;  /* without swa_layers_explicit: layer i is local iff swa_pattern == 0 or
                              i % swa_pattern < swa_pattern - 1 (llama.cpp's reading; gemma3: 6 = five local
                              layers, then one global: layer i is global iff (i + 1) % 6 == 0) */
    bool swa_layers_explicit;              /* the file listed each layer: swa_local_mask is the truth */
    uint64_t swa_local_mask[KVB_MAX_LAYERS / 64]; /* bit i set: layer i is local (only with swa_layers_explicit) */
    float rope_freq_base_local; /* RoPE base of local layers (gemma3: 10000); rope scaling applies to global
                                   layers only, as Gemma 3's rope_scaling does */
    /* ---- mixture of experts (qwen3moe; zero / false for dense models) ---- */
    uint32_t n_expert;      /* {arch}.expert_count: experts per layer; 0 = dense MLP */
    uint32_t n_expert_used; /* {arch}.expert_used_count: experts each token is routed to (top-k) */
    uint32_t n_ff_exp;      /* {arch}.expert_feed_forward_length: one expert's inner size */
    bool expert_weights_norm; /* {arch}.expert_weights_norm: the top-k probabilities are divided by their sum
                                 (qwen3moe: true, llama.cpp's default for the architecture when the key is absent) */
    /* The shared expert (qwen2moe, deepseek2; 0 = none): one SwiGLU every token runs beside the routed ones.
     * qwen2moe reads its width from {arch}.expert_shared_feed_forward_length; deepseek2 has no such key and
     * llama.cpp sizes its ffn_*_shexp tensors n_ff_exp * n_expert_shared (its experts concatenated). */
    uint32_t n_ff_shexp;    /* the shared expert's inner size */
    /* ---- DeepSeek's latent attention and MoE (deepseek2; zero / false for the others) ----
     * As llama.cpp's converter writes the MLA form: head_count_kv 1, key_length = kv_lora_rank + n_rot
     * (head_dim above: the one cache row per token and layer, latent then roped key part), value_length =
     * kv_lora_rank, and the per-head query/key and value sizes in the *_mla keys. */
    bool mla;                  /* attention through a compressed latent (deepseek2) */
    uint32_t n_lora_q;         /* attention.q_lora_rank: 0 = the query projected directly (attn_q; V2-Lite) */
    uint32_t n_lora_kv;        /* attention.kv_lora_rank: the latent's width */
    uint32_t head_dim_k_mla;   /* attention.key_length_mla: one query/key head, nope part + n_rot */
    uint32_t head_dim_v_mla;   /* attention.value_length_mla: one value head */
    uint32_t n_layer_dense_lead; /* leading_dense_block_count: the first layers have a dense MLP (n_ff) */
    uint32_t n_expert_shared;  /* expert_shared_count: always-on experts; n_ff_shexp = n_ff_exp * this */
    float expert_weights_scale; /* expert_weights_scale: routed weights multiplied by this; 0 = 1 */
    uint32_t expert_gating;    /* expert_gating_func: KVB_GATING_SOFTMAX or KVB_GATING_SIGMOID */
    uint32_t n_expert_groups;  /* expert_group_count: routing picks groups first (0 or 1: no groups) */
    uint32_t n_group_used;     /* expert_group_used_count: groups kept per token */
    /* YaRN rope scaling (rope.scaling.type yarn); factor 0 = none. rope_orig_ctx above is its
     * original_context_length. */
    float rope_yarn_factor;    /* rope.scaling.factor */
    float rope_yarn_log_mul;   /* rope.scaling.yarn_log_multiplier / 0.1 (llama.cpp's reading: the converter
                                  stores 0.1 * mscale_all_dim) */
    float rope_attn_factor;    /* rope.scaling.attn_factor (1 when absent) */
    float yarn_beta_fast, yarn_beta_slow; /* llama.cpp's defaults 32 and 1 (no key read for deepseek2) */
} kvb_model_desc;

#define KVB_GATING_SOFTMAX 1u /* llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX */
#define KVB_GATING_SIGMOID 2u /* ... _SIGMOID */

/* Whether layer `layer` of a deepseek2 model has the dense MLP (a leading dense layer) rather than
 * its experts; true for every layer of a dense model, false for every layer of qwen3moe. */
bool kvb_layer_is_dense(const kvb_model_desc *d, uint32_t layer);

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
    const float *post_attn_norm; /* gemma3 (n_embd) f32, else NULL */
    const float *ffn_norm;   /* (n_embd) */
    kvb_mat w_gate, w_up;    /* (n_ff, n_embd) */
    kvb_mat w_down;          /* (n_embd, n_ff) */
    const float *post_ffw_norm;  /* gemma3 (n_embd) f32, else NULL */
    /* mixture of experts (n_expert > 0; the dense w_gate/w_up/w_down are then absent, data NULL).
     * The expert tensors are ggml's 3-D stacks viewed as one matrix: row r of expert x is row
     * x * rows_per_expert + r. */
    kvb_mat ffn_gate_inp;        /* router (n_expert, n_embd) */
    kvb_mat gate_exps, up_exps;  /* (n_expert * n_ff_exp, n_embd) */
    kvb_mat down_exps;           /* (n_expert * n_embd, n_ff_exp) */
    /* deepseek2 (mla; else data NULL). H = n_head, R = n_lora_kv, P = n_rot, N = head_dim_k_mla - P (nope),
     * Vd = head_dim_v_mla. Without q_lora, wq above is attn_q (H * (N + P), n_embd); wo is (n_embd, H * Vd). */
    kvb_mat wq_a;                /* attn_q_a (n_lora_q, n_embd) */
    const float *q_a_norm;       /* attn_q_a_norm (n_lora_q) */
    kvb_mat wq_b;                /* attn_q_b (H * (N + P), n_lora_q) */
    kvb_mat wkv_a;               /* attn_kv_a_mqa (R + P, n_embd): the latent, then the key's rope part */
    const float *kv_a_norm;      /* attn_kv_a_norm (R) */
    kvb_mat wk_b;                /* attn_k_b, ggml [N, R, H]: (H * R, N), head h's rows h*R .. */
    kvb_mat wv_b;                /* attn_v_b, ggml [R, Vd, H]: (H * Vd, R) */
    const float *exp_probs_b;    /* exp_probs_b.bias (n_expert): selection bias (V3), or NULL */
    /* the shared expert (n_ff_shexp > 0 and an MoE layer, else data NULL): out += g * SwiGLU(x), where
     * g = sigmoid(gate_inp_shexp . x) when the gate is present (qwen2moe), else 1 (deepseek2) */
    kvb_mat gate_inp_shexp;      /* ffn_gate_inp_shexp (1, n_embd), or data NULL */
    kvb_mat gate_shexp, up_shexp; /* ffn_{gate,up}_shexp (n_ff_shexp, n_embd) */
    kvb_mat down_shexp;          /* ffn_down_shexp (n_embd, n_ff_shexp) */
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
/* Parameters excluding token embeddings (for FLOP counts); every expert counts. */
uint64_t kvb_model_n_params_nonembd(const kvb_model_desc *d);
/* The non-embedding parameters one token reads: kvb_model_n_params_nonembd with only the
 * n_expert_used routed experts of each layer counted (the router counts whole); a dense model's
 * is kvb_model_n_params_nonembd. */
uint64_t kvb_model_n_params_active(const kvb_model_desc *d);

/* RoPE inverse frequencies for i in [0, n_rot/2): base^(-2i/n_rot), divided by the
 * rope_freqs.weight factors when the file has them, else by the Llama-3 scaling factors computed
 * from the description's keys; in double. These are the GLOBAL layers' frequencies; a model with
 * local layers (kvb_layer_is_local) rotates those with kvb_rope_inv_freq_layer's. */
void kvb_rope_inv_freq(const kvb_model *m, double *out);
/* Layer `layer`'s inverse frequencies (n_rot/2): kvb_rope_inv_freq for a global layer; for a local
 * layer rope_freq_base_local^(-2i/n_rot) with no scaling. */
void kvb_rope_inv_freq_layer(const kvb_model *m, uint32_t layer, double *out);
/* Whether layer `layer` is a local (sliding-window) layer; false for every layer of a model
 * without local layers (swa_window == 0) and for layer >= n_layer. */
bool kvb_layer_is_local(const kvb_model_desc *d, uint32_t layer);
/* Whether any layer is local. */
bool kvb_model_has_local_layers(const kvb_model_desc *d);
/* The decoder's cache format for this model: kvb_kvformat_init with the model's geometry, and its
 * local layers and window (kvb_kvformat_set_window) when it has any. Every node and tool that
 * stores or ships this model's cache takes its format from here, so the fingerprints agree. */
kvb_status kvb_model_kvformat(const kvb_model_desc *d, uint32_t dtype, uint32_t block_tokens, kvb_kvformat *f,
                              kvb_err *err);
/* Cache bytes one token costs over all layers in dtype: *cache as the decoder's format holds it (the
 * latent row for an MLA model), *per_head the same model's cache expanded to per-head K and V
 * (MLA: n_head heads of key_length_mla and value_length_mla; equal to *cache for the others). A
 * row length dtype cannot encode counts 0. */
void kvb_model_cache_token_bytes(const kvb_model_desc *d, uint32_t dtype, uint64_t *cache, uint64_t *per_head);
/* The RoPE table every engine and the bridge use (one table, computed on the host in double and
 * rounded to f32 once): for positions pos0 .. pos0+n_pos-1 and i < n_rot/2,
 *     cos_out[p * (n_rot/2) + i] = (float)cos(pos * inv_freq[i]), sin_out likewise.  */
void kvb_rope_table(const double *inv_freq, uint32_t n_rot, uint32_t pos0, uint32_t n_pos, float *cos_out,
                    float *sin_out);
/* The same table with its positions split over `pool` (NULL: this thread), each position computed
 * whole by one task: the same numbers whatever the pool. */
void kvb_rope_table_pool(kvb_pool *pool, const double *inv_freq, uint32_t n_rot, uint32_t pos0, uint32_t n_pos,
                         float *cos_out, float *sin_out);
/* Llama-3 frequency divisors (what llama.cpp's converter stores as rope_freqs.weight). */
void kvb_llama3_rope_factors(const kvb_model_desc *d, float *out);

/* The RoPE tables of one span of positions for every kind of layer a model has: the global
 * table, and a local one when local layers rotate with another base. The CPU engine and the CPU
 * bridge both fill one per chunk and hand each layer's own table to kvb_kv_produce. */
typedef struct {
    const kvb_model *m;
    uint32_t half;            /* n_rot / 2 */
    uint32_t cap;             /* positions the tables hold */
    uint32_t n_kinds;         /* 1 (global only) or 2 (global, local) */
    double *inv_freq;         /* (n_kinds, half) */
    float *cos, *sin;         /* (n_kinds, cap, half) for positions pos0 .. pos0 + n - 1 */
    uint32_t pos0, n;         /* the span last filled (n = 0: none yet) */
    bool ggml;                /* filled as ggml's rope does (kvb_rope_tables_set_ggml) */
    float ggml_theta_scale[2], ggml_freq_scale[2]; /* per kind: powf(base, -2.0f/n_rot); 1/linear factor */
    float *ggml_factors;      /* (half) the global kind's frequency divisors, or NULL */
} kvb_rope_tables;
kvb_status kvb_rope_tables_init(kvb_rope_tables *t, const kvb_model *m, uint32_t cap, kvb_err *err);
/* From the next fill on, cos/sin as ggml's CPU rope computes them (ggml_rope_cache_init, f32):
 * theta = (float)pos, then per pair i: c = cosf(freq_scale * (theta / factor_i)), s = sinf(...),
 * theta *= powf(base, -2.0f / n_rot); the local kind with its own base, unscaled. A YaRN model
 * (rope_yarn_factor > 1) keeps the double-precision table: KVB_ERR_UNSUPPORTED. */
kvb_status kvb_rope_tables_set_ggml(kvb_rope_tables *t, kvb_err *err);
void kvb_rope_tables_free(kvb_rope_tables *t);
/* Fills every kind's table for positions pos0 .. pos0 + n - 1 (n <= cap) with kvb_rope_table. */
void kvb_rope_tables_fill(kvb_rope_tables *t, uint32_t pos0, uint32_t n);
/* Fills row i of every kind's table for position pos[i], i < n (n <= cap): a batch of sequences. */
void kvb_rope_tables_fill_at(kvb_rope_tables *t, const uint32_t *pos, uint32_t n);
/* Which kind's table layer `layer` rotates with: 0 (global) or 1 (local); its inverse frequencies
 * are inv_freq + kind * half. The CUDA engine and the CUDA bridge key their tables by it. */
uint32_t kvb_rope_tables_kind(const kvb_rope_tables *t, uint32_t layer);
/* Layer `layer`'s table for the filled span: *cos, *sin (n, half). */
void kvb_rope_tables_layer(const kvb_rope_tables *t, uint32_t layer, const float **cos, const float **sin);

/* ---- synthetic models ------------------------------------------------------------------------ */

typedef struct {
    const char *name;       /* "tiny", "qwen3-0.6b", "llama3.2-1b", "llama3.1-8b", "gemma3-270m", ... */
    const char *summary;
    kvb_model_desc d;       /* shapes; n_vocab is replaced by the vocabulary's size */
} kvb_preset;

const kvb_preset *kvb_preset_find(const char *name); /* NULL if unknown */
size_t kvb_preset_count(void);
const kvb_preset *kvb_preset_at(size_t i);

typedef struct {
    const char *preset;     /* required */
    uint32_t type;          /* weight type for matrices (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K;
                               the K-quants need every row a multiple of 256) */
    uint64_t seed;
    const char *vocab_path; /* NULL: byte-level vocabulary; .gguf: copy its tokenizer.* keys;
                               .json: a Hugging Face tokenizer.json */
    uint32_t n_layers;      /* 0: the preset's layers; else the first n_layers of them (a layer subset of a
                               model too large to generate whole; at most the preset's) */
    int n_threads;          /* generation threads (0 = all CPUs) */
    bool progress;          /* print progress to stderr */
} kvb_gen_opts;

/* Writes a GGUF with the preset's shapes and seeded weights. Deterministic for a given
 * (preset, type, seed, vocab) whatever the thread count. */
kvb_status kvb_gen_model(const kvb_gen_opts *o, const char *out_path, kvb_err *err);

#endif
